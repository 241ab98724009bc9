"""Page, index and LRU bookkeeping shared by the pooled tiers (gpu, host); they own the pool tensor."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterator, Sequence
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
      - the union of the entries' pages is exactly the allocator's used set
      - used_bytes == used pages * page_bytes
    `_entries` is ordered from least to most recently used.

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
        pages = self._allocator.alloc(pages_for(meta.nbytes, self.page_bytes))
        if pages is None:
            raise CapacityExceeded(
                f"{self.name} tier full: block needs bytes={self.cost_bytes(meta)}, "
                f"free bytes={self._allocator.num_free * self.page_bytes} of {self.capacity_bytes}")
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

    def _drop(self, key: bytes) -> bool:
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self._on_free(entry.pages)
        self._allocator.free(list(entry.pages))
        return True

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
        # PageAllocator has no public view of its used set; reading it here keeps the check exact.
        assert seen == self._allocator._used, "used pages differ from the union of the blocks' pages"
        assert self.used_bytes == len(seen) * self.page_bytes
