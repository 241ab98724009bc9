"""The one interface every tier implements, and the typed extensions of the host and disk tiers."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager

import torch

from tiercache.block import Block, BlockMeta, TierStats


class Tier(ABC):
    """One storage tier. A tier stores opaque blocks under 32-byte keys and keeps their LRU order.

    A tier is not thread-safe by itself: the TieredStore serialises calls with its lock.
    Policy (which tier, when to demote, pins, TTLs) lives in the store, never here.
    """

    name: str
    capacity_bytes: int
    # Whether get() verifies what it returns (dropping, counting and raising CorruptBlock for a
    # damaged copy) so that the store need not checksum it again: the disk tier checks every record.
    verifies_reads: bool = False

    @abstractmethod
    def contains(self, key: bytes) -> bool:
        """Whether the block is stored here. Does not mutate, does not touch LRU order."""

    @abstractmethod
    def get(self, key: bytes) -> Block:
        """Return a copy of the block (payload on CPU unless the tier says otherwise) and mark it
        most recently used. Raises NotFound if absent; CorruptBlock if it fails verification, in
        which case the tier has already dropped it and counted the failure."""

    @abstractmethod
    def put(self, block: Block) -> bool:
        """Store the block as most recently used. Returns False, changing nothing, if the key is
        already present. Raises CapacityExceeded, changing nothing, if there is no room (the store
        evicts first), InvalidArgument if the payload length differs from meta.nbytes."""

    @abstractmethod
    def remove(self, key: bytes) -> bool:
        """Delete the block (an admin flush or a replacement). Returns whether it was present."""

    @abstractmethod
    def evict(self, key: bytes) -> bool:
        """Delete the block to make room, counted as an eviction. Returns whether it was present."""

    @abstractmethod
    def touch(self, key: bytes) -> None:
        """Mark the block most recently used; no-op if absent."""

    def touch_many(self, keys: Sequence[bytes]) -> None:
        """touch() each key in order (the last ends most recently used); tiers may do it in one go."""
        for key in keys:
            self.touch(key)

    @abstractmethod
    def lru_keys(self) -> Iterator[bytes]:
        """Keys from least to most recently used (a snapshot; safe to mutate the tier while iterating)."""

    @abstractmethod
    def metas(self) -> Iterator[BlockMeta]:
        """The metadata of every stored block (a snapshot), in no particular order."""

    @abstractmethod
    def cost_bytes(self, meta: BlockMeta) -> int:
        """Bytes of capacity this block would take here (pages rounded up, records on disk)."""

    @property
    @abstractmethod
    def used_bytes(self) -> int:
        """Capacity bytes in use, comparable with capacity_bytes and cost_bytes."""

    @abstractmethod
    def stats(self) -> TierStats:
        """A snapshot of the tier's counters."""

    @abstractmethod
    def check_integrity(self) -> None:
        """Raise AssertionError if any internal invariant is broken (page accounting, index vs data)."""

    @abstractmethod
    def close(self) -> None:
        """Release memory, files and threads. Idempotent."""


Attrs = Mapping[str, float]  # the store's per-block attributes a durable tier keeps (hits, last access, TTL, pin)


