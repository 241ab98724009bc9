"""Memory scenario: a soak with a full disk tier; the daemon's heap, slab and RSS slopes against its pools."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from benchmarks.daemons import chain, tokens
from benchmarks.reliability import NS_BIG, Fleet, daemon_config, rss, slope, start_daemon
from tiercache.client import Client
from tiercache.samehost.index import index_size

MiB = 1 << 20


@dataclass
class MemoryReport:
    seconds: float = 0.0
    ops: int = 0
    host_pool_bytes: int = 0
    idle_anon: int = 0  # heap after start, before any block: the fixed part
    peak_anon: int = 0  # during the soak
    peak_shmem: int = 0  # the host slab (faulted in at start, must not grow)
    warmup_s: float = 0.0  # the start of the soak left out of the slopes
    anon_slope: float = 0.0  # bytes/s after the warm-up, least squares
    total_slope: float = 0.0  # same for the whole RSS (includes LMDB's file-backed map)
    ops_per_s: float = 0.0  # the workers' operations per second over the soak
    anon_per_op: float = 0.0  # anon_slope / ops_per_s: heap bytes kept per operation served
    blocks_indexed: int = 0
    samples: list = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def run_memory(base: str, *, seconds: float, workers: int = 2, fixed_overhead: int = 96 * MiB,
               warmup_s: float = 8.0, max_bytes_per_op: float = 768.0,
               progress: Callable[[str], None] | None = None, progress_every_s: float = 60.0) -> MemoryReport:
    """A soak of `seconds` under `workers` processes, the daemon's memory sampled 5 times a second;
    `progress` gets a line with the figures so far every `progress_every_s` of the soak."""
    # 8 MiB host pool, 32 MiB disk tier: 32 KiB blocks fill the disk within the prefill.
    config, conf = daemon_config(base, host_pages=2048, disk_bytes=32 * MiB)
    report = MemoryReport(seconds=seconds, host_pool_bytes=config.host.capacity_bytes, warmup_s=warmup_s)
    daemon = start_daemon(conf)
    fleet = None
    try:
        pid = daemon.proc.pid
        report.idle_anon = rss(pid)["anon"]
        fleet = Fleet(base, daemon.addresses[0], workers, seconds=seconds, mix="soak", ns="big", seed=7)
        with Client(daemon.addresses[0], timeout_s=60) as client:
            for i in range(150):  # 1200 blocks of 32 KiB > the disk tier: eviction from here on
                client.put(chain(tokens(50_000 + i, 8), NS_BIG))
            fleet.wait_puts(20)
            started = reported = time.monotonic()
            while any(p.poll() is None for p in fleet.procs):
                r = rss(pid)
                report.samples.append((round(time.monotonic() - started, 2), r["anon"], r["total"], r["shmem"]))
                if progress is not None and time.monotonic() - reported >= progress_every_s:
                    reported = time.monotonic()
                    progress(f"memory: {reported - started:.0f} s of {seconds:.0f}: heap idle "
                             f"{report.idle_anon / MiB:.0f} MiB, now {r['anon'] / MiB:.0f} MiB, peak "
                             f"{max(s[1] for s in report.samples) / MiB:.0f} MiB; slab {r['shmem'] / MiB:.0f} MiB")
                time.sleep(0.2)
            summaries = fleet.stop()
            report.ops = sum(sum(s.ops.values()) for s in summaries)
            report.problems += fleet.unexpected()
            report.blocks_indexed = sum(t.num_blocks for t in client.stats().tiers if t.tier == "disk")
            if not client.verify().integrity_ok:
                report.problems.append("integrity check failed after the soak")
        # The warm-up is left out: the workers' start, and the steepest part of the bounded memory
        # filling (see the test's docstring).
        soak = [s for s in report.samples if s[0] >= warmup_s]
        report.peak_anon = max(s[1] for s in report.samples)
        report.peak_shmem = max(s[3] for s in report.samples)
        report.anon_slope = slope([(t, a) for t, a, _, _ in soak])
        report.total_slope = slope([(t, tot) for t, _, tot, _ in soak])
        report.ops_per_s = report.ops / max(report.samples[-1][0], 1.0)
        report.anon_per_op = report.anon_slope / max(report.ops_per_s, 1.0)
        if len(soak) < 50:  # 5 samples a second: a slope over fewer says nothing
            report.problems.append(f"only {len(soak)} memory samples after the {warmup_s} s warm-up")
        if report.peak_anon > report.idle_anon + fixed_overhead:
            report.problems.append(f"heap grew to {report.peak_anon / MiB:.0f} MiB from "
                                   f"{report.idle_anon / MiB:.0f} MiB")
        # Shared memory: the slab's pages plus its shared index (slots and presence filter).
        index_bytes = index_size(config.host.capacity_bytes // config.host.page_bytes)[1]
        if report.peak_shmem > report.host_pool_bytes + index_bytes + 4 * MiB:
            report.problems.append(f"shared memory {report.peak_shmem / MiB:.0f} MiB exceeds the host pool "
                                   f"and its index ({(report.host_pool_bytes + index_bytes) / MiB:.0f} MiB)")
        if report.anon_per_op > max_bytes_per_op:
            report.problems.append(f"heap keeps growing: {report.anon_per_op:.0f} bytes per operation "
                                   f"({report.anon_slope / 1024:.0f} KiB/s at {report.ops_per_s:.0f} operations/s)")
        if daemon.stop() != 0:
            report.problems.append("SIGTERM after the soak failed")
    finally:
        if fleet is not None:
            fleet.kill()
        daemon.kill()
    return report
