"""Which tiers hold each block: placement with eviction and demotion, verified reads, promotion."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable

from tiercache.config import Config
from tiercache.errors import CapacityExceeded, CorruptBlock, NotFound
from tiercache.index import Entry, Index
from tiercache.layout import checksum
from tiercache.block import Block
from tiercache.tiers.base import Tier

logger = logging.getLogger(__name__)


class Placement:
    """Moves blocks between the tiers of one TieredStore and keeps its index in step with them.

    The store owns one and shares with it its tier map, index and counters (the same objects, not
    copies); every method expects the store's lock to be held. A tier past its high watermark evicts
    least-recently-used unpinned blocks down to its low watermark, demoting each to the next tier
    when it is not there yet. A read takes the fastest copy, drops damaged ones, and promotes disk
    hits to host, frequent host hits to gpu, and (write_policy "selective") frequent hits to disk.
    """

    def __init__(self, cfg: Config, tiers: dict[str, Tier], index: Index, counters: Counter[str],
                 clock: Callable[[], float]) -> None:
        self.cfg = cfg
        self.tiers = tiers
        self.index = index
        self.counters = counters
        self._watermarks = {"host": cfg.host, "gpu": cfg.gpu, "disk": cfg.disk}
        self._clock = clock
        self._seen_write_failures = 0

    # ---- placement and removal -----------------------------------------------------------------

    def place(self, name: str, block: Block, protect: set[bytes], attrs: dict | None = None) -> None:
        """Make room in tier `name` (evicting and demoting LRU blocks outside `protect`) and store
        `block` there. Does not touch the index entry of `block`. Raises CapacityExceeded."""
        tier = self.tiers[name]
        cost = tier.cost_bytes(block.meta)
        if cost > tier.capacity_bytes:
            raise CapacityExceeded(f"block of {block.meta.nbytes} bytes is larger than the whole {name} tier "
                                   f"({tier.capacity_bytes} bytes)")
        marks = self._watermarks[name]
        if tier.used_bytes + cost > marks.high_watermark * tier.capacity_bytes:
            self._evict(name, int(marks.low_watermark * tier.capacity_bytes) - cost, protect)
        if tier.used_bytes + cost > tier.capacity_bytes:
            raise CapacityExceeded(f"{name} tier full: {tier.used_bytes} of {tier.capacity_bytes} bytes in use "
                                   f"by pinned or in-flight blocks; need {cost} more")
        if attrs is not None:
            tier.put(block, attrs=attrs)  # type: ignore[call-arg]
        else:
            tier.put(block)

    def remove_from(self, entry: Entry, name: str, *, evicted: bool) -> None:
        """Delete the `name` copy of `entry` (counted as an eviction when `evicted`); the index
        forgets the entry once no tier holds it."""
        tier = self.tiers[name]
        if evicted:
            tier.evict(entry.meta.key)
            self.counters[f"evictions_{name}"] += 1
        else:
            tier.remove(entry.meta.key)
        entry.tiers.discard(name)
        if not entry.tiers:
            self.index.discard(entry.meta.key)

    def drop(self, key: bytes) -> bool:
        """Delete `key` from every tier and the index; False when it was not indexed."""
        entry = self.index.get(key)
        if entry is None:
            return False
        for name in list(entry.tiers):
            self.remove_from(entry, name, evicted=False)
        return True

    def _evict(self, name: str, target_bytes: int, protect: set[bytes]) -> None:
        tier = self.tiers[name]
        now = self._clock()
        for key in tier.lru_keys():
            if tier.used_bytes <= target_bytes:
                return
            entry = self.index.get(key)
            if entry is None or key in protect or entry.is_pinned(now):
                continue
            lower = self._lower(name, entry)
            if lower is not None:
                try:
                    self.place(lower, tier.get(key), protect | {key}, **self._attrs_for(lower, entry))
                    entry.tiers.add(lower)
                    self.counters[f"demotions_{name}_to_{lower}"] += 1
                except (CapacityExceeded, CorruptBlock) as e:
                    logger.debug("demotion from %s failed, dropping: %s", name, e)
            self.remove_from(entry, name, evicted=True)

    def _lower(self, name: str, entry: Entry) -> str | None:
        """The tier a block evicted from `name` should go to, or None when it is already there."""
        below = {"gpu": "host", "host": "disk", "disk": None}[name]
        if below == "host" and "host" in entry.tiers:
            return None
        if below == "disk" and ("disk" not in self.tiers or "disk" in entry.tiers):
            return None
        return below

    def _attrs_for(self, name: str, entry: Entry) -> dict:
        return {"attrs": entry.attrs()} if name == "disk" else {}

    def forget_lost_writes(self) -> None:
        """Drop "disk" from entries whose queued write the disk tier gave up on (disk full, I/O error).

        The disk tier drops such blocks on its writer thread and only counts them (write_failures);
        without this the index would keep claiming disk copies that do not exist: Lookup would report
        hits that Fetch cannot serve, quotas would count them, and close() would fail on them.
        """
        disk = self.tiers.get("disk")
        failures = getattr(disk, "write_failures", 0)
        if failures == self._seen_write_failures:
            return
        self._seen_write_failures = failures
        assert disk is not None
        for entry in list(self.index.values()):
            if "disk" in entry.tiers and not disk.contains(entry.meta.key):
                entry.tiers.discard("disk")
                self.counters["disk_writes_lost"] += 1
                if not entry.tiers:
                    self.index.discard(entry.meta.key)

    # ---- reads across tiers --------------------------------------------------------------------

    def live(self, key: bytes, now: float) -> Entry:
        """The unexpired entry of `key`; an expired one is dropped. Raises NotFound (counted as a miss)."""
        entry = self.index.get(key)
        if entry is None:
            self.counters["misses"] += 1
            raise NotFound(f"block {key.hex()[:16]} is not cached")
        if entry.is_expired(now):
            self.drop(key)
            self.counters["misses"] += 1
            raise NotFound(f"block {key.hex()[:16]} expired")
        return entry

    def read(self, entry: Entry, name: str) -> Block:
        """The block from tier `name`, verified; a damaged copy is dropped and counted, then CorruptBlock.

        The disk tier verifies its own reads. Memory tiers are checked here: a stray write into the
        shared slab must not reach a caller of the byte path, which may not check checksums itself.
        """
        try:
            block = self.tiers[name].get(entry.meta.key)
            if name != "disk" and checksum(block.payload) != entry.meta.checksum:
                self.tiers[name].remove(entry.meta.key)
                logger.warning("dropped the %s copy of block %s: it fails its checksum", name, entry.meta.key.hex())
                raise CorruptBlock(f"{name} copy of block {entry.meta.key.hex()[:16]} fails its checksum")
            return block
        except CorruptBlock:
            self.counters["verification_failures"] += 1
            entry.tiers.discard(name)  # the tier has already dropped its copy
            if not entry.tiers:
                self.index.discard(entry.meta.key)
            raise

    def get(self, key: bytes, now: float) -> Block:
        """The block from its fastest intact copy, recording the hit and promoting per policy.
        Raises NotFound, or CorruptBlock when every copy was damaged."""
        entry = self.live(key, now)
        while True:
            name = entry.fastest_tier()
            try:
                block = self.read(entry, name)
                break
            except CorruptBlock:
                if not entry.tiers:  # no copy left: a miss
                    raise
        self.record_hit(entry, name, now)
        if name == "disk":
            self._promote(entry, "host", block)
        self._promote_hot(entry, name, lambda: block)
        return block

    def host_hit(self, entry: Entry, now: float) -> None:
        """A hit on the host copy that was read without get() (a slab descriptor, a record framed
        from the slab, a worker's own read through the shared index): counted, and promoted per
        policy like a get, reading the block from host only when it is promoted."""
        self.record_hit(entry, "host", now)
        try:
            self._promote_hot(entry, "host", lambda: self.read(entry, "host"))
        except CorruptBlock:  # no hit after all: the host copy was damaged (and dropped)
            entry.hits -= 1
            self.counters["hits_host"] -= 1
            raise

    def _promote_hot(self, entry: Entry, name: str, block: Callable[[], Block]) -> None:
        """Frequent host hits to gpu; (write_policy "selective") frequent hits to disk; (remote
        write_policy "hits") frequent hits to the remote tier."""
        if name == "host" and "gpu" in self.tiers and "gpu" not in entry.tiers \
                and entry.hits >= self.cfg.gpu.promote_after_hits:
            self._promote(entry, "gpu", block())
        if ("disk" in self.tiers and "disk" not in entry.tiers and self.cfg.disk.write_policy == "selective"
                and entry.hits >= self.cfg.disk.selective_hits):
            self._promote(entry, "disk", block())
        remote = self.tiers.get("remote")
        if (remote is not None and self.cfg.remote.write_policy == "hits"
                and entry.hits == self.cfg.remote.write_after_hits):
            remote.put(block())  # queued: sent by the remote tier's writer thread

    def record_hit(self, entry: Entry, name: str, now: float) -> None:
        """Count a hit on the `name` copy and refresh the entry's access time and sliding TTL."""
        entry.hits += 1
        entry.last_access = now
        if entry.ttl_s:
            entry.expires_at = now + entry.ttl_s
        self.counters[f"hits_{name}"] += 1

    def _promote(self, entry: Entry, name: str, block: Block) -> None:
        try:
            self.place(name, block, {entry.meta.key}, **self._attrs_for(name, entry))
        except CapacityExceeded as e:
            logger.debug("no promotion into %s: %s", name, e)
            return
        entry.tiers.add(name)
        self.counters[f"promotions_to_{name}"] += 1
