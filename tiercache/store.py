"""The TieredStore: index, LRU per tier, write policies, promotion, demotion, pins and TTLs."""

from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from tiercache.tiers.base import Block, BlockMeta, TierStats


class PutResult(enum.Enum):
    STORED = "stored"
    ALREADY_PRESENT = "already_present"


@dataclass(frozen=True)
class HostLocation:
    """Where a block lies in the shared host slab, for same-host readers (see tiers/host.py)."""

    meta: BlockMeta
    pages: tuple[int, ...]
    generations: tuple[int, ...]


@dataclass(frozen=True)
class EntryInfo:
    """One block as List and the admin CLI show it."""

    meta: BlockMeta
    tiers: tuple[str, ...]
    hits: int
    last_access: float  # unix seconds
    pinned: bool
    expires_at: float  # unix seconds, 0 = never


@dataclass(frozen=True)
class VerifyReport:
    checked: int
    failed: int
    dropped_keys: tuple[bytes, ...]


class TieredStore:
    """API sketch; the implementation replaces this file."""

    def lookup(self, keys: Sequence[bytes]) -> list[str]:
        """Tier name ("gpu", "host", "disk") of each block of the longest present prefix of `keys`."""
        raise NotImplementedError

    def get(self, key: bytes) -> Block:
        """The block from its fastest tier, promoting per policy. NotFound / CorruptBlock."""
        raise NotImplementedError

    def fetch(self, keys: Sequence[bytes]) -> Iterator[Block]:
        """Blocks of keys in order, stopping at the first miss (or a block that fails verification)."""
        raise NotImplementedError

    def put(self, block: Block, *, ttl_s: float | None = None, pin: bool = False) -> PutResult:
        raise NotImplementedError

    def put_many(self, blocks: Sequence[Block], *, ttl_s: float | None = None) -> list[PutResult]:
        raise NotImplementedError

    def locate_host(self, keys: Sequence[bytes]) -> list[HostLocation]:
        raise NotImplementedError

    def prefetch(self, keys: Sequence[bytes]) -> int:
        raise NotImplementedError

    def pin(self, keys: Sequence[bytes], ttl_s: float | None = None) -> int:
        raise NotImplementedError

    def unpin(self, keys: Sequence[bytes]) -> int:
        raise NotImplementedError

    def remove(self, keys: Sequence[bytes]) -> int:
        raise NotImplementedError

    def flush(self, *, tier: str | None = None, namespace: bytes | None = None, tenant: str | None = None) -> int:
        raise NotImplementedError

    def verify(self, *, tenant: str | None = None) -> VerifyReport:
        raise NotImplementedError

    def entries(self, *, namespace: bytes | None = None, tenant: str | None = None) -> list[EntryInfo]:
        raise NotImplementedError

    def tier_stats(self) -> list[TierStats]:
        raise NotImplementedError

    def expire(self) -> int:
        raise NotImplementedError

    def check_integrity(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError
