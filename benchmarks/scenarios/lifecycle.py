"""Lifecycle scenario: SIGTERM and restart under load, second daemons refused, two daemons started at once."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from benchmarks.daemons import Daemon, payload_for
from benchmarks.reliability import Fleet, committed_keys, daemon_config, start_daemon
from tiercache.client import Client
from tiercache.tenancy import scope_key

EXIT_ALREADY_RUNNING = 3


@dataclass
class LifecycleReport:
    restarts: int = 0
    drain_s: float = 0.0  # SIGTERM to exit, longest
    puts_returned: int = 0  # blocks whose Put returned before a SIGTERM
    bytes_lost: int = 0  # of those, payload bytes absent or altered after the restart
    refused: int = 0  # second daemons refused
    race_winners: list[int] = field(default_factory=list)  # daemons serving after each simultaneous start
    problems: list[str] = field(default_factory=list)


def check_all_back(client: Client, returned: dict[bytes, float], report: LifecycleReport) -> None:
    by_store_key = {scope_key("local", k): k for k in returned}
    got = {}
    keys = list(by_store_key)
    for start in range(0, len(keys), 512):
        got.update((b.meta.key, b) for b in client.fetch_store_keys(keys[start : start + 512]))
    for store_key, key in by_store_key.items():
        block = got.get(store_key)
        if block is None or not bool((block.payload == payload_for(key, block.meta.nbytes)).all()):
            report.bytes_lost += block.meta.nbytes if block is not None else 4096
            report.problems.append(f"returned block {key.hex()[:16]} {'missing' if block is None else 'altered'}")


def second_daemon_refused(conf: str, report: LifecycleReport, **overrides: str) -> None:
    args = [arg for name, value in overrides.items() for arg in (f"--{name.replace('_', '-')}", value)]
    started = time.monotonic()
    other = Daemon(*args, config=conf)
    try:
        rc = other.proc.wait(60)
    finally:
        other.kill()
    took = time.monotonic() - started
    if rc != EXIT_ALREADY_RUNNING or "another tiercache daemon" not in other.stderr or took > 30:
        report.problems.append(f"second daemon ({overrides or 'same config'}) rc={rc} after {took:.1f} s: "
                               f"{other.stderr[-300:]}")
    else:
        report.refused += 1


def race(base: str) -> int:
    """Start two daemons on one fresh socket and data directory at once; how many end up serving."""
    _, conf = daemon_config(base)
    pair = [Daemon(config=conf), Daemon(config=conf)]
    try:
        deadline = time.monotonic() + 90
        while sum(d.proc.poll() is None for d in pair) > 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        survivors = [d for d in pair if d.proc.poll() is None]
        if any(d.proc.returncode != EXIT_ALREADY_RUNNING for d in pair if d not in survivors):
            return -1
        for d in survivors:
            d.wait_ready()
            with Client(d.addresses[0]) as client:
                if client.health() != "SERVING":
                    return -1
            # What is checked here is who serves; drain times are checked under load above. An idle
            # daemon that did not exit here had lost a SIGTERM taken by one of its other threads
            # (server/main.py now wakes on it through the wakeup fd); Daemon.stop puts its log in a failure.
            if d.stop(timeout_s=90) != 0:
                return -1
        return len(survivors)
    finally:
        for d in pair:
            d.kill()


def run_lifecycle(base: str, *, restarts: int, workers: int = 3, seed: int = 0, load_s: float = 1.0,
                  race_base: str | None = None, progress: Callable[[str], None] | None = None) -> LifecycleReport:
    """`restarts` SIGTERM + restart cycles of a subprocess daemon under load, each checked for loss;
    `progress` gets a line with the figures so far after each cycle."""
    config, conf = daemon_config(base, host_pages=256, disk_bytes=1 << 30)
    report = LifecycleReport()
    fleet = Fleet(base, f"unix:{config.server.socket}", workers, mix="durable", seed=seed)
    daemon = None
    try:
        daemon = start_daemon(conf)
        for cycle in range(restarts):
            fleet.wait_puts(10)
            if cycle == 0:  # refused while the first one is busy; then the same instant, elsewhere
                second_daemon_refused(conf, report)
                second_daemon_refused(conf, report, socket=os.path.join(base, "other.sock"))
                second_daemon_refused(conf, report, data_dir=os.path.join(base, "other-data"))
            time.sleep(load_s)
            asked = time.monotonic()
            rc = daemon.stop(timeout_s=60)
            report.drain_s = max(report.drain_s, time.monotonic() - asked)
            if rc != 0 or "drained" not in daemon.stderr:
                report.problems.append(f"cycle {cycle}: SIGTERM under load: exit {rc}: {daemon.stderr[-500:]}")
            # Drained: every Put that returned is in LMDB now, not merely in host memory.
            returned = fleet.returned()
            report.puts_returned += len(returned)
            on_disk = committed_keys(config.data_dir)
            missing = [k for k in returned if scope_key("local", k) not in on_disk]
            if missing:
                report.problems.append(f"cycle {cycle}: {len(missing)} returned blocks not on disk after the drain")
            daemon = start_daemon(conf)
            report.restarts += 1
            if race_base is not None and cycle == 0:
                report.race_winners.append(race(race_base))
            with Client(daemon.addresses[0], timeout_s=60) as client:
                check_all_back(client, returned, report)
                result = client.verify()
                if result.num_failed or not result.integrity_ok:
                    report.problems.append(f"cycle {cycle}: verify {result}")
            if progress is not None:
                progress(f"lifecycle: restart {cycle + 1} of {restarts}: returned blocks checked "
                         f"{report.puts_returned}; bytes lost {report.bytes_lost}; drain <= {report.drain_s:.1f} s; "
                         f"problems {len(report.problems)}")
        summaries = fleet.stop()
        report.problems += fleet.unexpected()
        if sum(s.bad_blocks for s in summaries):
            report.problems.append("workers fetched wrong bytes")
        if daemon.stop() != 0:
            report.problems.append(f"final SIGTERM: {daemon.stderr[-500:]}")
    finally:
        fleet.kill()
        if daemon is not None:
            daemon.kill()
    return report
