"""The status page's figures: readings of the cache taken every few seconds, an hour of them kept, as JSON."""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

SPAN_S = 3600.0  # the history the page shows
INTERVAL_S = 10.0  # one reading every this many seconds
NUM_REQUESTS = 50  # the last requests kept
NUM_NAMESPACES = 100  # namespaces shown, most recently used first


@dataclass(frozen=True)
class TierReading:
    name: str
    capacity_bytes: int
    used_bytes: int
    num_blocks: int
    lookup_hits: int  # looked-up keys this tier answered, since the daemon started


@dataclass(frozen=True)
class Reading:
    """The daemon's counters at one moment (totals since it started)."""

    tiers: list[TierReading]
    lookup_misses: int
    tokens_reused: int  # prompt tokens served from the cache, as workers report them
    tokens_computed: int


@dataclass(frozen=True)
class BlockRow:
    """One cached block, as much of it as the page shows."""

    namespace: bytes
    parent: bytes  # b"" for the first block of a chain
    num_tokens: int
    tiers: tuple[str, ...]
    hits: int
    last_access: float
    pinned: bool
    preview: str  # the first block's text as its worker stored it ("" for salted namespaces)


@dataclass(frozen=True)
class RequestRow:
    """One served request: when, its prompt split into cached and computed tokens, where the blocks came from."""

    at: float
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    tiers: tuple[str, ...] = ()
    tenant: str = ""  # the HTTP API's tenant ("" for the household and for workers' reports)

    @property
    def computed_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


class RecentRequests:
    """The last `size` requests, newest last (appended from any thread)."""

    def __init__(self, size: int = NUM_REQUESTS) -> None:
        self._rows: collections.deque[RequestRow] = collections.deque(maxlen=size)

    def add(self, row: RequestRow) -> None:
        self._rows.append(row)

    def rows(self) -> list[RequestRow]:
        return list(self._rows)


@dataclass
class _Point:
    at: float
    reading: Reading


@dataclass
class History:
    """Readings at least `interval_s` apart over the last `span_s`; the page's series are their differences."""

    interval_s: float = INTERVAL_S
    span_s: float = SPAN_S
    _points: collections.deque[_Point] = field(default_factory=collections.deque)

    def record(self, at: float, reading: Reading) -> None:
        if self._points and at - self._points[-1].at < self.interval_s * 0.5:
            return  # a reading asked for out of turn: the kept ones stay evenly spaced
        self._points.append(_Point(at, reading))
        while self._points and self._points[0].at < at - self.span_s - self.interval_s:
            self._points.popleft()

    def points(self, now: float, current: Reading) -> list[_Point]:
        """The kept readings in the last span, and `current` as the last one."""
        kept = [p for p in self._points if p.at >= now - self.span_s - self.interval_s and p.at < now]
        return [*kept, _Point(now, current)]


def _lookups(r: Reading) -> int:
    return sum(t.lookup_hits for t in r.tiers) + r.lookup_misses


def _tier_hits(r: Reading) -> dict[str, int]:
    return {t.name: t.lookup_hits for t in r.tiers}


def _rate(part: float, whole: float) -> float | None:
    return part / whole if whole > 0 else None


def series(points: Sequence[_Point]) -> dict:
    """Per interval between readings: hit rate of looked-up keys, tokens saved and computed, each tier's fill."""
    out: dict = {"t": [], "hit_rate": [], "tokens_saved": [], "tokens_computed": [], "fill": {}}
    for before, after in itertools.pairwise(points):
        a, b = before.reading, after.reading
        hits = sum(_tier_hits(b).values()) - sum(_tier_hits(a).values())
        out["t"].append(round(after.at, 3))
        out["hit_rate"].append(_rate(hits, _lookups(b) - _lookups(a)))
        out["tokens_saved"].append(max(0, b.tokens_reused - a.tokens_reused))
        out["tokens_computed"].append(max(0, b.tokens_computed - a.tokens_computed))
        for t in b.tiers:
            out["fill"].setdefault(t.name, []).append(_rate(t.used_bytes, t.capacity_bytes))
    return out


def tiers(points: Sequence[_Point]) -> list[dict]:
    """Each tier now, with its share of the looked-up keys over the points' span."""
    first, last = points[0].reading, points[-1].reading
    lookups = _lookups(last) - _lookups(first)
    before = _tier_hits(first)
    return [{"name": t.name, "capacity_bytes": t.capacity_bytes, "used_bytes": t.used_bytes,
             "num_blocks": t.num_blocks, "fill": _rate(t.used_bytes, t.capacity_bytes),
             "hits": t.lookup_hits - before.get(t.name, 0),
             "hit_rate": _rate(t.lookup_hits - before.get(t.name, 0), lookups)} for t in last.tiers]


