"""Reliability harness shared by tests/test_reliability_*.py and scripts/torture.py: daemons, load
processes, damage, figures."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.daemons import NS, REPO, Daemon, chain, payload_for, small_config, tokens, write_config
from tiercache.config import Config
from tiercache.keys import Namespace

# 32 KiB blocks: eight 4 KiB host pages each, so blocks span (and recycle) several pages.
NS_BIG = Namespace(model="reliability", weights="w0", dtype="float16", num_layers=4, num_kv_heads=2, head_dim=64,
                   block_tokens=16)
NAMESPACES = {"small": NS, "big": NS_BIG}
SHARED_PREFIXES = 3  # chains of every worker start with one of these, so workers put the same keys at once


def intact(blocks: list) -> bool:
    """Whether every block carries exactly the bytes its key derives (benchmarks.daemons.payload_for)."""
    import torch

    return all(torch.equal(b.payload, payload_for(b.meta.key, b.meta.nbytes)) for b in blocks)


# ---- daemons ------------------------------------------------------------------------------------

def daemon_config(base: str, *, host_pages: int = 256, disk_bytes: int = 64 << 20,
                  **server: object) -> tuple[Config, str]:
    """A small daemon config under `base` and the TOML file the subprocess daemon reads."""
    config = small_config(base, host_pages=host_pages, disk_bytes=disk_bytes, **server)
    return config, write_config(os.path.join(base, "tiercache.toml"), config)


def start_daemon(conf: str, timeout_s: float = 90.0) -> Daemon:
    """`tiercache serve` in a subprocess, ready to take calls."""
    daemon = Daemon(config=conf)
    daemon.wait_ready(timeout_s)
    return daemon


def committed_keys(data_dir: str) -> set[bytes]:
    """Store keys in the blocks db of a stopped daemon's LMDB: what its last committed transaction holds.

    Only while no daemon runs: lock=False skips LMDB's reader table, which is safe without a writer.
    """
    import lmdb

    env = lmdb.open(os.path.join(data_dir, "disk"), readonly=True, lock=False, max_dbs=4, subdir=True)
    try:
        db = env.open_db(b"blocks", create=False)
        with env.begin(db=db) as txn:
            return {bytes(k) for k in txn.cursor().iternext(values=False)}
    finally:
        env.close()


def rss(pid: int) -> dict[str, int]:
    """Resident memory of a process in bytes: total, anonymous (heap), file-backed (LMDB map), shmem (slab)."""
    fields = {"VmRSS": "total", "RssAnon": "anon", "RssFile": "file", "RssShmem": "shmem"}
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in fields:
                out[fields[name]] = int(value.split()[0]) * 1024
    return out


def slope(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope of (t, y) samples, in y units per second."""
    n = len(samples)
    if n < 2:
        return 0.0
    mt = sum(t for t, _ in samples) / n
    my = sum(y for _, y in samples) / n
    var = sum((t - mt) ** 2 for t, _ in samples)
    return sum((t - mt) * (y - my) for t, y in samples) / var if var else 0.0


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


# ---- damage ---------------------------------------------------------------------------------------

