"""Page, index and LRU bookkeeping shared by the pooled tiers (gpu, host); they own the pool tensor."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace

import torch

from tiercache.block import Block, BlockMeta, TierStats
from tiercache.errors import CapacityExceeded, InvalidArgument, NotFound
from tiercache.page_pool import PagePool, pages_for, payload_bytes
from tiercache.pages import PageAllocator
from tiercache.tiers.base import Tier

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PagedEntry:
    """One stored block: its metadata, the pool pages holding its bytes in payload order, and their
    PagePool.full_page_index."""

    meta: BlockMeta
    pages: tuple[int, ...]
    index: torch.Tensor | None = field(default=None, compare=False)


class PagedTier(Tier):
    """A tier whose blocks live in fixed-size pages of one preallocated uint8 pool [num_pages, page_bytes].

    Invariants (checked by check_integrity):
      - the allocator's own invariants (free + used == num_pages, no page both free and used)
      - every entry holds exactly pages_for(meta.nbytes) pages, all used, no page in two entries,
        and the index tensor kept for them
      - the entries' pages, the reserved pages and the pages of removed blocks still pinned (or
        released and not yet returned) are disjoint, and together exactly the allocator's used set
      - used_bytes == used pages * page_bytes
    `_entries` is ordered from least to most recently used.

    Room written in place: reserve() takes pages a caller writes before adopt() makes them a block
    (or unreserve() gives them back). Pages read outside the store's lock: pin() keeps a block's
    pages from reuse until its release, from any thread; a block removed meanwhile keeps its pages
    allocated (counted in used_bytes) until then, and they return to the free list at the next
    allocation.

    Subclasses pass the pool in and may hook writes (`_begin_write`/`_end_write`) and frees
    (`_on_free`), which the host tier uses for its page generations.
    """

    def __init__(self, name: str, pool: torch.Tensor) -> None:
        self.name = name
        self._pool = PagePool(pool)
        self.num_pages, self.page_bytes = self._pool.num_pages, self._pool.page_bytes
        self.capacity_bytes = self.num_pages * self.page_bytes
        self._allocator = PageAllocator(self.num_pages)
        self._entries: OrderedDict[bytes, PagedEntry] = OrderedDict()
        self._stats = TierStats(name=name, capacity_bytes=self.capacity_bytes)
        self._reserved: set[tuple[int, ...]] = set()  # pages being written in place, in no entry yet
        # Pins are taken under the store's lock and released from other threads (the disk writer):
        # this lock guards the pin counts and the hand-over of pages freed while pinned.
        self._pin_lock = threading.Lock()
        self._pins: dict[tuple[int, ...], int] = {}
        self._deferred: set[tuple[int, ...]] = set()  # pages of removed blocks, still pinned
        self._returned: deque[tuple[int, ...]] = deque()  # released since: freed at the next allocation
        self._held_pages = 0  # pages in _deferred and _returned (read on every eviction step: kept, not summed)

    # Hooks for subclasses; the base tier needs none of them.
    def _begin_write(self, pages: Sequence[int]) -> None:
        pass

    def _end_write(self, pages: Sequence[int]) -> None:
        pass

    def _on_free(self, pages: Sequence[int]) -> None:
        pass

    def _entry(self, key: bytes) -> PagedEntry:
        entry = self._entries.get(key)
        if entry is None:
            self._stats.misses += 1
            raise NotFound(f"block {key.hex()} is not in the {self.name} tier")
        self._stats.hits += 1
        self._entries.move_to_end(key)
        return entry

    def contains(self, key: bytes) -> bool:
        return key in self._entries

    def _read(self, entry: PagedEntry) -> torch.Tensor:
        """The block's bytes as a new contiguous tensor on the pool's device."""
        out = torch.empty(entry.meta.nbytes, dtype=torch.uint8, device=self._pool.device)
        self._pool.gather(entry.pages, out, entry.index)
        return out

    def get(self, key: bytes) -> Block:
        entry = self._entry(key)
        payload = self._read(entry)
        return Block(entry.meta, payload if payload.device.type == "cpu" else payload.cpu())

    def put(self, block: Block) -> bool:
        meta = block.meta
        if meta.key in self._entries:
            return False
        src = payload_bytes(block.payload)
        if src.numel() != meta.nbytes:
            raise InvalidArgument(f"payload is {src.numel()} bytes but meta.nbytes is {meta.nbytes}")
        pages = self._alloc(meta.nbytes)
        index = self._pool.full_page_index(pages, meta.nbytes)
        self._begin_write(pages)
        try:
            self._pool.scatter(pages, src, index)
        except BaseException:
            self._on_free(pages)
            self._allocator.free(pages)
            raise
        finally:
            self._end_write(pages)
        self._entries[meta.key] = PagedEntry(meta, tuple(pages), index)
        self._stats.puts += 1
        return True

    @property
    def held_bytes(self) -> int:
        """Bytes of removed blocks' pages that a reader outside the store's lock (the disk writer)
        still holds, or released and not yet returned: used, but free once reclaimed."""
        return self._held_pages * self.page_bytes

    def reclaim(self) -> None:
        """Return the pages released since the last allocation to the free list now."""
        while self._returned:
            pages = self._returned.popleft()
            with self._pin_lock:
                self._held_pages -= len(pages)
            self._allocator.free(list(pages))

    def _alloc(self, nbytes: int) -> list[int]:
        """Pages for nbytes (pages released since the last call returned to the free list first);
        CapacityExceeded when too few are free."""
        self.reclaim()
        pages = self._allocator.alloc(pages_for(nbytes, self.page_bytes))
        if pages is None:
            raise CapacityExceeded(
                f"{self.name} tier full: block needs bytes={pages_for(nbytes, self.page_bytes) * self.page_bytes}, "
                f"free bytes={self._allocator.num_free * self.page_bytes} of {self.capacity_bytes}")
        return pages

    def _drop(self, key: bytes) -> bool:
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self._on_free(entry.pages)
        with self._pin_lock:
            if entry.pages in self._pins:  # read elsewhere right now: freed at its release
                self._deferred.add(entry.pages)
                self._held_pages += len(entry.pages)
                return True
        self._allocator.free(list(entry.pages))
        return True

    # ---- room written in place, pages read outside the store's lock ------------------------------

    def reserve(self, nbytes: int) -> tuple[int, ...]:
        """Pages for a block of nbytes that a caller writes in place, then adopt()s (or unreserve()s):
        marked as being written, in no entry, so no reader sees them. Raises CapacityExceeded."""
        pages = tuple(self._alloc(nbytes))
        self._begin_write(pages)
        self._reserved.add(pages)
        return pages

    def unreserve(self, pages: tuple[int, ...]) -> None:
        """Give reserved pages back unused. KeyError if they are not reserved."""
        self._reserved.remove(pages)
        self._end_write(pages)
        self._on_free(pages)
        self._allocator.free(list(pages))

    def adopt(self, meta: BlockMeta, pages: tuple[int, ...]) -> bool:
        """Make reserved `pages`, which hold its bytes, the block `meta` (most recently used). False,
        changing nothing, when the key is present already; InvalidArgument when the pages do not fit
        meta.nbytes; KeyError if they are not reserved."""
        if meta.key in self._entries:
            return False
        if len(pages) != pages_for(meta.nbytes, self.page_bytes):
            raise InvalidArgument(f"{len(pages)} pages for a block of {meta.nbytes} bytes")
        self._reserved.remove(pages)
        self._end_write(pages)
        self._entries[meta.key] = PagedEntry(meta, pages, self._pool.full_page_index(pages, meta.nbytes))
        self._stats.puts += 1
        return True

    def pin(self, key: bytes) -> Callable[[], None]:
        """Keep the block's pages from reuse until the returned release is called (once, from any
        thread), even if the block is removed meanwhile. NotFound if absent."""
        entry = self._entries.get(key)
        if entry is None:
            raise NotFound(f"block {key.hex()} is not in the {self.name} tier")
        with self._pin_lock:
            self._pins[entry.pages] = self._pins.get(entry.pages, 0) + 1
        return _Release(self._unpin, entry.pages)

    def _unpin(self, pages: tuple[int, ...]) -> None:
        with self._pin_lock:
            left = self._pins[pages] - 1
            if left:
                self._pins[pages] = left
                return
            del self._pins[pages]
            if pages in self._deferred:
                self._deferred.discard(pages)
                self._returned.append(pages)

    def remove(self, key: bytes) -> bool:
        dropped = self._drop(key)
        self._stats.removals += dropped
        return dropped

    def evict(self, key: bytes) -> bool:
        dropped = self._drop(key)
        self._stats.evictions += dropped
        return dropped

    def touch(self, key: bytes) -> None:
        if key in self._entries:
            self._entries.move_to_end(key)

    def touch_many(self, keys: Sequence[bytes]) -> None:
        entries = self._entries
        for key in keys:
            if key in entries:
                entries.move_to_end(key)

    def lru_keys(self) -> Iterator[bytes]:
        return iter(list(self._entries))

    def metas(self) -> Iterator[BlockMeta]:
        return iter([entry.meta for entry in self._entries.values()])

    def cost_bytes(self, meta: BlockMeta) -> int:
        return pages_for(meta.nbytes, self.page_bytes) * self.page_bytes

    @property
    def used_bytes(self) -> int:
        return self._allocator.num_used * self.page_bytes

    def stats(self) -> TierStats:
        # used_bytes counts whole pages, so it compares with capacity_bytes and the watermarks.
        return replace(self._stats, used_bytes=self.used_bytes, num_blocks=len(self._entries))

    def check_integrity(self) -> None:
        self._allocator.check_integrity()
        seen: set[int] = set()
        for key, entry in self._entries.items():
            assert key == entry.meta.key, f"entry under {key.hex()} holds block {entry.meta.key.hex()}"
            assert len(entry.pages) == pages_for(entry.meta.nbytes, self.page_bytes), \
                f"block {key.hex()} has {len(entry.pages)} pages for {entry.meta.nbytes} bytes"
            assert seen.isdisjoint(entry.pages), f"block {key.hex()} shares a page with another block"
            kept = None if entry.index is None else entry.index.tolist()
            expected = self._pool.full_page_index(entry.pages, entry.meta.nbytes)
            assert kept == (None if expected is None else expected.tolist()), f"block {key.hex()}: stale index"
            seen.update(entry.pages)
        with self._pin_lock:
            held = [*self._reserved, *self._deferred, *self._returned]
            counted = self._held_pages
        assert counted == sum(len(p) for p in held) - sum(len(p) for p in self._reserved), \
            f"held pages counted {counted}, pinned or returned {sum(len(p) for p in held)}"
        for pages in held:
            assert seen.isdisjoint(pages), f"pages {list(pages)} are both a block's and reserved or pinned"
            seen.update(pages)
        # PageAllocator has no public view of its used set; reading it here keeps the check exact.
        assert seen == self._allocator._used, "used pages differ from the union of the blocks' pages"
        assert self.used_bytes == len(seen) * self.page_bytes


class _Release:
    """A pin's release (PagedTier.pin): calls unpin(pages) the first time it is called, then nothing."""

    __slots__ = ("_pages", "_unpin")

    def __init__(self, unpin: Callable[[tuple[int, ...]], None], pages: tuple[int, ...]) -> None:
        self._unpin: Callable[[tuple[int, ...]], None] | None = unpin
        self._pages = pages

    def __call__(self) -> None:
        unpin, self._unpin = self._unpin, None  # two threads calling at once: one of them gets it
        if unpin is not None:
            unpin(self._pages)
