"""Which tiers hold each block: the one component that changes the index and the tiers."""

from __future__ import annotations

import contextlib
import logging
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tiercache.block import Block, BlockMeta
from tiercache.config import Config, DiskConfig, GpuConfig, HostConfig
from tiercache.errors import CapacityExceeded, CorruptBlock, NotFound, TierCacheError
from tiercache.index import Entry, Index
from tiercache.layout import checksum
from tiercache.tiers.base import Attrs, DurableTier, SharedMemoryTier, Tier

if TYPE_CHECKING:
    from tiercache.tiers.remote import RemoteTier

logger = logging.getLogger(__name__)

LOWER = {"gpu": "host", "host": "disk", "disk": None}  # where a block evicted from a tier goes
HOST_ROOM_WAIT_S = 10.0  # the longest a put waits for the disk writer to give back host pages (_make_room)


@dataclass(frozen=True)
class Tiers:
    """The tiers of one store, each typed by what it can do: host and disk have operations of their
    own (the slab's locations, the disk's attributes and write queue). The remote tier is shared with
    other daemons and never listed in the index."""

    host: SharedMemoryTier
    disk: DurableTier | None = None
    gpu: Tier | None = None
    remote: RemoteTier | None = None

    def by_name(self) -> dict[str, Tier]:
        """The indexed tiers (and the remote one), by name."""
        named: dict[str, Tier | None] = {"host": self.host, "gpu": self.gpu, "disk": self.disk, "remote": self.remote}
        return {name: tier for name, tier in named.items() if tier is not None}


class Placement:
    """Every change to the index and to the tiers of one TieredStore: adds and removes alike.

    The store decides (which blocks, which tier, when); Placement carries it out and keeps the index,
    the tiers and the host tier's presence filter in step. Every method expects the store's lock to
    be held. A tier past its high watermark evicts least-recently-used unpinned blocks down to its low
    watermark, demoting each to the next tier when it is not there yet. A read takes the fastest copy,
    drops damaged ones, and promotes disk hits to host, frequent host hits to gpu, and (write_policy
    "selective") frequent hits to disk.

    Invariants (check_integrity): every indexed entry is held by each tier it names, and each tier
    holds exactly the entries that name it; the presence filter counts every indexed key.
    """

    def __init__(self, cfg: Config, tiers: Tiers, counters: Counter[str], clock: Callable[[], float]) -> None:
        self.cfg = cfg
        self.tiers = tiers
        self.index = Index()
        self.counters = counters
        self._by_name = tiers.by_name()
        self._watermarks: dict[str, HostConfig | GpuConfig | DiskConfig] = {"host": cfg.host, "gpu": cfg.gpu,
                                                                            "disk": cfg.disk}
        self._clock = clock
        self._seen_write_failures = 0
        if tiers.remote is not None:  # only the daemon can ask the remote tier: readers must ask it
            tiers.host.mark_every_key_present()

    def tier(self, name: str) -> Tier:
        return self._by_name[name]

    @property
    def names(self) -> list[str]:
        """The enabled tiers' names, the remote one included."""
        return list(self._by_name)

    # ---- the index ---------------------------------------------------------------------------------

    def load_durable(self) -> int:
        """Index every block the disk tier kept (at open); returns how many."""
        disk = self.tiers.disk
        if disk is None:
            return 0
        for meta, attrs in disk.records():
            entry = Entry(meta, {"disk"})
            entry.load_attrs(attrs)
            self._index_add(entry)
        return len(self.index)

    def _index_add(self, entry: Entry) -> None:
        self.index.add(entry)
        self.tiers.host.note_presence(entry.meta.key, 1, expires=bool(entry.ttl_s or entry.expires_at))

    def _index_discard(self, key: bytes) -> None:
        if self.index.discard(key) is not None:
            self.tiers.host.note_presence(key, -1, expires=False)

    def save_attrs(self, entry: Entry) -> None:
        """Keep the entry's attributes (pin, TTL, hits, last access) where they outlive a restart."""
        if self.tiers.disk is not None and "disk" in entry.tiers:
            self.tiers.disk.set_attrs(entry.meta.key, entry.attrs())

    def set_pin(self, entry: Entry, until: float) -> None:
        entry.pinned_until = until
        self.save_attrs(entry)

    def put_again(self, entry: Entry, ttl_s: float, pin: bool, now: float) -> None:
        """A present block put again: its bytes stay; a pin pins it, its TTL restarts (refresh_ttl)."""
        if pin:
            self.set_pin(entry, math.inf)
        self.refresh_ttl(entry, ttl_s, now)

    def write_through_host(self, entries: Sequence[Entry], protect: set[bytes]) -> None:
        """write_through of new blocks from their host copies, read by the disk writer in place (their
        pages pinned until written), queued as one batch: the writer then takes them together, not
        one by one while the caller is still queueing (they would take turns for the interpreter)."""
        disk = self.tiers.disk
        if disk is None or self.cfg.disk.write_policy != "write_through" or not entries:
            return
        try:
            self._make_room("disk", sum(disk.cost_bytes(e.meta) for e in entries),
                            protect | {e.meta.key for e in entries})
        except CapacityExceeded as e:
            logger.warning("write_through skipped: %s", str(e))
            self.counters["disk_write_skipped"] += len(entries)
            return
        items: list[tuple[Block, Attrs | None, Callable[[], None] | None]] = []
        for entry in entries:
            view, release = self.tiers.host.pinned_view(entry.meta.key)
            items.append((Block(entry.meta, view), entry.attrs(), release))
        try:
            queued = disk.put_many(items)
        except CapacityExceeded as e:
            logger.warning("write_through skipped: %s", str(e))
            self.counters["disk_write_skipped"] += len(entries)
            return
        for entry, ok in zip(entries, queued):
            if ok:
                entry.tiers.add("disk")

    def write_through(self, entry: Entry, block: Block, protect: set[bytes]) -> None:
        """A new block's copy to disk under write_policy "write_through" (no-op under the others or
        without a disk tier). A full disk tier only costs the block its disk copy: logged and counted
        (disk_write_skipped), never the put."""
        if self.tiers.disk is None or self.cfg.disk.write_policy != "write_through":
            return
        try:
            self.copy(entry, "disk", block, protect)
        except CapacityExceeded as e:
            # The message, not the exception: a handler that keeps records (a test's log capture, a
            # queue) would otherwise keep the traceback's frames and with them the caller's gRPC call.
            logger.warning("write_through skipped: %s", str(e))
            self.counters["disk_write_skipped"] += 1

    def refresh_ttl(self, entry: Entry, ttl_s: float, now: float) -> None:
        """A present block put again: its TTL restarts as on a hit, and the longer of its TTL and
        `ttl_s` is kept (0, none, the longest): a shared cache keeps a block as long as any caller asked."""
        if not entry.ttl_s:
            return
        entry.ttl_s = max(entry.ttl_s, ttl_s) if ttl_s else 0.0
        entry.expires_at = now + entry.ttl_s if entry.ttl_s else 0.0
        self.save_attrs(entry)

    # ---- placement and removal -----------------------------------------------------------------

    def add(self, block: Block, protect: set[bytes], now: float, *, ttl_s: float, pinned: bool) -> Entry:
        """A new block into host, indexed. Raises CapacityExceeded (nothing changed)."""
        self._place("host", block, protect)
        entry = Entry(block.meta, {"host"}, last_access=now, ttl_s=ttl_s, expires_at=now + ttl_s if ttl_s else 0.0,
                      pinned_until=math.inf if pinned else 0.0)
        self._index_add(entry)
        return entry

    def copy(self, entry: Entry, name: str, block: Block, protect: set[bytes],
             release: Callable[[], None] | None = None) -> None:
        """A copy of an indexed block into tier `name` too. Raises CapacityExceeded (nothing changed).
        `release` (the disk tier only): called once the payload is no longer read (DurableTier.put)."""
        try:
            self._make_room(name, self._by_name[name].cost_bytes(block.meta), protect | {entry.meta.key})
        except BaseException:
            if release is not None:
                release()
            raise
        if self.tiers.disk is not None and name == "disk":
            self.tiers.disk.put(block, entry.attrs(), release)
        else:
            self._by_name[name].put(block)
        entry.tiers.add(name)

    def _place(self, name: str, block: Block, protect: set[bytes]) -> None:
        """Make room in tier `name` and store `block` there."""
        self._make_room(name, self._by_name[name].cost_bytes(block.meta), protect)
        self._by_name[name].put(block)

    def _make_room(self, name: str, cost: int, protect: set[bytes]) -> None:
        """Room for `cost` bytes in tier `name`, evicting and demoting LRU blocks outside `protect`
        past its high watermark. Raises CapacityExceeded when pinned or protected blocks fill it."""
        tier = self._by_name[name]
        if cost > tier.capacity_bytes:
            raise CapacityExceeded(f"a block of {cost} bytes there is larger than the whole {name} tier "
                                   f"({tier.capacity_bytes} bytes)")
        marks = self._watermarks[name]
        if self._settled_bytes(name) + cost > marks.high_watermark * tier.capacity_bytes:
            self._evict(name, int(marks.low_watermark * tier.capacity_bytes) - cost, protect)
        if tier.used_bytes + cost > tier.capacity_bytes and name == "host":
            self._wait_for_written_pages(cost)
            if tier.used_bytes + cost > tier.capacity_bytes:  # the writer is behind: free pages now instead
                self._evict(name, tier.capacity_bytes - cost, protect, settled=False)
        if tier.used_bytes + cost > tier.capacity_bytes:
            raise CapacityExceeded(f"{name} tier full: {tier.used_bytes} of {tier.capacity_bytes} bytes in use "
                                   f"by pinned or in-flight blocks; need {cost} more")

    def _settled_bytes(self, name: str) -> int:
        """Tier `name`'s used bytes once readers outside the lock are done: the host pages of evicted
        blocks that the disk writer still copies are as good as free (evicting more would not free
        them sooner, it would only throw out blocks that could have stayed)."""
        used = self._by_name[name].used_bytes
        return used - self.tiers.host.held_bytes if name == "host" else used

    def _wait_for_written_pages(self, cost: int) -> None:
        """Host room held only by evicted blocks that the disk writer is still copying from their
        pages (write_through reads new blocks in place): wait for the writes queued so far, at most
        HOST_ROOM_WAIT_S, then take their pages back. A burst of puts larger than the host tier then
        waits for the disk as a put of copies would, instead of failing."""
        host, disk = self.tiers.host, self.tiers.disk
        if disk is None or host.used_bytes - host.held_bytes + cost > host.capacity_bytes:
            return
        with contextlib.suppress(TierCacheError):
            disk.flush(timeout_s=HOST_ROOM_WAIT_S)
        host.reclaim()

    # ---- room written in place by same-host callers --------------------------------------------------

    def reserve(self, nbytes: int, protect: set[bytes]) -> tuple[int, ...]:
        """Host pages for a block of nbytes that a caller writes in place (room made as for a put).
        Raises CapacityExceeded."""
        host = self.tiers.host
        self._make_room("host", -(-nbytes // host.page_bytes) * host.page_bytes, protect)
        return host.reserve(nbytes)

    def unreserve(self, pages: tuple[int, ...]) -> None:
        self.tiers.host.unreserve(pages)

    def adopt(self, meta: BlockMeta, pages: tuple[int, ...], now: float, *, ttl_s: float, pinned: bool) -> Entry:
        """Reserved host pages that hold `meta`'s bytes, made the block, indexed (as add() does for a
        copy). The key must not be indexed."""
        if not self.tiers.host.adopt(meta, pages):
            raise AssertionError(f"block {meta.key.hex()[:16]} is in host but not indexed")
        entry = Entry(meta, {"host"}, last_access=now, ttl_s=ttl_s, expires_at=now + ttl_s if ttl_s else 0.0,
                      pinned_until=math.inf if pinned else 0.0)
        self._index_add(entry)
        return entry


    def remove_from(self, entry: Entry, name: str, *, evicted: bool) -> None:
        """Delete the `name` copy of `entry` (counted as an eviction when `evicted`); the index
        forgets the entry once no tier holds it."""
        tier = self._by_name[name]
        if evicted:
            tier.evict(entry.meta.key)
            self.counters[f"evictions_{name}"] += 1
        else:
            tier.remove(entry.meta.key)
        self._forget_copy(entry, name)

    def _forget_copy(self, entry: Entry, name: str) -> None:
        entry.tiers.discard(name)
        if not entry.tiers:
            self._index_discard(entry.meta.key)

    def drop(self, key: bytes) -> bool:
        """Delete `key` from every tier and the index; False when it was not indexed."""
        entry = self.index.get(key)
        if entry is None:
            return False
        for name in list(entry.tiers):
            self.remove_from(entry, name, evicted=False)
        return True

    def _evict(self, name: str, target_bytes: int, protect: set[bytes], *, settled: bool = True) -> None:
        """Evict (demoting where a lower tier should hold it) LRU blocks outside `protect` until the
        tier's settled bytes (see _settled_bytes), or with settled=False its used bytes, are at most
        target_bytes."""
        tier = self._by_name[name]
        now = self._clock()
        for key in tier.lru_keys():
            if (self._settled_bytes(name) if settled else tier.used_bytes) <= target_bytes:
                return
            entry = self.index.get(key)
            if entry is None or key in protect or entry.is_pinned(now):
                continue
            lower = self._lower(name, entry)
            if lower is not None:
                try:
                    self.copy(entry, lower, tier.get(key), protect)
                    self.counters[f"demotions_{name}_to_{lower}"] += 1
                except (CapacityExceeded, CorruptBlock) as e:
                    logger.debug("demotion from %s failed, dropping: %s", name, e)
            self.remove_from(entry, name, evicted=True)

    def _lower(self, name: str, entry: Entry) -> str | None:
        """The tier a block evicted from `name` should go to, or None when it is already there (or none is)."""
        below = LOWER[name]
        if below is None or below not in self._by_name or below in entry.tiers:
            return None
        return below

    def forget_lost_writes(self) -> None:
        """Drop "disk" from entries whose queued write the disk tier gave up on (disk full, I/O error).

        The disk tier drops such blocks on its writer thread and only counts them (write_failures);
        without this the index would keep claiming disk copies that do not exist: Lookup would report
        hits that Fetch cannot serve, quotas would count them, and close() would fail on them.
        """
        disk = self.tiers.disk
        if disk is None or disk.write_failures == self._seen_write_failures:
            return
        self._seen_write_failures = disk.write_failures
        for entry in list(self.index.values()):
            if "disk" in entry.tiers and not disk.contains(entry.meta.key):
                self.counters["disk_writes_lost"] += 1
                self._forget_copy(entry, "disk")

    # ---- reads across tiers --------------------------------------------------------------------

    def snapshot_reads(self) -> contextlib.AbstractContextManager[None]:
        """The disk tier's snapshot_reads, for a chain of promotions (its reads are views until the
        block exits: only promoted, or copied, never kept)."""
        return self.tiers.disk.snapshot_reads() if self.tiers.disk is not None else contextlib.nullcontext()

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

        Tiers that verify their own reads (Tier.verifies_reads) are trusted; the others are checked
        here: a stray write into the shared slab must not reach a caller of the byte path, which may
        not check checksums itself.
        """
        tier = self._by_name[name]
        try:
            block = tier.get(entry.meta.key)
            if not tier.verifies_reads and checksum(block.payload) != entry.meta.checksum:
                tier.remove(entry.meta.key)
                logger.warning("dropped the %s copy of block %s: it fails its checksum", name, entry.meta.key.hex())
                raise CorruptBlock(f"{name} copy of block {entry.meta.key.hex()[:16]} fails its checksum")
            return block
        except CorruptBlock:
            self.counters["verification_failures"] += 1
            self._forget_copy(entry, name)  # the tier has already dropped its copy
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
            self.promote(entry, "host", block)
        self.promote_hot(entry, name, block)
        return block

    def locate(self, key: bytes) -> tuple[list[int], list[int]]:
        """The host copy's pages and generations (SharedMemoryTier.locate)."""
        return self.tiers.host.locate(key)

    def host_hit(self, entry: Entry, now: float) -> None:
        """A hit on the host copy that was read without get() (a slab descriptor, a record framed
        from the slab): counted, and promoted per policy like a get, reading the block from host
        only when it is promoted. Raises CorruptBlock when that read finds the copy damaged."""
        self.record_hit(entry, "host", now)
        try:
            self.promote_hot(entry, "host")
        except CorruptBlock:  # no hit after all: the host copy was damaged (and dropped)
            entry.hits -= 1
            self.counters["hits_host"] -= 1
            raise

    def promote_hot(self, entry: Entry, name: str, block: Block | None = None) -> None:
        """Frequent hits on the `name` copy: host hits to gpu; (write_policy "selective") to disk;
        (remote write_policy "hits") to the remote tier. `block` is that copy, read from `name` (and
        verified) only when a promotion needs it and it is None: CorruptBlock if it is damaged."""
        def copy() -> Block:
            return block if block is not None else self.read(entry, name)

        if name == "host" and self.tiers.gpu is not None and "gpu" not in entry.tiers \
                and entry.hits >= self.cfg.gpu.promote_after_hits:
            block = copy()
            self.promote(entry, "gpu", block)
        if (self.tiers.disk is not None and "disk" not in entry.tiers and self.cfg.disk.write_policy == "selective"
                and entry.hits >= self.cfg.disk.selective_hits):
            block = copy()
            self.promote(entry, "disk", block)
        remote = self.tiers.remote
        if (remote is not None and self.cfg.remote.write_policy == "hits"
                and entry.hits == self.cfg.remote.write_after_hits):
            remote.put(copy())  # queued: its record is made now, sent by the remote tier's writer thread

    def promote(self, entry: Entry, name: str, block: Block) -> bool:
        """A copy of the block into the faster tier `name` when there is room; whether it went there."""
        try:
            self.copy(entry, name, block, set())
        except CapacityExceeded as e:
            logger.debug("no promotion into %s: %s", name, e)
            return False
        self.counters[f"promotions_to_{name}"] += 1
        return True

    def record_hit(self, entry: Entry, name: str, now: float) -> None:
        """Count a hit on the `name` copy and refresh the entry's access time and sliding TTL."""
        entry.hits += 1
        entry.last_access = now
        if entry.ttl_s:
            entry.expires_at = now + entry.ttl_s
        self.counters[f"hits_{name}"] += 1

    def touch_tail_first(self, keys: Sequence[bytes]) -> None:
        """Mark a chain's blocks most recently used in each tier that holds them, its tail first, so
        that the head of a prefix stays more recent than its tail and eviction takes tails first."""
        by_tier: dict[str, list[bytes]] = {}
        for key in reversed(keys):
            entry = self.index.get(key)
            if entry is not None:
                for name in entry.tiers:
                    by_tier.setdefault(name, []).append(key)
        for name, touched in by_tier.items():  # one call per tier: the disk tier checks and locks once
            self._by_name[name].touch_many(touched)

    def check_integrity(self) -> None:
        """Raise AssertionError unless every tier is consistent and index and tiers agree."""
        self.index.check_integrity()
        for name, tier in self._by_name.items():
            tier.check_integrity()
            if name == "remote":
                continue
            stored = {m.key for m in tier.metas()}
            indexed = {e.meta.key for e in self.index.values() if name in e.tiers}
            assert stored == indexed, f"{name}: {len(stored - indexed)} stored but not indexed, " \
                                      f"{len(indexed - stored)} indexed but not stored"