def namespaces(blocks: Iterable[BlockRow], models: dict[bytes, tuple[str, bool]], *, previews: bool = True,
               limit: int = NUM_NAMESPACES) -> list[dict]:
    """One row per namespace: its model and whether it is salted (`models`: digest -> (model, salted)),
    blocks, tokens, hits, blocks per tier, pins, last use, and the preview of its most used chain
    (with `previews` only, and never for a salted namespace nor one the page cannot tell is unsalted)."""
    rows: dict[bytes, dict] = {}
    best: dict[bytes, tuple[int, str]] = {}
    for b in blocks:
        row = rows.setdefault(b.namespace, {"blocks": 0, "tokens": 0, "hits": 0, "pinned": 0, "last_use": 0.0,
                                            "tiers": {}})
        row["blocks"] += 1
        row["tokens"] += b.num_tokens
        row["hits"] += b.hits
        row["pinned"] += int(b.pinned)
        row["last_use"] = max(row["last_use"], b.last_access)
        for tier in b.tiers:
            row["tiers"][tier] = row["tiers"].get(tier, 0) + 1
        if not b.parent and b.preview and b.hits >= best.get(b.namespace, (-1, ""))[0]:
            best[b.namespace] = (b.hits, b.preview)
    out = []
    for digest, row in sorted(rows.items(), key=lambda item: item[1]["last_use"], reverse=True)[:limit]:
        model, salted = models.get(digest, ("", True))  # undescribed: treated as salted, nothing shown
        out.append({"namespace": digest.hex()[:16], "model": model or "(not described)", "salted": salted,
                    "preview": best.get(digest, (0, ""))[1] if previews and not salted else "", **row})
    return out


def requests(rows: Iterable[RequestRow], tenant: str | None = None) -> list[dict]:
    """The last requests, newest first; only `tenant`'s when given."""
    return [{"at": round(r.at, 3), "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens,
             "computed_tokens": r.computed_tokens, "ttft_ms": round(r.ttft_s * 1e3, 1), "tiers": sorted(set(r.tiers))}
            for r in reversed(list(rows)) if tenant is None or r.tenant == tenant]


class StatusBoard:
    """What the status page shows, from three sources the server supplies: `read` (the daemon's counters
    now), `blocks` (the cached blocks, of one tenant or all (None), and their namespaces' models) and
    `recent` (the last requests).
    A thread takes a reading every `interval_s` (start/stop); snapshot() is the page's status.json."""

    def __init__(self, source: str, read: Callable[[], Reading],
                 blocks: Callable[[str | None], tuple[list[BlockRow], dict[bytes, tuple[str, bool]]]],
                 recent: RecentRequests, *, interval_s: float = INTERVAL_S, version: str = "") -> None:
        self.source, self.version = source, version
        self._read, self._blocks, self.recent = read, blocks, recent
        self.history = History(interval_s)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.extra: dict = {}  # shown as is (the HTTP API adds its model and workers)

    def sample(self) -> Reading:
        reading = self._read()
        with self._lock:
            self.history.record(time.time(), reading)
        return reading

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="status-board", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sample()
            except Exception as e:  # noqa: BLE001 - a daemon that is down for a moment leaves a gap, nothing more
                logger.debug("status reading failed: %s", e)
            self._stop.wait(self.history.interval_s)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)

    def snapshot(self, *, blocks_of: str | None = None, requests_of: str | None = None, previews: bool = True) -> dict:
        """status.json: tiers, the hour's series and totals, the namespaces (of `blocks_of`'s blocks only,
        when given; previews only with `previews`) and the last requests (`requests_of`'s only, when given)."""
        now = time.time()
        current = self._read()
        with self._lock:
            points = self.history.points(now, current)
        blocks, models = self._blocks(blocks_of)
        lines = series(points)
        hits = sum(_tier_hits(current).values()) - sum(_tier_hits(points[0].reading).values())
        lookups = _lookups(points[-1].reading) - _lookups(points[0].reading)
        hour = {"since": round(points[0].at, 3), "lookups": lookups, "hits": hits, "hit_rate": _rate(hits, lookups),
                "tokens_saved": current.tokens_reused - points[0].reading.tokens_reused,
                "tokens_computed": current.tokens_computed - points[0].reading.tokens_computed}
        return {"source": self.source, "version": self.version, "now": round(now, 3), **self.extra,
                "interval_s": self.history.interval_s, "tiers": tiers(points), "hour": hour, "series": lines,
                "namespaces": namespaces(blocks, models, previews=previews),
                "requests": requests(self.recent.rows(), requests_of)}
