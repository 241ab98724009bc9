"""The configurations of scripts/bench_peers.py: one function per row, same worker pool, same workload."""

from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from benchmarks.report import Row, merge_rounds
from benchmarks.runner import WorkerPool
from benchmarks.services import RedisServer, TierCacheDaemon, cpu_seconds, redis_unavailable_reason, reset_peak_rss
from benchmarks.workload import (
    VOCAB,
    Job,
    ModelSpec,
    Sizes,
    household_jobs,
    kv_bytes_per_token,
    probe_jobs,
    system_prompt,
)
from tiercache.client.touch import TOUCH_DELAY_S
from tiercache.keys import Namespace

logger = logging.getLogger(__name__)
MiB = 1 << 20
CONFIGS = {
    "none": "no cache",
    "inproc": "in-process cache per worker",
    "redis": "Redis (Unix socket)",
    "files": "one file per chunk",
    "tc-shm": "tiercache host tier, shared memory, copy",
    "tc-views": "tiercache host tier, shared memory, zero-copy views",
    "tc-grpc": "tiercache, gRPC stream",
    "tc-disk": "tiercache disk tier after a restart (probes only)",
}
# How each tiercache row fetches: copies out of the slab, views into it, or bytes over the stream.
TC_MODES = {"tc-shm": "copy", "tc-views": "views", "tc-grpc": "stream", "tc-disk": "copy"}


def mb(n: int | None) -> str:
    return "n/a" if n is None else f"{n / MiB:,.0f} MB"


@dataclass
class Bench:
    """Everything the phases share: the worker pool, the workload, the scratch directory."""

    block_tokens: int
    sizes: Sizes
    model: ModelSpec
    pool: WorkerPool
    workdir: str
    daemon: TierCacheDaemon | None = None  # launched before the workers so that both start at once
    rows: list[Row] = field(default_factory=list)  # one per configuration, over every round
    rounds: list[list[Row]] = field(default_factory=list)  # each round's own rows
    stops: list[Callable[[], None]] = field(default_factory=list)

    def jobs(self, day: int = 0) -> list[Job]:
        return household_jobs(self.sizes, VOCAB, self.pool.size, day)

    def phase(self, row: Row, backend: dict, *, fill: bool = True, day: int = 0,
              before_probe: Callable[[Job], None] | None = None, cache: tuple[int, str] | None = None) -> None:
        """Configure every worker for `backend`, run the day's workload, then the prefix probes.
        `cache` (pid, name) is the cache's own process: its CPU time over the workload goes in the row."""
        self.pool.configure(backend, self.block_tokens)
        jobs = self.jobs(day)
        log(f"  {row.label}: {len(jobs)} requests on {self.pool.size} workers")
        cpu = cpu_seconds(cache[0]) if cache else None
        row.results, row.wall_s = self.pool.run(jobs)
        if cache is not None:
            after = cpu_seconds(cache[0])
            if cpu is not None and after is not None:
                row.cpu_s, row.cache_cpu = after - cpu, cache[1]
            else:
                row.cache_cpu = "n/a (no /proc here)"
        else:
            row.cache_cpu = "n/a (no cache)" if backend["kind"] == "none" else "n/a (in the workers)"
        degraded = [r["degraded"] for r in row.results if r["degraded"]]
        if degraded:
            raise RuntimeError(f"{row.label}: the cache failed during the run: {degraded[0]}")
        row.probes, _ = self.pool.run(probe_jobs(self.sizes, VOCAB, fill=fill, day=day), before_probe)

    def lookup_system(self) -> dict:
        """Blocks (and the tail) of the system prompt that worker 0's backend holds now, and its namespace."""
        tokens = system_prompt(self.sizes, VOCAB)
        return self.pool.lookup(0, tokens, [len(tokens)])

    def lookup_elsewhere(self, backend: dict, before: dict) -> str:
        """Look the system prompt up from this driver process, which never held a cache (as a restarted
        worker would not), through a new adapter, and compare with what worker 0 found `before`."""
        from benchmarks.backends import count_cached, make_backend
        from tiercache.layout import BlockLayout

        tokens = system_prompt(self.sizes, VOCAB)
        ns = Namespace.from_dict(before["namespace"])
        store = make_backend(backend, BlockLayout.of(ns), ns.digest())
        try:
            after = count_cached(store, ns, tokens, [len(tokens)])
        finally:
            store.close()
        return survives(before["found"], after["found"])


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def survives(before: int, after: int) -> str:
    """yes / no / partly, from the blocks found before and after a restart."""
    if before == 0:
        return "unknown (nothing cached before the restart)"
    if after == before:
        return "yes"
    return "no" if after == 0 else f"partly ({after}/{before} blocks)"


