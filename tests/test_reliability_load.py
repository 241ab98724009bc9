"""Load: 8 client processes run every rpc against a small host tier for a fixed time; no error but documented
backpressure, every fetched byte checked, latency percentiles reported, the idle daemon's integrity checks
and Verify clean afterwards."""

from __future__ import annotations

import pytest

from benchmarks.daemons import cleanup, short_dir
from benchmarks.scenarios.load import run_load


@pytest.mark.slow
def test_eight_processes_mixed_rpcs_small_host_tier_no_errors_but_backpressure():
    base = short_dir()
    try:
        report = run_load(base, workers=8, seconds=4.0)
        print(report)
        assert not report.problems, "\n".join(report.problems[:20])
        assert report.ops > 300, "the load never really ran"
        assert report.host_evictions > 50, "the host tier was not under pressure"
        assert report.p99_all_ms < 2000, report.p99_ms
    finally:
        cleanup(base)
