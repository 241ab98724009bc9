"""Record types the TieredStore returns (re-exported by tiercache.store)."""

from __future__ import annotations

from dataclasses import dataclass

from tiercache.block import Block, BlockMeta


@dataclass(frozen=True)
class HostLocation:
    """Where a block lies in the shared host slab, for same-host readers (see tiers/host.py).

    When the block could not be placed in the host tier (it is full of pinned data), `pages` is
    empty and `block` carries the bytes instead.
    """

    meta: BlockMeta
    pages: tuple[int, ...]
    generations: tuple[int, ...]
    block: Block | None = None


@dataclass(frozen=True)
class EntryInfo:
    """One block as List and the admin CLI show it."""

    meta: BlockMeta
    tiers: tuple[str, ...]
    hits: int
    last_access: float  # unix seconds
    pinned: bool
    expires_at: float  # unix seconds, 0 = never
    pin_expires_at: float = 0.0  # when the pin lapses, unix seconds; 0: until unpinned (or not pinned)


@dataclass(frozen=True)
class VerifyReport:
    checked: int
    failed: int
    dropped_keys: tuple[bytes, ...]