def flip(path: str | Path, offset: int, mask: int = 0xFF) -> None:
    """XOR one byte of a file in place."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ mask]))


def _newest_meta(head: bytes) -> int:
    """Offset of the newer of LMDB's two meta pages (4 KiB pages; LMDB 0.9 layout: 16-byte page header,
    then magic, version, address, mapsize, the free and main MDB_db (48 bytes each), last_pg, txnid)."""
    return max((int.from_bytes(head[page * 4096 + 144 : page * 4096 + 152], "little"), page * 4096)
               for page in (0, 1))[1]


def free_db_root(data_mdb: str | Path) -> int:
    """Page number of the free-list root (md_root of the meta's free MDB_db) in the newer meta page."""
    with open(data_mdb, "rb") as f:
        head = f.read(8192)
    return int.from_bytes(head[_newest_meta(head) + 80 : _newest_meta(head) + 88], "little")


def sub_db_root(data_mdb: str | Path, name: bytes) -> int:
    """Page number of the root of the named sub-db, read from the main db's root leaf (node header:
    lo, hi, flags, ksize as u16; then the key, then the sub-db's MDB_db, whose md_root is at offset 40)."""
    with open(data_mdb, "rb") as f:
        content = f.read()
    main_root = int.from_bytes(content[_newest_meta(content) + 128 : _newest_meta(content) + 136], "little")
    page = content[main_root * 4096 : (main_root + 1) * 4096]
    assert page[10] & 0x02, "the main db root is not a leaf (more sub-dbs than expected)"
    for i in range((int.from_bytes(page[12:14], "little") - 16) // 2):
        node = int.from_bytes(page[16 + 2 * i : 18 + 2 * i], "little")
        ksize = int.from_bytes(page[node + 6 : node + 8], "little")
        if page[node + 8 : node + 8 + ksize] == name:
            at = node + 8 + ksize + 40
            return int.from_bytes(page[at : at + 8], "little")
    raise KeyError(f"no sub-db {name!r} in {data_mdb}")


def payload_offset(content: bytes, block: object) -> int:
    """Where a block's payload lies in a data.mdb image (found by a 64-byte sample of it), or -1."""
    payload = block.payload  # type: ignore[attr-defined]
    start = min(1024, payload.numel() // 2)
    needle = payload[start : start + 64].numpy().tobytes()
    at = content.find(needle)
    if at < 0 or content.find(needle, at + 1) >= 0:
        return -1
    return at - start


def slab_pages(address: str, keys: list[bytes]) -> tuple[str, int, int, list[list[int]]]:
    """(slab path, header_bytes, page_bytes, pages of each block) of the host-resident prefix of `keys`,
    asked as a same-host client would: a shared-memory Fetch, its descriptors parsed by hand."""
    import grpc

    from tiercache.client import CHANNEL_OPTIONS, parse_fetch_response
    from tiercache.v1 import tiercache_pb2 as pb

    channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    try:
        call = channel.unary_stream("/tiercache.v1.TierCache/Fetch",
                                    request_serializer=pb.FetchRequest.SerializeToString)
        slab, pages = None, []
        for data in call(pb.FetchRequest(keys=keys, shared_memory=True), timeout=30):
            info, items = parse_fetch_response(data)
            slab = info or slab
            pages += [list(body.pages) for _, body in items if isinstance(body, pb.SlabBlock)]
        assert slab is not None, "the daemon sent no slab descriptor"
        return slab.path, slab.header_bytes, slab.page_bytes, pages
    finally:
        channel.close()


# ---- load processes -------------------------------------------------------------------------------

@dataclass
class WorkerArgs:
    """What one load process does; passed as JSON on its command line."""

    address: str
    seed: int
    seconds: float
    stop_file: str
    log: str
    mix: str = "durable"  # a key of MIXES
    ns: str = "small"
    max_blocks: int = 5  # blocks per chain, after a shared prefix of 2


@dataclass
class WorkerSummary:
    ops: Counter = field(default_factory=Counter)
    errors: Counter = field(default_factory=Counter)  # by exception class
    latencies: dict = field(default_factory=lambda: defaultdict(list))  # op -> seconds
    bad_blocks: int = 0  # fetched blocks whose bytes were wrong: must stay 0
    retried_ok: int = 0  # puts that failed while the daemon was down and succeeded on a retry
    pending: int = 0  # puts still failing when the worker stopped

    def to_json(self) -> str:
        return json.dumps({"ops": self.ops, "errors": self.errors, "bad_blocks": self.bad_blocks,
                           "retried_ok": self.retried_ok, "pending": self.pending,
                           "latencies": {k: [round(x, 6) for x in v] for k, v in self.latencies.items()}})


MIXES = {
    "durable": {"put": 4, "fetch_shm": 2, "fetch_bytes": 2, "lookup": 2},
    "mixed": {"put": 25, "put_ttl": 3, "fetch_shm": 20, "fetch_bytes": 15, "lookup": 15, "prefetch": 5,
              "stats": 3, "list": 2, "pin": 4, "evict": 3, "flush_tier": 1, "verify_keys": 2, "report": 2},
    # Nothing removed on purpose: the tiers stay full, so every Put evicts (steady state for a soak).
    "soak": {"put": 30, "fetch_shm": 25, "fetch_bytes": 20, "lookup": 15, "prefetch": 5, "stats": 2, "list": 1,
             "verify_keys": 2},
}
BACKPRESSURE = ("CapacityExceeded", "QuotaExceeded")  # documented: retry later
DOWN = ("Unavailable", "DeadlineExceeded")  # the daemon is restarting: retry


def run_worker(args: WorkerArgs) -> WorkerSummary:
    """Load loop of one process: log each Put's keys before ("I") and after it returned ("P", with the
    CLOCK_MONOTONIC time, comparable across processes), check every fetched byte, retry when down."""
    from tiercache.client import Client
    from tiercache.errors import TierCacheError

    ns = NAMESPACES[args.ns]
    rng = random.Random(args.seed)
    socket_path = args.address.removeprefix("unix:")
    waited = time.monotonic() + 120
    # Started alongside the daemon: the first call waits for its socket, not for gRPC's reconnect backoff.
    while args.address.startswith("unix:") and not os.path.exists(socket_path) and time.monotonic() < waited:
        time.sleep(0.02)
    client = Client(args.address, timeout_s=10)
    summary = WorkerSummary()
    log = open(args.log, "a", buffering=1)
    prefixes = [tokens(100 + i, 2) for i in range(SHARED_PREFIXES)]
    mine: list[list] = []  # chains whose Put returned
    pending: list = []  # a chain whose Put failed while the daemon was down: retried first
    ops, weights = zip(*MIXES[args.mix].items())
    deadline = time.monotonic() + args.seconds
    serial = failed_tries = 0
    down_since = 0.0
    while time.monotonic() < deadline and not os.path.exists(args.stop_file):
        op = "put" if pending else rng.choices(ops, weights)[0]
        if not mine:
            op = "put"
        try:
            started = time.monotonic()
            if op in ("put", "put_ttl"):
                if not pending:
                    serial += 1
                    prefix = rng.choice(prefixes)
                    pending = chain(tokens(args.seed * 1_000_003 + serial, 2 + rng.randint(1, args.max_blocks - 2),
                                           prefix), ns)
                    log.write(f"I {time.monotonic():.6f} {','.join(b.meta.key.hex() for b in pending)}\n")
                client.put(pending, ttl_s=2.0 if op == "put_ttl" else None)
                log.write(f"P {time.monotonic():.6f} {','.join(b.meta.key.hex() for b in pending)}\n")
                summary.retried_ok += failed_tries > 0
                failed_tries = 0
                mine.append([b.meta.key for b in pending])
                pending = []
            else:
                keys = rng.choice(mine)
                _one_op(client, op, keys, rng, summary)
            summary.latencies[op].append(time.monotonic() - started)
            summary.ops[op] += 1
            if down_since:  # back after the daemon was unreachable
                log.write(f"R {time.monotonic():.6f} {down_since:.6f}\n")
                down_since = 0.0
        except TierCacheError as e:
            name = type(e).__name__
            summary.errors[name] += 1
            if name in DOWN:
                down_since = down_since or started
                failed_tries += bool(pending)
                time.sleep(0.1)
            elif name not in BACKPRESSURE:
                log.write(f"X {time.monotonic():.6f} {op} {name}: {e}\n")
            if op.startswith("put") and name in BACKPRESSURE:
                pending, failed_tries = [], 0
    summary.pending = len(pending)
    log.write(f"S {summary.to_json()}\n")
    log.close()
    client.close()
    return summary


def _one_op(client: Any, op: str, keys: list[bytes], rng: random.Random, summary: WorkerSummary) -> None:
    from tiercache.errors import NotFound
    from tiercache.tenancy import scope_keys

    if op in ("fetch_shm", "fetch_bytes"):
        got = client.fetch(keys, shared_memory=op == "fetch_shm")
        summary.bad_blocks += [b.meta.key for b in got] != keys[: len(got)] or not intact(got)
    elif op == "verify_keys":
        result = client.verify(scope_keys("local", keys))
        summary.bad_blocks += bool(result.num_failed or not result.integrity_ok)
    elif op == "pin":
        try:
            client.pin(keys[:1], ttl_s=1.0)
        except NotFound:  # evicted meanwhile: a documented answer, not an error
            pass
        client.unpin(keys[:1])
    else:
        {"lookup": lambda: client.lookup(keys), "prefetch": lambda: client.prefetch(keys), "stats": client.stats,
         "list": lambda: client.list(limit=50), "evict": lambda: client.evict(keys[-1:]),
         "flush_tier": lambda: client.flush(tier=rng.choice(["host", "disk"])),
         "report": lambda: client.report(prompt_tokens=64, cached_tokens=32, ttft_s=0.01, prefill_s=0.005)}[op]()


class Fleet:
    """Worker processes against one daemon address; each logs its puts to its own file."""

    def __init__(self, base: str, address: str, num: int, *, seconds: float = 3600, mix: str = "durable",
                 ns: str = "small", seed: int = 0) -> None:
        self.stop_file = os.path.join(base, f"stop-{seed}")
        self.logs = [os.path.join(base, f"worker-{seed}-{i}.log") for i in range(num)]
        self._read_to: dict[str, int] = {}  # log -> bytes parsed so far
        self._parsed: dict[str, list[tuple[float, list[bytes]]]] = {"I": [], "P": []}
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.procs = []
        for i, log in enumerate(self.logs):
            args = WorkerArgs(address, seed * 100 + i + 1, seconds, self.stop_file, log, mix, ns)
            self.procs.append(subprocess.Popen([sys.executable, "-m", "benchmarks.reliability", "worker",
                                                json.dumps(args.__dict__)], env=env, stdout=subprocess.DEVNULL,
                                               stderr=subprocess.PIPE, text=True))

    def _read_logs(self) -> None:
        """Parse what the workers appended since the last call (their logs only grow): re-reading
        whole logs on every poll made a long crash run's checks, and its polling for progress, grow
        with the run and steal a core from the daemon under test."""
        for log in self.logs:
            if not os.path.exists(log):
                continue
            with open(log, "rb") as f:
                f.seek(self._read_to.get(log, 0))
                data = f.read()
            end = data.rfind(b"\n") + 1  # a line still being written is read next time
            self._read_to[log] = self._read_to.get(log, 0) + end
            for line in data[:end].decode().splitlines():
                parts = line.split()
                if len(parts) == 3 and parts[0] in ("I", "P"):
                    self._parsed[parts[0]].append((float(parts[1]), [bytes.fromhex(k) for k in parts[2].split(",")]))

    def lines(self, kind: str) -> list[tuple[float, list[bytes]]]:
        """Every complete `I` (chain intended) or `P` (put returned) line so far: (time, client keys)."""
        self._read_logs()
        return self._parsed[kind]

    def returned(self, before: float = float("inf"), after: float = 0.0) -> dict[bytes, float]:
        """Client key -> when its Put first returned, for Puts that returned between `after` and `before`."""
        out: dict[bytes, float] = {}
        for t, keys in self.lines("P"):
            if after <= t < before:
                for key in keys:
                    out.setdefault(key, t)
        return out

    def recoveries(self) -> list[tuple[float, float]]:
        """(back, down since) of each time a worker got through again after the daemon was unreachable."""
        out = []
        for log in self.logs:
            with open(log) as f:
                out += [(float(p[1]), float(p[2])) for p in (line.split() for line in f if line.startswith("R "))]
        return out

    def num_puts(self) -> int:
        return len(self.lines("P"))

    def wait_puts(self, more: int, timeout_s: float = 60.0) -> None:
        """Wait until the workers have completed `more` further Puts (the load is really running)."""
        target, deadline = self.num_puts() + more, time.monotonic() + timeout_s
        while self.num_puts() < target:
            dead = [p.returncode for p in self.procs if p.poll() is not None]
            assert not dead, f"a worker died: rc={dead}: {self.procs[0].stderr.read() if self.procs else ''}"
            assert time.monotonic() < deadline, f"workers made no progress in {timeout_s} s"
            time.sleep(0.05)

    def wait_each_put(self, after: float, timeout_s: float = 60.0) -> float:
        """Wait until every worker has completed a Put that returned after `after`; returns how long
        the slowest one took from `after`."""
        deadline = time.monotonic() + timeout_s
        while True:
            firsts = []
            for log in self.logs:
                with open(log) as f:
                    times = [float(p[1]) for p in (line.split() for line in f if line.startswith("P "))]
                firsts.append(min((t for t in times if t > after), default=None))
            if all(t is not None for t in firsts):
                return max(firsts) - after  # type: ignore[type-var, operator]
            assert time.monotonic() < deadline, f"{firsts.count(None)} workers got no Put through in {timeout_s} s"
            time.sleep(0.05)

    def wait_exit(self, timeout_s: float) -> None:
        """Wait for workers started with a fixed `seconds` to finish by themselves."""
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
            time.sleep(0.1)

    def unexpected(self) -> list[str]:
        """Lines of errors other than backpressure and daemon-down retries."""
        out = []
        for log in self.logs:
            with open(log) as f:
                out += [line.strip() for line in f if line.startswith("X ")]
        return out

    def stop(self, timeout_s: float = 120.0) -> list[WorkerSummary]:
        open(self.stop_file, "w").close()
        summaries = []
        for proc, log in zip(self.procs, self.logs):
            try:
                _, err = proc.communicate(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                _, err = proc.communicate()
            assert proc.returncode == 0, f"worker exited with {proc.returncode}: {err[-2000:]}"
            with open(log) as f:
                last = [line for line in f if line.startswith("S ")][-1]
            data = json.loads(last[2:])
            summaries.append(WorkerSummary(Counter(data["ops"]), Counter(data["errors"]),
                                           defaultdict(list, data["latencies"]), data["bad_blocks"],
                                           data["retried_ok"], data["pending"]))
        return summaries

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


if __name__ == "__main__":
    if sys.argv[1] == "worker":
        run_worker(WorkerArgs(**json.loads(sys.argv[2])))
