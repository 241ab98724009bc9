"""The Toucher's batching of request reports against a daemon that is down, older, or fine: it
talks to the daemon through the two functions a Client hands it, here ones that answer as such a
daemon would."""

from __future__ import annotations

import time

from tiercache.client.touch import TOUCH_REPORTS_PER_CALL, Toucher
from tiercache.errors import InvalidArgument, Unavailable, Unimplemented
from tiercache.v1 import tiercache_pb2 as pb


class Daemon:
    """What the Toucher's calls reach: `mode` "ok", "down", "no-reports" (before TouchRequest.reports),
    "no-touch" (before Touch) or "refuse"; every call and every report it counted is recorded."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.touches: list[pb.TouchRequest] = []
        self.counted: list[int] = []  # prompt_tokens of each report counted, in order
        self.report_calls = 0

    def touch(self, request: pb.TouchRequest, timeout_s: float | None) -> pb.TouchResponse:
        self.touches.append(request)
        if self.mode == "down":
            raise Unavailable("connection refused")
        if self.mode == "no-touch":
            raise Unimplemented("Method not found!")
        if self.mode == "refuse":
            raise InvalidArgument("reports[0].ttft_s must be a finite number")
        if self.mode == "no-reports":
            return pb.TouchResponse(num_touched=len(request.keys))
        self.counted += [r.prompt_tokens for r in request.reports]
        return pb.TouchResponse(num_touched=len(request.keys), num_reported=len(request.reports))

    def report(self, request: pb.ReportRequest, timeout_s: float | None) -> pb.ReportResponse:
        if self.mode == "down":
            raise Unavailable("connection refused")
        self.report_calls += 1
        self.counted.append(request.prompt_tokens)
        return pb.ReportResponse()


def reports(toucher: Toucher, first: int, n: int) -> None:
    for i in range(first, first + n):
        toucher.reported(pb.ReportRequest(prompt_tokens=i, cached_tokens=0, computed_tokens=i))


def settle(daemon: Daemon, count: int) -> None:
    deadline = time.monotonic() + 5
    while len(daemon.counted) < count and time.monotonic() < deadline:
        time.sleep(0.02)


def test_reports_go_a_batch_per_round_split_into_calls_the_daemon_takes():
    daemon = Daemon()
    toucher = Toucher(daemon.touch, daemon.report)
    reports(toucher, 1, 2 * TOUCH_REPORTS_PER_CALL + 5)
    toucher.later([b"k" * 32])
    settle(daemon, 2 * TOUCH_REPORTS_PER_CALL + 5)
    toucher.close()
    assert daemon.counted == list(range(1, 2 * TOUCH_REPORTS_PER_CALL + 6)) and daemon.report_calls == 0
    assert [len(t.reports) for t in daemon.touches] == [TOUCH_REPORTS_PER_CALL, TOUCH_REPORTS_PER_CALL, 5]
    assert list(daemon.touches[0].keys) == [b"k" * 32] and not daemon.touches[1].keys


def test_reports_of_a_round_that_found_the_daemon_down_go_with_the_next():
    daemon = Daemon()
    toucher = Toucher(daemon.touch, daemon.report)
    daemon.mode = "down"
    reports(toucher, 1, 3)
    deadline = time.monotonic() + 5
    while not daemon.touches and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.05)
    daemon.mode = "ok"
    reports(toucher, 4, 1)
    settle(daemon, 4)
    toucher.close()
    assert daemon.counted == [1, 2, 3, 4], "kept in order, each counted once"


def test_a_refused_round_is_dropped_not_sent_again():
    daemon = Daemon()
    toucher = Toucher(daemon.touch, daemon.report)
    daemon.mode = "refuse"
    reports(toucher, 1, 2)
    toucher.close()
    daemon.mode = "ok"
    assert daemon.counted == [] and len(daemon.touches) == 1


def test_an_older_daemon_gets_reports_with_report_calls():
    for mode in ("no-reports", "no-touch"):
        daemon = Daemon()
        toucher = Toucher(daemon.touch, daemon.report)
        daemon.mode = mode
        reports(toucher, 1, 3)
        settle(daemon, 3)
        assert daemon.counted == [1, 2, 3] and daemon.report_calls == 3, mode
        reports(toucher, 4, 1)  # within REPORT_RETRY_S: a call at once, on this thread
        assert daemon.counted == [1, 2, 3, 4] and daemon.report_calls == 4, mode
        toucher.close()
        reports(toucher, 5, 1)  # after close: a call at once too (a closed client's call raises)
        assert daemon.counted[-1] == 5, mode


def test_flush_sends_now_and_waits_for_a_round_already_on_its_way():
    """flush() returns once the daemon has been told of everything read before it: what is pending
    goes at once, and a round the thread took already is waited for, not overtaken."""
    import threading

    daemon = Daemon()
    arrived, release = threading.Event(), threading.Event()

    def slow_touch(request: pb.TouchRequest, timeout_s: float | None) -> pb.TouchResponse:
        arrived.set()
        release.wait(5)
        return daemon.touch(request, timeout_s)

    toucher = Toucher(slow_touch, daemon.report)
    toucher.later([b"a" * 32])
    assert arrived.wait(5)  # the thread's round is on its way, held in the call
    toucher.later([b"b" * 32])  # read while that round is out
    threading.Timer(0.2, release.set).start()
    toucher.flush()
    assert [list(t.keys) for t in daemon.touches] == [[b"a" * 32], [b"b" * 32]]  # in order, both told
    toucher.close()
