"""Touch calls of a same-host client: what it read (and looked up) without a call, told to the daemon
a moment later on a thread of its own, so that the daemon's LRU order, counters and promotions catch up."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from tiercache.errors import TierCacheError
from tiercache.v1 import tiercache_pb2 as pb

logger = logging.getLogger(__name__)

TOUCH_DELAY_S = 0.1  # Touch calls go out this long after the read that asked for them
TOUCH_MAX_PENDING = 64  # chains waiting for their Touch at most


class Toucher:
    """Sends Touch for chains read through the shared index, and the count of lookups answered from
    it, on a thread of its own: the daemon's LRU order and counters catch up a moment later, off the
    reader's critical path. close() sends what is still pending."""

    def __init__(self, send: Callable[[pb.TouchRequest, float | None], object]) -> None:
        self._send = send
        self._pending: list[list[bytes]] = []
        self._lookups = [0, 0, 0, 0]  # calls, blocks found, blocks missed, blocks found in disk
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    def later(self, keys: list[bytes]) -> None:
        with self._cond:
            idle = not self._pending and not self._lookups[0]
            if keys not in self._pending:  # the same chain twice in a round: once
                self._pending.append(keys)
                del self._pending[:-TOUCH_MAX_PENDING]  # a stalled daemon: the oldest reads go untold
            if idle:
                self._wake()

    def looked_up(self, found: int, missed: int, on_disk: int = 0) -> None:
        """Count a lookup answered here: `found` blocks (the last `on_disk` of them in disk), `missed`."""
        with self._cond:
            idle = not self._pending and not self._lookups[0]
            self._lookups[0] += 1
            self._lookups[1] += found
            self._lookups[2] += missed
            self._lookups[3] += on_disk
            if idle:
                self._wake()

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
        requests = [pb.TouchRequest(keys=chain) for chain in chains]
        first = requests[0]
        first.lookup_calls, first.lookup_blocks, first.lookup_misses, first.lookup_disk_blocks = \
            calls, found, missed, on_disk
        return requests if requests[0].keys or calls else []

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._lookups[0] and not self._closed:
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
            self._flush(requests)

    def _flush(self, requests: list[pb.TouchRequest], timeout_s: float | None = None) -> None:
        for request in requests:
            try:
                self._send(request, timeout_s)
            except TierCacheError as e:  # best effort: the next read touches again
                logger.debug("touch of %d blocks failed: %s", len(request.keys), e)
                return  # the daemon is down or slow: the rest would wait as long each

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._cond:
            requests = self._take()
        self._flush(requests, timeout_s=1.0)  # what is still pending, briefly: closing must not hang
