"""How many blocks and bytes the remote tier holds: a sampled estimate over the cluster's primaries.

No daemon can keep an exact count: other daemons write the same cluster, and the cluster itself
evicts (allkeys-lru) and expires keys without telling anyone. So the count is sampled where it
lives: each primary's DBSIZE (exact) times the share of RANDOMKEY samples that fall under this
daemon's key prefix, and each such sample's STRLEN for the bytes. A cluster used only by tiercache
under one key_prefix has a share of 1: its block count is then exact, its bytes an estimate.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from tiercache.tiers.remote_link import ClusterLink

logger = logging.getLogger(__name__)

SAMPLES_PER_PRIMARY = 32
MAX_AGE_S = 10.0  # a census answers again for this long (admin stats, metrics scrapes)


@dataclass(frozen=True)
class Census:
    blocks: int  # estimated blocks under the key prefix, over every primary that answered
    bytes: int  # estimated bytes of their values
    sampled: int  # random keys drawn
    primaries: int  # primaries that answered
    failed: int  # primaries that did not (their blocks are left out)


class RemoteCensus:
    """A census of the keys under `prefix` (bytes, e.g. b"tiercache:"), at most once every MAX_AGE_S."""

    def __init__(self, link: ClusterLink, prefix: bytes) -> None:
        self._link = link
        self._prefix = prefix
        self._lock = threading.Lock()
        self._last: tuple[float, Census] | None = None

    def get(self) -> Census:
        with self._lock:
            if self._last is not None and time.monotonic() - self._last[0] < MAX_AGE_S:
                return self._last[1]
            census = self._take()
            self._last = (time.monotonic(), census)
            return census

    def _take(self) -> Census:
        blocks = nbytes = sampled = answered = failed = 0.0
        for conn in self._link.primaries():
            try:
                pipe = conn.pipeline(transaction=False)
                pipe.dbsize()
                for _ in range(SAMPLES_PER_PRIMARY):
                    pipe.randomkey()
                size, *keys = pipe.execute()
                ours = [k for k in keys if k is not None and bytes(k).startswith(self._prefix)]
                lengths = _strlens(conn, ours)
            except Exception as e:  # noqa: BLE001 - a shard that fails is left out, and counted
                logger.debug("remote census: a primary failed: %s", e)
                failed += 1
                continue
            drawn = sum(k is not None for k in keys)
            answered += 1
            sampled += drawn
            if drawn and ours:
                share = len(ours) / drawn
                blocks += size * share
                nbytes += size * share * sum(lengths) / len(lengths)
        return Census(round(blocks), round(nbytes), int(sampled), int(answered), int(failed))


def _strlens(conn: Any, keys: list[bytes]) -> list[int]:
    if not keys:
        return []
    pipe = conn.pipeline(transaction=False)
    for key in keys:
        pipe.strlen(key)
    return [int(n) for n in pipe.execute()]
