"""Load scenario: worker processes run every rpc against a small host tier; errors, backpressure, latencies."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from benchmarks.reliability import BACKPRESSURE, Fleet, daemon_config, percentile, start_daemon
from tiercache.client import Client


@dataclass
class LoadReport:
    workers: int = 0
    seconds: float = 0.0
    ops: int = 0
    ops_per_s: float = 0.0
    backpressure: int = 0
    errors: Counter = field(default_factory=Counter)  # anything else: must stay empty
    bad_blocks: int = 0
    p50_ms: dict = field(default_factory=dict)  # op -> milliseconds
    p99_ms: dict = field(default_factory=dict)
    p99_all_ms: float = 0.0
    host_evictions: int = 0
    problems: list[str] = field(default_factory=list)


def run_load(base: str, *, workers: int = 8, seconds: float = 6.0, host_pages: int = 128, seed: int = 0) -> LoadReport:
    # 128 pages of 4 KiB: a 512 KiB host tier that ~30 chains fill, so it evicts on nearly every Put.
    config, conf = daemon_config(base, host_pages=host_pages, disk_bytes=64 << 20)
    report = LoadReport(workers=workers, seconds=seconds)
    fleet = Fleet(base, f"unix:{config.server.socket}", workers, seconds=seconds, mix="mixed", seed=seed)
    daemon = None
    try:
        daemon = start_daemon(conf)
        fleet.wait_exit(seconds + 120)  # each worker runs `seconds` from its first call
        summaries = fleet.stop()
        latencies: dict[str, list[float]] = {}
        for s in summaries:
            report.ops += sum(s.ops.values())
            report.bad_blocks += s.bad_blocks
            for name, count in s.errors.items():
                if name in BACKPRESSURE:
                    report.backpressure += count
                else:
                    report.errors[name] += count
            for op, values in s.latencies.items():
                latencies.setdefault(op, []).extend(values)
        report.ops_per_s = round(report.ops / seconds, 1)
        report.p50_ms = {op: round(percentile(v, 50) * 1e3, 2) for op, v in sorted(latencies.items())}
        report.p99_ms = {op: round(percentile(v, 99) * 1e3, 2) for op, v in sorted(latencies.items())}
        report.p99_all_ms = round(percentile([x for v in latencies.values() for x in v], 99) * 1e3, 2)
        report.problems += fleet.unexpected()
        if report.errors or report.bad_blocks:
            report.problems.append(f"errors {dict(report.errors)}, chains with wrong bytes {report.bad_blocks}")
        # Idle now: the daemon's maintenance (TTL expiry, then check_integrity) runs every idle_check_s.
        time.sleep(3 * config.server.idle_check_s + 0.5)
        with Client(daemon.addresses[0], timeout_s=60) as client:
            result = client.verify()
            if result.num_failed or not result.integrity_ok:
                report.problems.append(f"verify after load: {result}")
            report.host_evictions = next(t.evictions for t in client.stats().tiers if t.tier == "host")
        if "expired blocks=" not in daemon.stderr:
            report.problems.append("idle maintenance never ran (no TTL expiry logged)")
        for bad in ("integrity check failed", "maintenance failed", "Traceback"):
            if bad in daemon.stderr:
                report.problems.append(f"daemon log: {bad}: {daemon.stderr[daemon.stderr.index(bad) - 200:][:800]}")
        rc = daemon.stop()
        if rc != 0:
            report.problems.append(f"SIGTERM after load: exit {rc}")
    finally:
        fleet.kill()
        if daemon is not None:
            daemon.kill()
    return report
