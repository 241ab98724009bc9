"""The one interface every tier implements, and the block types that pass through it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field

import torch

from tiercache.errors import InvalidArgument
from tiercache.keys import KEY_BYTES


@dataclass(frozen=True)
class BlockMeta:
    """What the store knows about one block besides its bytes.

    `key` is the store's key (already scoped to the tenant by the server), `namespace` the 32-byte
    namespace digest, `checksum` the XXH3-64 of the raw (uncompressed) payload bytes, `nbytes` their
    count. `parent` is the key of the previous block in the chain (b"" for the first block).
    """

    key: bytes
    namespace: bytes
    num_tokens: int
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    checksum: int
    parent: bytes = b""
    tenant: str = ""
    preview: str = ""

    def __post_init__(self) -> None:
        if len(self.key) != KEY_BYTES:
            raise InvalidArgument(f"block key must be {KEY_BYTES} bytes, got {len(self.key)}")
        if len(self.namespace) != KEY_BYTES:
            raise InvalidArgument(f"namespace digest must be {KEY_BYTES} bytes, got {len(self.namespace)}")
        if self.parent and len(self.parent) != KEY_BYTES:
            raise InvalidArgument(f"parent key must be empty or {KEY_BYTES} bytes, got {len(self.parent)}")
        if self.nbytes < 0 or self.num_tokens < 0:
            raise InvalidArgument(f"nbytes and num_tokens must be >= 0, got {self.nbytes}, {self.num_tokens}")

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(key=self.key.hex(), namespace=self.namespace.hex(), parent=self.parent.hex(), shape=list(self.shape))
        return d

    @classmethod
    def checked_already(cls, key: bytes, namespace: bytes, num_tokens: int, dtype: str, shape: tuple[int, ...],
                        nbytes: int, checksum: int, parent: bytes, preview: str = "") -> BlockMeta:
        """A meta from fields that cannot fail __post_init__'s checks (32-byte keys, unsigned counts:
        a slot of the shared index, a verified record's meta under other 32-byte keys), made without
        them: a quarter of the cost, which counts when a worker's read of a chain makes a meta per block."""
        meta = object.__new__(cls)
        meta.__dict__.update(key=key, namespace=namespace, num_tokens=num_tokens, dtype=dtype, shape=shape,
                             nbytes=nbytes, checksum=checksum, parent=parent, tenant="", preview=preview)
        return meta

    @classmethod
    def from_dict(cls, d: dict) -> BlockMeta:
        return cls(
            key=bytes.fromhex(d["key"]), namespace=bytes.fromhex(d["namespace"]), num_tokens=int(d["num_tokens"]),
            dtype=str(d["dtype"]), shape=tuple(int(x) for x in d["shape"]), nbytes=int(d["nbytes"]),
            checksum=int(d["checksum"]), parent=bytes.fromhex(d.get("parent", "")), tenant=str(d.get("tenant", "")),
            preview=str(d.get("preview", "")),
        )


@dataclass(frozen=True)
class Block:
    """A block's metadata and its raw payload: a contiguous 1-D uint8 tensor of meta.nbytes bytes."""

    meta: BlockMeta
    payload: torch.Tensor = field(repr=False)


@dataclass
class TierStats:
    """Counters of one tier; used_bytes is capacity in use (whole pages; disk: stored record bytes)."""

    name: str
    capacity_bytes: int
    used_bytes: int = 0
    num_blocks: int = 0
    hits: int = 0
    misses: int = 0
    puts: int = 0
    evictions: int = 0
    removals: int = 0
    verification_failures: int = 0


class Tier(ABC):
    """One storage tier. A tier stores opaque blocks under 32-byte keys and keeps their LRU order.

    A tier is not thread-safe by itself: the TieredStore serialises calls with its lock.
    Policy (which tier, when to demote, pins, TTLs) lives in the store, never here.
    """

    name: str
    capacity_bytes: int

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

    def close(self) -> None:
        """Release memory, files and threads. Idempotent."""
