"""Disk-full scenario: the data directory on a small tmpfs, filled through the daemon; fallback and recovery."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from benchmarks.daemons import chain, running_server, small_config, tokens
from benchmarks.reliability import intact
from tiercache.client import Client
from tiercache.errors import CapacityExceeded


@contextlib.contextmanager
def small_filesystem(path: str, size: str = "8m") -> Iterator[str]:
    """A tmpfs of `size` mounted at `path` (root only); skips the test when mounting is not permitted."""
    os.makedirs(path, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs for the disk-full test: {done.stderr.strip() or done.returncode}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], check=False)


@dataclass
class DiskFullReport:
    puts: int = 0
    refused: Counter = field(default_factory=Counter)  # error class -> Puts that failed
    slowest_put_s: float = 0.0
    write_failures: int = 0  # blocks the disk tier could not write (kept in host)
    reads_intact: int = 0  # chains read back bit-identical while the disk was full
    resumed_after_s: float = -1.0  # flush to the first block committed again
    problems: list[str] = field(default_factory=list)


def fill(client: Client, store: object, seed: int, report: DiskFullReport, until_full: bool) -> list[list[bytes]]:
    """Put 32 KiB chains until the disk tier fails a write (or 300 chains); return the chains stored."""
    stored = []
    for i in range(300):
        blocks = chain(tokens(seed + i, 8))
        started = time.monotonic()
        try:
            client.put(blocks)
            stored.append([b.meta.key for b in blocks])
        except CapacityExceeded as e:  # RESOURCE_EXHAUSTED: documented backpressure
            report.refused[type(e).__name__] += 1
        report.puts += 1
        report.slowest_put_s = max(report.slowest_put_s, time.monotonic() - started)
        if until_full and i % 10 == 9:
            store.flush_writes()  # type: ignore[attr-defined]
            if store.disk.write_failures:  # type: ignore[attr-defined]
                break
    return stored


def run_disk_full(base: str, mount_point: str, *, resume_wait_s: float = 0.0) -> DiskFullReport:
    """Fill the filesystem through the daemon, check the fallback; with resume_wait_s, then Flush the disk
    tier and wait that long for disk writes to succeed again (resumed_after_s stays -1 if they do not)."""
    report = DiskFullReport()
    with small_filesystem(mount_point):
        config = small_config(base, host_pages=512, disk_bytes=64 << 20)  # 2 MiB host, 64 MiB disk, 8 MiB fs
        config = dataclasses.replace(config, data_dir=os.path.join(mount_point, "data"))
        with running_server(config) as (store, address), Client(address, timeout_s=30) as client:
            fill(client, store, 0, report, until_full=True)
            report.write_failures = store.disk.write_failures
            if not report.write_failures:
                report.problems.append("the filesystem never filled up")
            # Full: new Puts still land in host, recent chains read back intact.
            recent = fill(client, store, 10_000, report, until_full=False)[-20:]
            for keys in recent:
                got = client.fetch(keys, shared_memory=False)
                report.reads_intact += len(got) == len(keys) and intact(got)
            if report.reads_intact < len(recent):
                report.problems.append(f"only {report.reads_intact} of {len(recent)} recent chains read back")
            if client.health() != "SERVING":
                report.problems.append("the daemon stopped serving")
            # Make room, then writes resume by themselves.
            flushed_at = time.monotonic()
            if resume_wait_s:
                client.flush(tier="disk")
            while resume_wait_s and time.monotonic() - flushed_at < resume_wait_s:
                i = int((time.monotonic() - flushed_at) * 1000)
                blocks = chain(tokens(20_000 + i, 2))
                client.put(blocks)
                store.flush_writes()
                disk_blocks = next(t.num_blocks for t in client.stats().tiers if t.tier == "disk")
                if disk_blocks:
                    report.resumed_after_s = time.monotonic() - flushed_at
                    got = client.fetch([b.meta.key for b in blocks], shared_memory=False)
                    if not intact(got):
                        report.problems.append("a block written after the flush came back wrong")
                    break
                time.sleep(0.25)
            result = client.verify()
            if result.num_failed or not result.integrity_ok:
                report.problems.append(f"verify after the episode: {result}")
    return report
