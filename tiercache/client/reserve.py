"""Puts in place: room reserved in the daemon's slab, written by the caller, committed (Reserve, Commit)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from types import TracebackType

import numpy as np
import torch

from tiercache.block import BlockMeta, PutResult
from tiercache.errors import InvalidArgument, TierCacheError
from tiercache.layout import dtype_of
from tiercache.samehost.writer import SlabWriter, fill
from tiercache.v1 import tiercache_pb2 as pb

logger = logging.getLogger(__name__)

PUT_RESULTS = {pb.PUT_RESULT_STORED: PutResult.STORED, pb.PUT_RESULT_ALREADY_PRESENT: PutResult.ALREADY_PRESENT}


class SlabWriters:
    """This client's read-write map of the daemon's slab, opened when first needed and replaced when
    the daemon restarts with another slab. `usable` turns False when the slab cannot be opened for
    writing (another user, a read-only mount): puts then go another way."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._writer: SlabWriter | None = None
        self.usable = True

    def writer(self, path: str) -> SlabWriter:
        with self._lock:
            if self._writer is not None and self._writer.path == path:
                return self._writer
            old, self._writer = self._writer, None
            if old is not None:
                old.close()
            try:
                self._writer = SlabWriter(path)
            except (TierCacheError, OSError) as e:
                self.usable = False
                logger.warning("cannot map the daemon's slab %s for writing (%s); putting blocks another way",
                               path, e)
                raise InvalidArgument(f"the daemon's slab {path} cannot be mapped for writing: {e}") from None
            return self._writer

    def close(self) -> None:
        with self._lock:
            writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()


class Reservation:
    """Room the daemon holds in its slab for a chain of blocks (Client.reserve), until commit() or
    release(), or its lease (`lease_s` from the reply) runs out. Write each block's payload in place,
    in its canonical layout: `tensor(i)` is the block as a [layers, 2, heads, tokens, head_dim] tensor
    of its dtype when its pages are one run (write it, e.g. copy_ a gather into it); `runs(i)` the raw
    byte runs in any case; `fill(i, sources)` copies tensors' bytes in order. A block stored already
    has no room (`present(i)`). As a context manager it releases the room unless committed."""

    def __init__(self, metas: Sequence[BlockMeta], reply: pb.ReserveResponse, writer: SlabWriter,
                 commit: Callable[[pb.CommitRequest], pb.PutResponse],
                 release: Callable[[pb.ReleaseRequest], pb.ReleaseResponse]) -> None:
        if len(reply.blocks) != len(metas):
            raise TierCacheError(f"the daemon reserved room for {len(reply.blocks)} blocks of {len(metas)}")
        self.metas = list(metas)
        self.id = reply.reservation
        self.lease_s = reply.lease_s
        self._pages = [list(b.pages) for b in reply.blocks]
        self._writer = writer
        self._commit, self._release = commit, release
        self._done = False

    def __len__(self) -> int:
        return len(self.metas)

    def present(self, i: int) -> bool:
        """Whether block i was stored already (no room for it: nothing to write)."""
        return not self._pages[i]

    def runs(self, i: int) -> list[np.ndarray]:
        """Block i's room as writable uint8 arrays, in payload order ([] when present)."""
        if not self._pages[i]:
            return []
        return self._writer.runs(self._pages[i], self.metas[i].nbytes)

    def tensor(self, i: int) -> torch.Tensor | None:
        """Block i's room as a tensor of its canonical shape and dtype, when its pages are one run
        (the usual case); None when present or in several runs (then use runs() or fill())."""
        runs = self.runs(i)
        if len(runs) != 1:
            return None
        meta = self.metas[i]
        return torch.from_numpy(runs[0]).view(dtype_of(meta.dtype)).view(meta.shape)

    def fill(self, i: int, sources: Sequence[torch.Tensor]) -> None:
        """Copy the bytes of `sources` one after the other into block i's room (InvalidArgument
        unless they add up to its nbytes); nothing for a block present already."""
        if self._pages[i]:
            fill(self.runs(i), sources)

    def commit(self, *, ttl_s: float | None = None, pin: bool = False, durable: bool = False) -> list[PutResult]:
        """Store the blocks as written (the daemon hashes them where they lie); one result per block.
        Write nothing into their room afterwards: the daemon would find them damaged."""
        if self._done:
            raise InvalidArgument(f"reservation {self.id} was committed or released already")
        self._done = True
        reply = self._commit(pb.CommitRequest(reservation=self.id, ttl_s=ttl_s or 0.0, pin=pin, durable=durable))
        if len(reply.results) != len(self.metas):
            raise TierCacheError(f"the daemon answered {len(reply.results)} results for {len(self.metas)} blocks")
        return [PUT_RESULTS[r] for r in reply.results]

    def release(self) -> None:
        """Give the room back unused (best effort: a room not released lapses anyway)."""
        if self._done:
            return
        self._done = True
        try:
            self._release(pb.ReleaseRequest(reservation=self.id))
        except TierCacheError as e:
            logger.debug("release of reservation %d failed (it lapses): %s", self.id, e)

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        if not self._done:
            self.release()
