"""Touch calls of a client: what a same-host client read (and looked up) without a call, and the
figures of the requests a worker served, told to the daemon a moment later on a thread of its own,
so that the daemon's LRU order, counters, promotions and metrics catch up."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from tiercache.errors import DeadlineExceeded, TierCacheError, Unavailable, Unimplemented
from tiercache.v1 import tiercache_pb2 as pb

logger = logging.getLogger(__name__)

TOUCH_DELAY_S = 0.1  # Touch calls go out this long after the read that asked for them
TOUCH_MAX_PENDING = 64  # chains waiting for their Touch at most
TOUCH_MAX_REPORTS = 1024  # request reports waiting for a Touch at most (the oldest go untold)
TOUCH_REPORTS_PER_CALL = 32  # reports per Touch call (a daemon takes at most server.max_keys_per_call)
REPORT_RETRY_S = 300.0  # after a daemon ignored TouchRequest.reports: Report calls for this long, then try again


class Toucher:
    """Sends Touch for chains read through the shared index, the count of lookups answered from it
    and the reports of requests served, on a thread of its own: the daemon's LRU order, counters and
    metrics catch up a moment later, off the reader's critical path, in one call for what came
    meanwhile. close() sends what is still pending.

    A daemon older than TouchRequest.reports answers num_reported = 0, and one older than Touch
    UNIMPLEMENTED: those reports then go with `send_report` (a Report call each), and later ones
    too, at once on the caller's thread, for REPORT_RETRY_S. Reports of a round whose Touch found
    the daemon down or slow wait for the next round (TOUCH_MAX_REPORTS at most)."""

    def __init__(self, send: Callable[[pb.TouchRequest, float | None], pb.TouchResponse],
                 send_report: Callable[[pb.ReportRequest, float | None], object]) -> None:
        self._send = send
        self._send_report = send_report
        self._pending: list[list[bytes]] = []
        self._lookups = [0, 0, 0, 0]  # calls, blocks found, blocks missed, blocks found in disk
        self._reports: list[pb.ReportRequest] = []
        self._reports_after = 0.0  # time.monotonic() until which reports go by Report (see the class)
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._in_flight = False  # the thread has taken a round and not finished sending it
        self._closed = False

    def _idle(self) -> bool:
        return not self._pending and not self._lookups[0] and not self._reports

    def later(self, keys: list[bytes]) -> None:
        with self._cond:
            idle = self._idle()
            if keys not in self._pending:  # the same chain twice in a round: once
                self._pending.append(keys)
                del self._pending[:-TOUCH_MAX_PENDING]  # a stalled daemon: the oldest reads go untold
            if idle:
                self._wake()

    def looked_up(self, found: int, missed: int, on_disk: int = 0) -> None:
        """Count a lookup answered here: `found` blocks (the last `on_disk` of them in disk), `missed`."""
        with self._cond:
            idle = self._idle()
            self._lookups[0] += 1
            self._lookups[1] += found
            self._lookups[2] += missed
            self._lookups[3] += on_disk
            if idle:
                self._wake()

    def reported(self, report: pb.ReportRequest) -> None:
        """Send a request's report with the next Touch (or as a Report call now: see the class)."""
        with self._cond:
            direct = self._closed or time.monotonic() < self._reports_after  # closed: the call says so
            if not direct:
                idle = self._idle()
                self._reports.append(report)
                del self._reports[:-TOUCH_MAX_REPORTS]  # a stalled daemon: the oldest go untold
                if idle:
                    self._wake()
        if direct:
            self._send_report(report, None)

    def _wake(self) -> None:
        """Start a round: the thread waits for work only while nothing is pending, so later
        requests of the same round need not wake it (each wake is a switch of threads)."""
        if self._closed:
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tiercache-touch", daemon=True)
            self._thread.start()
        self._cond.notify()

    def _take(self) -> list[pb.TouchRequest]:
        chains, self._pending = self._pending or [[]], []
        calls, found, missed, on_disk = self._lookups
        self._lookups = [0, 0, 0, 0]
        reports, self._reports = self._reports, []
        requests = [pb.TouchRequest(keys=chain) for chain in chains]
        first = requests[0]
        first.lookup_calls, first.lookup_blocks, first.lookup_misses, first.lookup_disk_blocks = \
            calls, found, missed, on_disk
        first.reports.extend(reports[:TOUCH_REPORTS_PER_CALL])
        requests += [pb.TouchRequest(reports=reports[i : i + TOUCH_REPORTS_PER_CALL])
                     for i in range(TOUCH_REPORTS_PER_CALL, len(reports), TOUCH_REPORTS_PER_CALL)]
        return requests if first.keys or calls or reports else []

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._idle() and not self._closed:
                    self._cond.wait()
                # A moment later, not at once: the reader is computing with what it read, and a
                # call on this thread would take turns with it for the interpreter. Reads that come
                # meanwhile go in the same round (the same chain again, once).
                due = time.monotonic() + TOUCH_DELAY_S
                while not self._closed and (left := due - time.monotonic()) > 0:
                    self._cond.wait(left)
                if self._closed:
                    return
                requests = self._take()
                self._in_flight = True
            try:
                self._flush(requests)
            finally:
                with self._cond:
                    self._in_flight = False
                    self._cond.notify_all()

    def flush(self, timeout_s: float = 5.0) -> None:
        """Send what is pending now, on the caller's thread, after the round the thread may be
        sending (waited for up to timeout_s): when this returns, the daemon has been told of every
        read, lookup and report made before the call (unless it was down or slow)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._in_flight and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)
            requests = self._take()
        self._flush(requests, timeout_s=max(0.1, deadline - time.monotonic()))

    def _flush(self, requests: list[pb.TouchRequest], timeout_s: float | None = None) -> None:
        for n, request in enumerate(requests):
            try:
                counted = self._touch(request, timeout_s)
            except TierCacheError as e:  # best effort: the next read touches again
                logger.debug("touch of %d blocks (%d reports) failed: %s", len(request.keys), len(request.reports), e)
                if isinstance(e, (Unavailable, DeadlineExceeded)):  # down or slow: its reports go next round
                    self._keep([r for later in requests[n:] for r in later.reports])
                return  # the rest would wait as long each
            if len(request.reports) > counted:  # a daemon that does not take them
                logger.info("the daemon took no request reports with Touch (older version): sending "
                            "them with Report for the next %.0f s", REPORT_RETRY_S)
                with self._cond:
                    self._reports_after = time.monotonic() + REPORT_RETRY_S
                try:
                    for report in request.reports[counted:]:
                        self._send_report(report, timeout_s)
                except TierCacheError as e:  # as a Report call always was: best effort, never sent twice
                    logger.debug("report failed: %s", e)
                    return

    def _touch(self, request: pb.TouchRequest, timeout_s: float | None) -> int:
        """Send one Touch; how many of its reports the daemon counted (0 from one older than Touch)."""
        try:
            return self._send(request, timeout_s).num_reported
        except Unimplemented:
            if not request.reports:
                raise
            return 0

    def _keep(self, reports: list[pb.ReportRequest]) -> None:
        """Put back reports a failed Touch did not deliver, before the ones that came since."""
        if not reports:
            return
        with self._cond:
            self._reports[:0] = reports
            del self._reports[:-TOUCH_MAX_REPORTS]

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._cond:
            requests = self._take()
        self._flush(requests, timeout_s=1.0)  # what is still pending, briefly: closing must not hang