# ---- one function per configuration -------------------------------------------------------------


def run_none(b: Bench, row: Row) -> None:
    b.phase(row, {"kind": "none"}, fill=False)
    b.pool.finish()
    row.cache_rss, row.survives = "n/a (no cache)", "n/a"


def run_inproc(b: Bench, row: Row) -> None:
    spec = {"kind": "inproc"}
    b.phase(row, spec)
    before = b.lookup_system()
    row.peak_bytes = max(m["growth_bytes"] for m in b.pool.finish())
    row.cache_rss = f"{mb(row.peak_bytes)} (worker growth)"
    row.survives = b.lookup_elsewhere(spec, before)  # its memory ends with the worker process


def run_redis(b: Bench, row: Row) -> None:
    reason = redis_unavailable_reason()
    if reason:
        row.skipped = reason
        log(f"  Redis row skipped: {reason}")
        return
    server = RedisServer(os.path.join(b.workdir, f"redis-{len(b.rounds)}"))
    server.start()
    b.stops.append(server.stop)
    spec = {"kind": "redis", "socket": server.socket}
    b.phase(row, spec, cache=(server.pid, "redis-server"))
    before = b.lookup_system()
    b.pool.finish()
    row.peak_bytes = server.peak_rss_bytes()
    row.cache_rss = f"{mb(row.peak_bytes)} (redis-server; {mb(server.idle_rss_bytes)} idle)"
    server.stop()
    server.start()  # same directory and socket; persistence is off (--save '', no AOF) as for a cache
    row.survives = b.lookup_elsewhere(spec, before)
    server.stop()


def run_files(b: Bench, row: Row) -> None:
    directory = os.path.join(b.workdir, f"files-{len(b.rounds)}")  # each round starts empty
    spec = {"kind": "files", "dir": directory}
    b.phase(row, spec)
    before = b.lookup_system()
    b.pool.finish()
    files = list(pathlib.Path(directory).iterdir())
    size = sum(f.stat().st_size for f in files)
    row.cache_rss = f"n/a (no process; {mb(size)} in {len(files)} files, page cache)"
    row.survives = b.lookup_elsewhere(spec, before)


class TierCacheRows:
    """The tiercache rows share one daemon: each live row (copy, views, stream) from a flushed daemon,
    then the disk row, which fills, restarts the daemon on its data and probes its disk tier."""

    def __init__(self, b: Bench) -> None:
        assert b.daemon is not None, "the daemon is launched in main() when a tiercache row is selected"
        self.b = b
        self.daemon = b.daemon
        self.populated = False

    def spec(self, mode: str) -> dict:
        return {"kind": "tiercache", "address": self.daemon.address, "shared_memory": mode != "stream",
                "views": mode == "views"}

    def start(self) -> None:
        self.daemon.wait_ready()

    def client(self):
        from tiercache.client import Client

        return Client(self.daemon.address, timeout_s=60, tune_allocator=True)

    def peak(self, row: Row) -> None:
        row.peak_bytes = self.daemon.peak_rss_bytes()
        row.cache_rss = f"{mb(row.peak_bytes)} (daemon; {mb(self.daemon.idle_rss_bytes)} at start)"

    def forget(self) -> None:
        """Empty every tier, so that the next row starts where the first one did."""
        self.start()
        with contextlib.closing(self.client()) as c:
            c.flush()
        self.populated = False

    def run_live(self, row: Row, mode: str) -> None:
        if self.populated:  # every row starts from an empty cache
            self.forget()
        self.start()
        row.views = mode == "views"
        reset_peak_rss(self.daemon.pid)
        self.b.phase(row, self.spec(mode), cache=(self.daemon.pid, "daemon"))
        self.b.pool.finish()
        self.peak(row)
        self.populated = True
        row.survives = "checked at the restart below"

    def restart(self) -> str:
        """Restart the daemon on its data; returns whether the system prompt's blocks, which worker 0
        found before, are found again from the driver process after it."""
        b = self.b
        self.start()
        b.pool.configure(self.spec("copy"), b.block_tokens)
        before = b.lookup_system()
        b.pool.finish()
        self.daemon.restart()
        return b.lookup_elsewhere(self.spec("copy"), before)

    def fill(self) -> None:
        """What the restart checks and the disk row's probes read: the day's first request (the system
        prompt) and each probe prefix's fill request (the one every row runs, uncounted, before its probes)."""
        b = self.b
        b.pool.configure(self.spec("copy"), b.block_tokens)
        fills = probe_jobs(b.sizes, VOCAB, fill=True, first_id=1)[:: b.sizes.probe_repeats + 1]
        b.pool.run(b.jobs()[:1] + fills)
        b.pool.finish()
        self.populated = True

    def run_disk(self, row: Row) -> str:
        """From a flushed daemon, like every row: the fill, a restart (the host tier starts empty), then
        the probes, each with the host tier flushed first so that each reads LMDB. Returns the restart's
        verdict (the system prompt found again?)."""
        self.forget()
        self.fill()
        verdict = row.survives = self.restart()
        self.populated = True
        client = self.client()

        def host_empty(job: Job) -> None:
            # Undo the previous probe's promotion into the host tier: each probe reads LMDB, as the
            # first request after a restart does. The worker read LMDB itself and tells the daemon
            # with a Touch TOUCH_DELAY_S later, which promotes: let it land first.
            time.sleep(3 * TOUCH_DELAY_S)
            client.flush("host")

        try:
            self.b.pool.configure(self.spec("copy"), self.b.block_tokens)
            reset_peak_rss(self.daemon.pid)
            log(f"  {row.label}: {self.b.sizes.probe_repeats * len(self.b.sizes.prefix_lengths)} probes on worker 0")
            row.probes, _ = self.b.pool.run(probe_jobs(self.b.sizes, VOCAB, fill=False), host_empty)
            self.b.pool.finish()
        finally:
            client.close()
        self.peak(row)
        row.cache_cpu = "n/a (probes only)"
        row.note = disk_note(row)
        return verdict


