"""The calls an engine integration makes on the daemon, as a Protocol that Client and the benchmarks'
baselines satisfy."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from tiercache.block import Block, BlockMeta, PutResult
from tiercache.keys import Namespace

if TYPE_CHECKING:
    from tiercache.client.core import Client


class Fetched(Protocol):
    """The blocks of one fetch, in chain order (the cached prefix of the keys asked for).

    Blocks may be read-only views into memory their owner may recycle: read them (copy them where
    they are needed), then call still_valid(). False means something changed under a view meanwhile,
    so what was read may be another block's bytes: discard it and fetch copies instead."""

    def __iter__(self) -> Iterator[Block]: ...

    def __len__(self) -> int: ...

    def still_valid(self) -> bool: ...


class Copies(list[Block]):
    """Fetched blocks in the caller's own memory: nothing can recycle them, so still_valid() is always True."""

    def still_valid(self) -> bool:
        return True


@runtime_checkable
class CacheClient(Protocol):
    """What the worker (and any engine integration) calls on a daemon client. Every call may raise
    TierCacheError, OSError, or ValueError (a closed channel); best_effort.DAEMON_ERRORS names them."""

    def lookup(self, keys: Sequence[bytes], *, probe: bool = False, holes: bool = False) -> list[str]:
        """Tier of each block of the longest cached prefix of `keys` (no change but the daemon's LRU);
        `probe`: a writer's check whether a block is stored already, left out of the lookup statistics;
        `holes`: every key's tier up to the last cached one, "" where a block is missing."""
        ...

    def fetch(self, keys: Sequence[bytes]) -> Sequence[Block]:
        """The verified blocks of the longest cached prefix of `keys`, copies the caller owns."""
        ...

    def fetch_views(self, keys: Sequence[bytes]) -> Fetched:
        """fetch(), but blocks may be views without a copy: check still_valid() after reading them."""
        ...

    def put(self, blocks: Sequence[Block], *, namespace: Namespace | None = None) -> object:
        """Store blocks (a present key is a no-op); `namespace` describes them for the admin CLI."""
        ...

    def pin(self, keys: Sequence[bytes], ttl_s: float | None = None) -> int:
        """Keep the cached prefix of `keys` from eviction for ttl_s (None: until unpinned); how many blocks."""
        ...

    def report(self, *, prompt_tokens: int, cached_tokens: int, ttft_s: float, prefill_s: float) -> None:
        """Add one request's figures to the daemon's metrics."""
        ...

    def close(self) -> None:
        """Release the connection; the client is not used after."""
        ...


class Room(Protocol):
    """Room a daemon holds for a chain of blocks until commit() or release() (Client.reserve)."""

    def __len__(self) -> int: ...

    def present(self, i: int) -> bool:
        """Whether block i was stored already: no room, nothing to write."""
        ...

    def tensor(self, i: int) -> torch.Tensor | None:
        """Block i's room as a canonical block tensor to write, or None (present, or in several runs)."""
        ...

    def fill(self, i: int, sources: Sequence[torch.Tensor]) -> None:
        """Copy the bytes of `sources`, in order, into block i's room."""
        ...

    def commit(self, *, ttl_s: float | None = None, pin: bool = False, durable: bool = False) -> list[PutResult]:
        """Store the blocks as written; one result per block."""
        ...

    def release(self) -> None:
        """Give the room back unused."""
        ...


@runtime_checkable
class ReservingClient(CacheClient, Protocol):
    """A client that can also put in place: reserve room in the daemon's memory, write the blocks
    there, commit (one copy: the caller's own). `puts_in_place` says whether that works from here
    (a same-host caller that may write the daemon's slab, and a daemon that offers it)."""

    @property
    def puts_in_place(self) -> bool: ...

    def reserve(self, metas: Sequence[BlockMeta], *, namespace: Namespace | None = None,
                lease_s: float = 0.0) -> Room:
        """Room for each block of `metas` not stored yet (their checksums ignored)."""
        ...


if TYPE_CHECKING:  # mypy checks that the client satisfies the Protocols; nothing runs
    def _client_is_a_cache_client(client: Client) -> CacheClient:
        return client

    def _client_is_a_reserving_client(client: Client) -> ReservingClient:
        return client
