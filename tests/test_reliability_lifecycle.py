"""Lifecycle: SIGTERM under load drains to exit 0 with every returned Put on disk; a restart under load
loses nothing; a second daemon on the same socket or data directory is refused, even at the same instant."""

from __future__ import annotations

import pytest

from benchmarks.daemons import cleanup, short_dir
from benchmarks.scenarios.lifecycle import run_lifecycle


@pytest.mark.slow
def test_sigterm_and_restart_under_load_lose_nothing_and_a_second_daemon_is_refused():
    base, other = short_dir(), short_dir()
    try:
        report = run_lifecycle(base, restarts=1, workers=3, race_base=other)
        print(report)
        assert not report.problems, "\n".join(report.problems[:20])
        assert report.puts_returned > 30 and report.bytes_lost == 0
        assert report.refused == 3
        assert report.race_winners == [1], "two daemons started at once: exactly one must serve"
        assert report.drain_s < 15, report
    finally:
        cleanup(base)
        cleanup(other)