def disk_note(row: Row) -> str:
    tiers: dict[str, int] = {}
    for probe in row.probes:
        for tier in probe["tiers"]:
            tiers[tier] = tiers.get(tier, 0) + 1
    return ("probes only (no household workload: its first request would find the system prompt cached before "
            "the restart); probes reading each tier: " + (", ".join(f"{t} {n}" for t, n in sorted(tiers.items()))
                                                          or "none"))


def make_daemon(sizes: Sizes, model: ModelSpec, workdir: str, repo: str) -> TierCacheDaemon:
    """A daemon whose host tier holds everything the run caches: no eviction muddles the figures."""
    s = sizes
    tokens = (s.system_tokens + s.requests * s.request_tokens[1] + s.turns * (s.turn_tokens + s.reply_tokens)
              + sum(s.prefix_lengths) + (s.probe_repeats + 1) * s.probe_suffix_tokens * len(s.prefix_lengths))
    host = max(64 * MiB, 2 * kv_bytes_per_token(model) * tokens)
    return TierCacheDaemon(os.path.join(workdir, "tc"), repo, host_bytes=host, disk_bytes=2 * host)


def run_all(b: Bench, selected: list[str], rounds: int = 1) -> None:
    """Every selected configuration, in order, `rounds` times over (each round from empty caches);
    b.rounds gets each round's rows, b.rows the configurations over all rounds."""
    tc: TierCacheRows | None = None
    for n in range(rounds):
        if tc is not None:
            tc.forget()  # the last round's blocks, the restart's disk tier included
        rows: list[Row] = []
        verdict: str | None = None  # the daemon restart's, for the live tiercache rows
        for key in CONFIGS:
            if key not in selected:
                continue
            row = Row(key, CONFIGS[key])
            rows.append(row)
            log(f"[round {n + 1}/{rounds}, {len(rows)}/{len(selected)}] {row.label}")
            started = time.monotonic()
            if key == "none":
                run_none(b, row)
            elif key == "inproc":
                run_inproc(b, row)
            elif key == "redis":
                run_redis(b, row)
            elif key == "files":
                run_files(b, row)
            elif key == "tc-disk":
                tc = tc or TierCacheRows(b)
                verdict = tc.run_disk(row)
            else:
                tc = tc or TierCacheRows(b)
                tc.run_live(row, TC_MODES[key])
            log(f"  done in {time.monotonic() - started:.1f} s")
        if tc is not None and verdict is None and any(r.key in TC_MODES for r in rows):
            tc.fill()  # no disk row: fill and restart for the live rows' verdict
            verdict = tc.restart()
        for row in rows:
            if row.key in TC_MODES and row.key != "tc-disk":
                row.survives = verdict or "n/a"
        b.rounds.append(rows)
    b.rows = [merge_rounds([each[i] for each in b.rounds]) for i in range(len(b.rounds[0]))]
    for row in b.rows:
        if row.key == "tc-disk" and not row.skipped:
            row.note = disk_note(row)
