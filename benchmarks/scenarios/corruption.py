"""Corruption scenario: damage blocks in a daemon's LMDB (bytes, meta records, whole files) and check what it serves."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field

from benchmarks.daemons import chain, tokens
from benchmarks.reliability import (
    committed_keys,
    daemon_config,
    flip,
    free_db_root,
    intact,
    payload_offset,
    start_daemon,
)
from tiercache.client import Client
from tiercache.store import TieredStore
from tiercache.tenancy import scope_key


@dataclass
class LmdbDamageReport:
    blocks: int = 0
    damaged: int = 0  # blocks whose payload or meta record was altered on disk
    served_intact: int = 0  # blocks fetched after the restart, every one bit-identical
    detected_on_read: int = 0
    detected_by_verify: int = 0
    counted: int = 0  # the disk tier's verification_failures after both
    problems: list[str] = field(default_factory=list)


def populate(config: object, num_chains: int, blocks_per_chain: int, seed: int = 0) -> list[list]:
    """Chains put through a TieredStore in this process and committed to LMDB (store keys of tenant local)."""
    import dataclasses

    store = TieredStore.open(config)  # type: ignore[arg-type]
    chains = []
    try:
        for i in range(num_chains):
            blocks = chain(tokens(seed * 1000 + i, blocks_per_chain))
            store.put_many([dataclasses.replace(b, meta=dataclasses.replace(
                b.meta, key=scope_key("local", b.meta.key), tenant="local",
                parent=scope_key("local", b.meta.parent) if b.meta.parent else b"")) for b in blocks])
            store.flush_writes()  # one transaction per chain: LMDB frees and reuses pages between them
            chains.append(blocks)
    finally:
        store.close()
    return chains


def run_lmdb_damage(base: str, *, num_chains: int = 8, seed: int = 0) -> LmdbDamageReport:
    """Damage one block of most chains (payload bytes, or its meta record), restart the daemon, read
    half the chains and Verify the rest: every damaged block must be caught, nothing else lost."""
    rng = random.Random(seed)
    config, conf = daemon_config(base)
    chains = populate(config, num_chains, 4, seed)
    report = LmdbDamageReport(blocks=sum(map(len, chains)))
    data_mdb = os.path.join(config.data_dir, "disk", "data.mdb")
    with open(data_mdb, "rb") as f:
        content = f.read()
    victims: dict[int, int] = {}  # chain -> index of its damaged block
    for c in range(num_chains - 1):  # the last chain stays intact
        i = rng.randrange(4)
        block = chains[c][i]
        if c % 4 == 3:  # the meta db record: one digit of the key it names
            needle = b'"key":"' + scope_key("local", block.meta.key).hex().encode()
            # Copy-on-write leaves stale copies of the meta page in free pages: damage every copy.
            spots = [at + 7 + rng.randrange(64) for at in _all(content, needle)]
        else:  # payload bytes, one to three of them within one word (sum64 catches any change in a word)
            at = payload_offset(content, block)
            spots = [at + 8 * rng.randrange(block.meta.nbytes // 8)] if at >= 0 else []
        if not spots:
            report.problems.append(f"chain {c}: block {i} not found in data.mdb")
            continue
        # Never bit 5 in the meta record: it only changes the case of a hex letter of the key, which
        # bytes.fromhex reads as the same key (the record is then not damaged at all).
        width, mask = rng.randint(1, 3), 1 << rng.choice([0, 1, 2, 3, 4, 6, 7] if c % 4 == 3 else range(8))
        for spot in spots:
            for k in range(width):
                flip(data_mdb, spot + k, mask)
        victims[c] = i
    report.damaged = len(victims)
    daemon = start_daemon(conf)
    try:
        with Client(daemon.addresses[0], timeout_s=30) as client:
            for c, blocks in enumerate(chains[: num_chains // 2]):
                keys = [b.meta.key for b in blocks]
                for shared_memory in (True, False):
                    got = client.fetch(keys, shared_memory=shared_memory)
                    if not intact(got) or [b.meta.key for b in got] != keys[: len(got)]:
                        report.problems.append(f"chain {c}: damaged bytes served")
                    expected = victims.get(c, len(keys))
                    if len(got) != expected:
                        report.problems.append(f"chain {c}: {len(got)} blocks served, expected {expected}")
                    report.served_intact += len(got) if intact(got) else 0
                report.detected_on_read += c in victims
            result = client.verify()
            report.detected_by_verify = result.num_failed
            late = [c for c in victims if c >= num_chains // 2 and c % 4 != 3]  # meta damage: dropped at open
            if result.num_failed != len(late) or not result.integrity_ok:
                report.problems.append(f"verify: {result.num_failed} failed, expected {len(late)}; "
                                       f"integrity {result.integrity_error!r}")
            stats = client.stats()
            report.counted = next(t.verification_failures for t in stats.tiers if t.tier == "disk")
            if report.counted != report.damaged:
                report.problems.append(f"disk verification_failures={report.counted}, damaged={report.damaged}")
            for c, blocks in enumerate(chains):  # everything not damaged is still served
                keys = [b.meta.key for b in blocks]
                got = client.fetch(keys, shared_memory=False)
                if len(got) != victims.get(c, len(keys)) or not intact(got):
                    report.problems.append(f"chain {c}: after verify {len(got)} blocks")
            fresh = chain(tokens(seed * 1000 + 999, 2))
            client.put(fresh)
            if not intact(client.fetch([b.meta.key for b in fresh])) or client.health() != "SERVING":
                report.problems.append("the daemon stopped serving after the damage")
        if daemon.stop() != 0:
            report.problems.append(f"SIGTERM: {daemon.stderr[-500:]}")
    finally:
        daemon.kill()
    dropped = {scope_key("local", chains[c][i].meta.key) for c, i in victims.items()}
    if dropped & committed_keys(config.data_dir):
        report.problems.append("damaged blocks are still in LMDB after the daemon dropped them")
    return report


def _all(content: bytes, needle: bytes) -> list[int]:
    found, at = [], content.find(needle)
    while at >= 0:
        found.append(at)
        at = content.find(needle, at + 1)
    return found


def damage(kind: str, data_mdb: str) -> None:
    size = os.path.getsize(data_mdb)
    if kind == "garbage header":
        with open(data_mdb, "r+b") as f:
            f.write(random.Random(0).randbytes(8192))  # both meta pages
    elif kind == "truncated":
        os.truncate(data_mdb, size // 2)
    elif kind == "free list":
        flip(data_mdb, free_db_root(data_mdb) * 4096 + 12, 1 << 2)  # mp_lower of the free-list root
