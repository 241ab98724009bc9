"""Crash scenario: SIGKILL a daemon at random moments under load; every committed block must survive."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from benchmarks.daemons import payload_for
from benchmarks.reliability import Fleet, committed_keys, daemon_config, start_daemon
from tiercache.client import Client
from tiercache.tenancy import scope_key


@dataclass
class CrashReport:
    cycles: int = 0
    puts_returned: int = 0  # blocks whose Put returned before some kill
    committed_checked: int = 0  # committed blocks read back after a restart (summed over cycles)
    lost_in_flight: int = 0  # blocks whose Put returned but had not reached LMDB at the kill
    max_lost_age_s: float = 0.0  # the oldest such Put, seconds before the kill
    max_recovery_s: float = 0.0  # longest wait of a worker, after the daemon was back, to get through
    bytes_lost: int = 0  # payload bytes of committed blocks missing or altered after a restart
    retried_ok: int = 0  # Puts that failed while the daemon was down and succeeded on a retry
    worker_ops: int = 0
    evicted: int = 0  # committed blocks the checker evicted to keep the store at KEEP_BLOCKS
    problems: list[str] = field(default_factory=list)


OLD_SAMPLE = 1024  # blocks committed before the previous kill re-read after each restart (all of them at the end)
NEW_SAMPLE = 2048  # blocks committed since the previous kill re-read after each restart (all of them at the end)
# The checker evicts the oldest committed blocks past this many after each restart: a restart loads every
# block's index entry (about 5 s at 64,000 blocks here) and the whole-store checks grow with it, so an
# unbounded store made each cycle slower than the one before.
KEEP_BLOCKS = 16384


def check_restart(client: Client, committed: dict[bytes, bytes], report: CrashReport) -> None:
    """Every block of `committed` (store key -> client key) must come back bit-identical; Verify of
    the same blocks must find nothing."""
    store_keys = list(committed)
    got: dict[bytes, object] = {}
    for start in range(0, len(store_keys), 512):
        for block in client.fetch_store_keys(store_keys[start : start + 512]):
            got[block.meta.key] = block
    for store_key, key in committed.items():
        block = got.get(store_key)
        nbytes = block.meta.nbytes if block is not None else 4096  # type: ignore[attr-defined]
        if block is None or not bool((block.payload == payload_for(key, nbytes)).all()):  # type: ignore[attr-defined]
            report.bytes_lost += nbytes
            report.problems.append(f"cycle {report.cycles}: committed block {key.hex()[:16]} "
                                   f"{'missing' if block is None else 'altered'} after restart")
    report.committed_checked += len(committed)
    for start in range(0, len(store_keys), 512):
        result = client.verify(store_keys[start : start + 512])
        if result.num_failed or not result.integrity_ok:
            report.problems.append(f"cycle {report.cycles}: verify failed={result.num_failed} "
                                   f"integrity={result.integrity_error!r}")


def run_crash(base: str, *, cycles: int, workers: int = 3, seed: int = 0, ns: str = "small",
              max_gap_s: float = 0.5, disk_bytes: int = 1 << 30,
              progress: Callable[[str], None] | None = None) -> CrashReport:
    """`cycles` SIGKILLs of a subprocess daemon under load from `workers` processes, checked after each
    restart: every block committed at the previous kill still committed at this one (the committed
    sets compared whole; the load never removes a block, and `disk_bytes` must hold all it puts, or
    eviction would count as loss), and NEW_SAMPLE of the blocks committed since the previous kill and
    OLD_SAMPLE of those committed before it read back bit-identical and verified; then the checker
    evicts the oldest committed blocks past KEEP_BLOCKS, which are expected nowhere from then on.
    After the last cycle, every committed block and a Verify of the whole store. (Re-reading every new block after
    each restart made a check as long as the cycle before it, while the load kept putting: the store
    grew faster each cycle, and 200 cycles took hours.) `progress` gets a line with the figures so
    far after each cycle."""
    rng, sample_rng = random.Random(seed), random.Random(seed + 1)  # the kills' schedule apart from the store's
    config, conf = daemon_config(base, host_pages=256, disk_bytes=disk_bytes)
    report = CrashReport()
    # Workers start with the daemon (their imports overlap its start) and retry until it answers.
    fleet = Fleet(base, f"unix:{config.server.socket}", workers, mix="durable", ns=ns, seed=seed)
    outages: list[tuple[float, float]] = []  # (killed, ready again)
    killed_at = spawned_at = 0.0
    previous_on_disk: set[bytes] = set()
    by_store_key: dict[bytes, bytes] = {}  # store key -> client key of every block a worker meant to put
    issued: dict[bytes, float] = {}  # client key -> when its chain was first meant
    seen_intents = 0  # of fleet.lines("I"), how many are in the two above
    last_committed: dict[bytes, bytes] = {}
    order: list[bytes] = []  # store keys in the order they were first seen committed
    removed: set[bytes] = set()  # store keys the checker evicted (KEEP_BLOCKS): no longer expected anywhere
    daemon = None
    try:
        daemon = start_daemon(conf)
        for cycle in range(cycles):
            report.cycles = cycle + 1
            fleet.wait_puts(rng.randint(3, 40))
            time.sleep(rng.uniform(0, max_gap_s))  # land the kill anywhere in the traffic
            previous_kill, killed_at = killed_at, time.monotonic()
            daemon.proc.kill()
            daemon.proc.wait(30)
            on_disk = committed_keys(config.data_dir)
            intents = fleet.lines("I")
            for t, keys in intents[seen_intents:]:
                for key in keys:
                    by_store_key.setdefault(scope_key("local", key), key)
                    issued.setdefault(key, t)
            seen_intents = len(intents)
            strangers = on_disk - by_store_key.keys()
            if strangers:
                report.problems.append(f"cycle {cycle + 1}: {len(strangers)} committed blocks nobody put")
            committed = {s: by_store_key[s] for s in on_disk if s in by_store_key and s not in removed}
            gone = previous_on_disk - on_disk - removed
            if gone:
                report.bytes_lost += 4096 * len(gone)
                report.problems.append(f"cycle {cycle + 1}: {len(gone)} blocks committed at the previous kill "
                                       "are no longer committed")
            old = sorted(s for s in committed if s in previous_on_disk)
            new = sorted(s for s in committed if s not in previous_on_disk)
            order += new
            checked = {s: committed[s] for s in sample_rng.sample(new, min(len(new), NEW_SAMPLE))}
            checked.update((s, committed[s]) for s in sample_rng.sample(old, min(len(old), OLD_SAMPLE)))
            returned = fleet.returned(before=killed_at, after=previous_kill)
            lost = []
            for key, t in returned.items():
                if scope_key("local", key) in removed:
                    continue
                if t < spawned_at and issued.get(key, t) < previous_kill:
                    # Sent before the previous kill, its return logged after it but before the next daemon
                    # was even started: the killed daemon answered just before dying. Judged at that kill.
                    # (A retry answered by the next daemon returns after spawned_at: judged here.)
                    if scope_key("local", key) not in previous_on_disk:
                        lost.append(0.0)
                elif scope_key("local", key) not in on_disk:
                    lost.append(killed_at - t)
            previous_on_disk = on_disk
            report.lost_in_flight += len(lost)
            report.max_lost_age_s = max([report.max_lost_age_s, *lost])
            report.puts_returned += len(returned)
            spawned_at = time.monotonic()
            daemon = start_daemon(conf)
            outages.append((killed_at, time.monotonic()))
            with Client(daemon.addresses[0], timeout_s=60) as client:
                check_restart(client, checked, report)
                live = [s for s in order if s in committed]
                order = live[-KEEP_BLOCKS:]
                for start in range(0, len(live) - KEEP_BLOCKS, 512):
                    victims = live[start : min(start + 512, len(live) - KEEP_BLOCKS)]
                    client.evict([committed[s] for s in victims])
                    removed.update(victims)
                    report.evicted += len(victims)
            checked_at = time.monotonic()
            last_committed = {s: k for s, k in committed.items() if s not in removed}
            if progress is not None:
                progress(f"crash: cycle {cycle + 1} of {cycles}: committed blocks re-read {report.committed_checked}; "
                         f"bytes lost {report.bytes_lost}; Puts returned but not yet on disk at a kill "
                         f"{report.lost_in_flight} of {report.puts_returned}; problems {len(report.problems)}; "
                         f"{len(on_disk)} blocks on disk; down {outages[-1][1] - killed_at:.1f} s "
                         f"(restart {outages[-1][1] - spawned_at:.1f} s), check {checked_at - outages[-1][1]:.1f} s")
        # Every worker reconnects by itself and carries on (gRPC's reconnect backoff sets the delay).
        last_recovery = fleet.wait_each_put(after=outages[-1][1], timeout_s=120)
        summaries = fleet.stop()
        with Client(daemon.addresses[0], timeout_s=60) as client:  # all that the last kill left, and the whole store
            check_restart(client, last_committed, report)
            result = client.verify()
            if result.num_failed or not result.integrity_ok:
                report.problems.append(f"final verify failed={result.num_failed} integrity={result.integrity_error!r}")
        for back, down in fleet.recoveries():
            ready = next((r for k, r in outages if k <= back and down <= r), None)
            if ready is not None:
                report.max_recovery_s = max(report.max_recovery_s, back - ready)
        report.max_recovery_s = max(report.max_recovery_s, last_recovery)
        report.retried_ok = sum(s.retried_ok for s in summaries)
        report.worker_ops = sum(sum(s.ops.values()) for s in summaries)
        bad = sum(s.bad_blocks for s in summaries)
        if bad:
            report.problems.append(f"workers fetched {bad} chains with wrong bytes")
        report.problems += fleet.unexpected()
        if any(s.pending for s in summaries):
            report.problems.append("a worker's Put never succeeded after the restarts")
        rc = daemon.stop()
        if rc != 0:
            report.problems.append(f"final SIGTERM: exit {rc}")
    finally:
        fleet.kill()
        if daemon is not None:
            daemon.kill()
    return report