class SharedMemoryTier(Tier):
    """A tier whose pages same-host readers map and read in place (the host tier's slab), with a
    shared index that says where each block lives and a presence filter of every key the store holds."""

    page_bytes: int

    @abstractmethod
    def payload_view(self, pages: Sequence[int], nbytes: int) -> torch.Tensor:
        """The bytes of the block in `pages`: a view of the slab when they are one run, else a copy.
        Takes no lock: valid only while the pages are not reused."""

    @abstractmethod
    def locate(self, key: bytes) -> tuple[list[int], list[int]]:
        """The block's pages and their current (even) generations, for a reader in another process.
        Does not mutate. Raises NotFound if absent."""

    @abstractmethod
    def note_presence(self, key: bytes, delta: int, *, expires: bool) -> None:
        """The store gained (+1) or lost (-1) `key` in any tier. A block that `expires` (it has a TTL)
        is never published to readers: only the daemon can tell that it expired."""

    @property
    @abstractmethod
    def held_bytes(self) -> int:
        """Bytes of removed blocks' pages still held by a reader outside the store's lock (the disk
        writer reading a new block in place): counted in used_bytes until reclaim()ed."""

    @abstractmethod
    def reclaim(self) -> None:
        """Make the pages that readers have released since free now."""

    @abstractmethod
    def reserve(self, nbytes: int) -> tuple[int, ...]:
        """Pages for a block of nbytes that a caller in another process writes in place, then adopt()s
        (or unreserve()s): unpublished and marked as being written. Raises CapacityExceeded."""

    @abstractmethod
    def unreserve(self, pages: tuple[int, ...]) -> None:
        """Give reserved pages back unused."""

    @abstractmethod
    def adopt(self, meta: BlockMeta, pages: tuple[int, ...]) -> bool:
        """Make reserved pages, which hold its bytes, the block `meta`, published to readers. False,
        changing nothing, when the key is present already."""

    @abstractmethod
    def checksums(self, blocks: Sequence[tuple[tuple[int, ...], int]]) -> list[int]:
        """The checksum of each block given as (pages, nbytes), hashed where it lies (no lock taken:
        for pages nobody else writes, a reservation's)."""

    @abstractmethod
    def pinned_view(self, key: bytes) -> tuple[torch.Tensor, Callable[[], None]]:
        """The block's bytes for a reader outside the store's lock, and the release it calls when
        done (from any thread): until then the block's pages are not reused, even if it is removed."""

    @abstractmethod
    def mark_every_key_present(self) -> None:
        """Make the presence filter say "maybe" for every key, for good: readers then ask the daemon
        about every key their own read of the index misses (a remote tier only the daemon reaches)."""


class DurableTier(Tier):
    """A tier that survives restarts: it keeps the store's attributes of each block beside it, hands
    them back at open, and writes through a queue that flush() drains."""

    write_failures: int  # blocks dropped because their queued write failed (the store forgets them)

    @abstractmethod
    def put(self, block: Block, attrs: Attrs | None = None, release: Callable[[], None] | None = None) -> bool:
        """Tier.put, keeping `attrs` (the store's attributes of the block) with it. The payload is read
        until its write is done (or dropped); `release` is called then, once, from the writer's thread
        (a view of memory the caller keeps from reuse until then)."""

    @abstractmethod
    def put_many(self, items: Sequence[tuple[Block, Attrs | None, Callable[[], None] | None]]) -> list[bool]:
        """put() of each (block, attrs, release) in order, queued as one batch; at the first that
        raises, the rest are released and not queued, and the error is raised."""

    @abstractmethod
    def records(self) -> Iterator[tuple[BlockMeta, dict[str, float]]]:
        """Every stored block's meta and attributes (a snapshot), to rebuild the store's index at open."""

    @abstractmethod
    def set_attrs(self, key: bytes, attrs: Attrs) -> None:
        """Merge `attrs` into the block's kept attributes (durable after flush()). NotFound if absent."""

    @abstractmethod
    def flush(self, timeout_s: float | None = None) -> None:
        """Wait until every queued write is committed; DeadlineExceeded after timeout_s."""

    @abstractmethod
    def check(self, key: bytes) -> int:
        """Read the committed block `key` and verify it, changing nothing (no hit, no LRU move, no
        drop): the bytes read, 0 when the key is absent or its write is still queued. Raises
        CorruptBlock when the block is damaged; the caller drops it (Tier.get does that on the read
        path)."""

    @abstractmethod
    def snapshot_reads(self) -> AbstractContextManager[None]:
        """Within the block, get() may return views valid only until it exits (a chain read in one
        transaction): the caller copies what it keeps."""
