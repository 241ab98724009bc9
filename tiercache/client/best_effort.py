"""Best-effort use of the daemon: a client from a factory, left alone for a while after a failure, then a fresh one."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from tiercache.errors import TierCacheError

logger = logging.getLogger(__name__)

# What a call to a daemon that is down, slow or restarting raises; ValueError: a channel that another
# thread's failure closed meanwhile.
DAEMON_ERRORS = (TierCacheError, OSError, ValueError)
MAX_RETRY_AFTER_S = 30.0  # the longest wait between tries, unless retry_after_s itself is longer
OUTAGE_FRACTION = 0.1  # a long outage is tried again after this share of its length so far


class _Closable(Protocol):
    def close(self) -> None: ...


C = TypeVar("C", bound=_Closable)
T = TypeVar("T")


class BestEffort(Generic[C]):
    """One client of the daemon, made by `factory` on first use and shared by threads until a call
    with it fails. Then it is closed and, for a while, client() hands out none (the caller goes on
    without the daemon); after that the factory makes a fresh one, as gRPC's own reconnect backoff
    on the old channel grows to minutes.

    The wait is retry_after_s, or a tenth of the outage so far (since the first failure after the
    last call that went through, succeeded()) when that is longer, but at most max_retry_after_s
    (or retry_after_s, when that is longer still). `clock` is time.monotonic but in tests. Why
    back off: a fresh client's first call to a daemon on a host that is off fails only at its
    deadline, and a request pays it; a daemon down for hours then costs one such request (and one
    log line) every max_retry_after_s, not every retry_after_s. Why not double the wait per
    failure: a restart, an outage of seconds, is still tried every retry_after_s, and a daemon
    that comes back is used again within a tenth of the time it was away.

    Without a factory (None: the cache is off) client() is always None.

    Thread-safe. Counters (read them, never reset): num_failures (failed calls, and factories that
    raised), num_skipped (client() calls answered None while the daemon was left alone).
    """

    def __init__(self, factory: Callable[[], C] | None, retry_after_s: float, *,
                 max_retry_after_s: float = MAX_RETRY_AFTER_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.retry_after_s = retry_after_s
        self._max_wait_s = max(retry_after_s, max_retry_after_s)
        self._factory = factory
        self._clock = clock
        self._client: C | None = None
        self._down_until = 0.0  # clock() before which no client is handed out
        self._outage_since: float | None = None  # clock() at the first failure since a call went through
        self._lock = threading.Lock()
        self.num_failures = 0
        self.num_skipped = 0

    def client(self) -> C | None:
        """The shared client; None while the daemon is left alone, or when the factory failed."""
        client = self._client
        if client is not None or self._factory is None:
            return client
        with self._lock:
            if self._clock() < self._down_until:
                self.num_skipped += 1
                return None
            if self._client is None:
                try:
                    self._client = self._factory()
                except DAEMON_ERRORS as e:
                    self.num_failures += 1
                    self._give_up("connect", e)
                    return None
            return self._client

    def succeeded(self) -> None:
        """A call went through: the outage, if any, is over."""
        self._outage_since = None

    def failed(self, client: C, what: str, error: Exception) -> str:
        """A call with `client` raised `error`: count it, log it, leave the daemon alone for a while.
        A client that another thread's failure replaced already counts, but the wait stays: it is
        the same outage. Returns "what: error" (the worker's Result.degraded)."""
        with self._lock:
            self.num_failures += 1
            current = client is self._client
            if current:
                self._client = None
                self._give_up(what, error)
        if current:
            client.close()
        else:
            logger.debug("daemon %s failed too (%s), with a client already given up", what, error)
        return f"{what}: {error}"

    def _give_up(self, what: str, error: Exception) -> None:
        """Start the wait; the caller holds the lock."""
        now = self._clock()
        if self._outage_since is None:
            self._outage_since = now
        wait_s = min(max(self.retry_after_s, OUTAGE_FRACTION * (now - self._outage_since)), self._max_wait_s)
        self._down_until = now + wait_s
        logger.warning("tiercache %s failed (%s); going on without the daemon, tried again in %.1f s",
                       what, error, wait_s)

    def call(self, what: str, fn: Callable[[C], T], default: T) -> T:
        """fn(client), or `default` while the daemon is left alone or when the call fails (a failure)."""
        client = self.client()
        if client is None:
            return default
        try:
            result = fn(client)
        except DAEMON_ERRORS as e:
            self.failed(client, what, e)
            return default
        self.succeeded()
        return result

    def close(self) -> None:
        """Close the current client (a later client() makes a new one)."""
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()
