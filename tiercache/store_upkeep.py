"""The store's operations over the whole index: flush, expire, verify, entries, persist, shutdown saves, integrity."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence

from tiercache.block import TIER_ORDER
from tiercache.config import Config
from tiercache.errors import CapacityExceeded, CorruptBlock, InvalidArgument, NotFound, Unavailable
from tiercache.placement import Placement
from tiercache.store_types import EntryInfo, VerifyReport

logger = logging.getLogger("tiercache.store")  # the store's log lines keep their logger


class StoreUpkeep:
    """A TieredStore's operations over its whole index (its admin calls and the daemon's idle work),
    made through the store's Placement under the store's lock (the same objects, handed in)."""

    def __init__(self, cfg: Config, placement: Placement, lock: threading.RLock, clock: Callable[[], float]) -> None:
        self.cfg = cfg
        self._placement = placement
        self.index = placement.index
        self.counters: Counter[str] = placement.counters
        self.disk = placement.tiers.disk
        self.remote = placement.tiers.remote
        self._lock = lock
        self._clock = clock

    def flush(self, *, tier: str | None = None, namespace: bytes | None = None, tenant: str | None = None) -> int:
        """Delete the matching blocks from one tier or from all; returns blocks affected. Tier
        "remote" deletes `tenant`'s keys under this daemon's remote.key_prefix (every tenant's when
        None), whichever daemon wrote them; not by namespace: a remote key names its tenant but not
        its namespace, which only a read of every value tells."""
        if tier is not None and tier not in self._placement.names:
            raise NotFound(f"tier {tier!r} is not enabled (enabled: {', '.join(self._placement.names)})")
        if tier == "remote" and self.remote is not None:
            if namespace is not None:
                raise InvalidArgument("the remote tier cannot be flushed by namespace (its keys name the tenant, "
                                      "not the namespace): flush the tenant's whole remote tier, or other tiers")
            removed = self.remote.clear(tenant)
            logger.info("flush: tier=remote tenant=%s keys=%d", tenant, removed)
            return removed
        count = 0
        with self._lock:
            for entry in self.index.values():
                if namespace is not None and entry.meta.namespace != namespace:
                    continue
                if tenant is not None and entry.meta.tenant != tenant:
                    continue
                if tier is None:
                    count += self._placement.drop(entry.meta.key)
                elif tier in entry.tiers:
                    self._placement.remove_from(entry, tier, evicted=False)
                    count += 1
        logger.info("flush: tier=%s tenant=%s blocks=%d", tier or "all", tenant, count)
        return count

    def expire(self) -> int:
        """Drop every unpinned block whose TTL has passed; returns how many."""
        with self._lock:
            now = self._clock()
            expired = [e.meta.key for e in self.index.values() if e.is_expired(now)]
            for key in expired:
                self._placement.drop(key)
            self.counters["expired"] += len(expired)
        return len(expired)

    def verify(self, *, tenant: str | None = None, keys: Sequence[bytes] | None = None) -> VerifyReport:
        """Re-check the checksum of every stored copy (of `keys` only, when given); damaged copies
        are dropped and counted."""
        checked = 0
        bad: list[bytes] = []
        with self._lock:
            self._placement.forget_lost_writes()
            entries = self.index.values() if keys is None else [e for e in map(self.index.get, keys) if e]
            for entry in entries:
                if tenant is not None and entry.meta.tenant != tenant:
                    continue
                for name in sorted(entry.tiers, key=TIER_ORDER.index):
                    checked += 1
                    try:
                        self._placement.read(entry, name)  # verified (by the tier, or there): dropped, counted
                    except CorruptBlock as e:
                        logger.warning("verify: dropped a damaged copy: %s", e)
                        bad.append(entry.meta.key)
                    except NotFound as e:  # the tier lost a copy the index lists
                        logger.warning("verify: dropping a lost copy: %s", e)
                        self.counters["verification_failures"] += 1
                        self._placement.remove_from(entry, name, evicted=False)
                        bad.append(entry.meta.key)
        return VerifyReport(checked, len(bad), tuple(bad))

    def entries(self, *, namespace: bytes | None = None, tenant: str | None = None) -> list[EntryInfo]:
        with self._lock:
            self._placement.forget_lost_writes()
            now = self._clock()
            return [
                EntryInfo(e.meta, tuple(t for t in TIER_ORDER if t in e.tiers), e.hits, e.last_access,
                          e.is_pinned(now), e.expires_at,
                          e.pinned_until if e.is_pinned(now) and not math.isinf(e.pinned_until) else 0.0)
                for e in self.index.values()
                if (namespace is None or e.meta.namespace == namespace) and (tenant is None or e.meta.tenant == tenant)
            ]

    def persist(self, keys: Sequence[bytes], timeout_s: float | None = None) -> None:
        """Make the blocks of `keys` durable: written to the disk tier now (whatever its write policy)
        and committed. NotFound for a key no longer cached; Unavailable without a disk tier;
        DeadlineExceeded if the writer does not commit within timeout_s; CapacityExceeded naming how
        many writes failed (the blocks stay cached in memory)."""
        if self.disk is None:
            raise Unavailable("there is no disk tier: blocks cannot be made durable")
        with self._lock:
            self._placement.forget_lost_writes()
            now, protect = self._clock(), set(keys)  # a big call must not evict its own blocks
            for key in keys:
                entry = self._placement.live(key, now)
                if "disk" not in entry.tiers:
                    self._placement.copy(entry, "disk", self._placement.read(entry, entry.fastest_tier()), protect)
        self.flush_writes(timeout_s)
        with self._lock:
            self._placement.forget_lost_writes()  # drops "disk" from entries whose write failed
            lost = sum(1 for key in keys if "disk" not in getattr(self.index.get(key), "tiers", ()))
        if lost:
            raise CapacityExceeded(f"{lost} of {len(keys)} blocks did not reach the disk (its writes fail: "
                                   "full or failing filesystem); they stay cached in memory, not durable")

    def flush_writes(self, timeout_s: float | None = None) -> None:
        """Wait until every queued disk write is committed and every queued remote write sent."""
        if self.disk is not None:
            self.disk.flush(timeout_s)
        if self.remote is not None:
            self.remote.flush(timeout_s)

    def check_integrity(self) -> None:
        """Raise AssertionError unless every tier is consistent and index and tiers agree."""
        with self._lock:
            self._placement.forget_lost_writes()
            self._placement.check_integrity()

    def save_host_blocks(self, timeout_s: float | None = None) -> int:
        """Before a clean shutdown: queue to disk the host-only blocks a restart would lose and the
        policy meant to keep. All of them under write_back (it writes on eviction from host, and a
        shutdown evicts everything); the pinned ones under selective (a pin outlasts a restart under
        write_through). Pinned first, then the most recently used, while the disk has room without
        evicting a host block's disk copy, for up to timeout_s seconds (then a warning says how many
        were left). Returns how many were queued."""
        policy = self.cfg.disk.write_policy
        if self.disk is None or policy == "write_through":
            return 0
        queued = 0
        stop_at = None if timeout_s is None else time.monotonic() + timeout_s
        with self._lock:
            now = self._clock()
            hosted = [e for e in self.index.values() if "host" in e.tiers and not e.is_expired(now)]
            keep = {e.meta.key for e in hosted}  # their disk copies stay: a restart would lose them too
            wanted = [e for e in hosted if "disk" not in e.tiers and (policy == "write_back" or e.is_pinned(now))]
            wanted.sort(key=lambda e: (not e.is_pinned(now), -e.last_access))
            for entry in wanted:
                if stop_at is not None and time.monotonic() >= stop_at:
                    logger.warning("shutdown: host-only blocks=%d not saved to disk: %.1f s passed",
                                   len(wanted) - queued, timeout_s)
                    break
                try:
                    self._placement.copy(entry, "disk", self._placement.read(entry, "host"), keep)
                except CorruptBlock:  # dropped and counted: nothing to save
                    continue
                except CapacityExceeded as e:
                    logger.warning("shutdown: host-only blocks=%d not saved to disk: %s", len(wanted) - queued, e)
                    break
                queued += 1
        return queued

    def close(self) -> None:
        """Keep the hit counts of blocks on disk, then finish queued disk writes and release every tier."""
        with self._lock:
            self._placement.forget_lost_writes()
            for entry in self.index.values():
                if entry.hits:
                    self._placement.save_attrs(entry)
            # Lower tiers first: the disk writer may still read queued blocks out of the host slab
            # (puts in place are written through from there), so the slab goes last.
            for name in reversed(self._placement.names):
                self._placement.tier(name).close()
