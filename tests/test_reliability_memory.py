"""Memory bound: under a mixed workload with a full disk tier (steady-state eviction), the daemon's resident
memory stays within its host pool plus a fixed overhead, and does not trend upward (slope reported)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import pytest

from helpers_daemon import chain, cleanup, short_dir, tokens
from reliability import NS_BIG, Fleet, daemon_config, rss, slope, start_daemon
from tiercache.client import Client
from tiercache.tiers.host_index import index_size

MiB = 1 << 20


@dataclass
class MemoryReport:
    seconds: float = 0.0
    ops: int = 0
    host_pool_bytes: int = 0
    idle_anon: int = 0  # heap after start, before any block: the fixed part
    peak_anon: int = 0  # during the soak
    peak_shmem: int = 0  # the host slab (faulted in at start, must not grow)
    anon_slope: float = 0.0  # bytes/s over the soak, least squares
    total_slope: float = 0.0  # same for the whole RSS (includes LMDB's file-backed map)
    blocks_indexed: int = 0
    samples: list = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def run_memory(base: str, *, seconds: float, workers: int = 2, fixed_overhead: int = 96 * MiB,
               max_slope: float = 1 * MiB) -> MemoryReport:
    # 8 MiB host pool, 32 MiB disk tier: 32 KiB blocks fill the disk within the prefill.
    config, conf = daemon_config(base, host_pages=2048, disk_bytes=32 * MiB)
    report = MemoryReport(seconds=seconds, host_pool_bytes=config.host.capacity_bytes)
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
            started = time.monotonic()
            while any(p.poll() is None for p in fleet.procs):
                r = rss(pid)
                report.samples.append((round(time.monotonic() - started, 2), r["anon"], r["total"], r["shmem"]))
                time.sleep(0.2)
            summaries = fleet.stop()
            report.ops = sum(sum(s.ops.values()) for s in summaries)
            report.problems += fleet.unexpected()
            report.blocks_indexed = sum(t.num_blocks for t in client.stats().tiers if t.tier == "disk")
            if not client.verify().integrity_ok:
                report.problems.append("integrity check failed after the soak")
        # The first half warms up: the allocator, and the daemon's bounded per-block caches (record
        # headers, frames, chains), which grew ~1 MiB/s for about five seconds here before a plateau,
        # so a slope over the last three quarters of a 6 s run read 0.9-1.5 MiB/s with or without a leak.
        soak = report.samples[len(report.samples) // 2 :]
        report.peak_anon = max(s[1] for s in report.samples)
        report.peak_shmem = max(s[3] for s in report.samples)
        report.anon_slope = slope([(t, a) for t, a, _, _ in soak])
        report.total_slope = slope([(t, tot) for t, _, tot, _ in soak])
        if report.peak_anon > report.idle_anon + fixed_overhead:
            report.problems.append(f"heap grew to {report.peak_anon / MiB:.0f} MiB from {report.idle_anon / MiB:.0f} MiB")
        # Shared memory: the slab's pages plus its shared index (slots and presence filter).
        index_bytes = index_size(config.host.capacity_bytes // config.host.page_bytes)[1]
        if report.peak_shmem > report.host_pool_bytes + index_bytes + 4 * MiB:
            report.problems.append(f"shared memory {report.peak_shmem / MiB:.0f} MiB exceeds the host pool "
                                   f"and its index ({(report.host_pool_bytes + index_bytes) / MiB:.0f} MiB)")
        if report.anon_slope > max_slope:
            report.problems.append(f"heap keeps growing: {report.anon_slope / 1024:.0f} KiB/s")
        if daemon.stop() != 0:
            report.problems.append("SIGTERM after the soak failed")
    finally:
        if fleet is not None:
            fleet.kill()
        daemon.kill()
    return report


@pytest.mark.slow
def test_resident_memory_stays_within_pools_plus_fixed_overhead_and_does_not_trend_up():
    base = short_dir()
    try:
        report = run_memory(base, seconds=12.0)
        print({k: v for k, v in report.__dict__.items() if k != "samples"})
        assert not report.problems, report.problems
        assert report.ops > 200 and report.blocks_indexed > 500
    finally:
        cleanup(base)
