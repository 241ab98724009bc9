"""The host tier: blocks in fixed-size pages of one shared-memory slab (samehost/slab.py) that
same-host workers map read-only, published in the shared index (samehost/index.py)."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import secrets
from collections.abc import Callable, Sequence

import torch

from tiercache.block import Block, BlockMeta
from tiercache.config import HostConfig
from tiercache.errors import InvalidArgument, NotFound
from tiercache.layout import checksum, xxh3_64_intdigest
from tiercache.page_pool import is_run
from tiercache.samehost.index import HostIndex, index_size
from tiercache.samehost.slab import (
    HEADER,
    MAGIC,
    VERSION,
    create_slab,
    header_bytes_for,
    remove_orphan_slabs,
    slab_views,
)
from tiercache.tiers.base import SharedMemoryTier
from tiercache.tiers.paged import PagedTier

logger = logging.getLogger(__name__)


class HostTier(PagedTier, SharedMemoryTier):
    """The shared-memory CPU pool; see samehost/slab.py for the slab layout and the seqlock.

    Besides PagedTier's invariants: every used page has an even generation between calls.
    """

    def __init__(self, cfg: HostConfig, *, slab_name: str | None = None) -> None:
        num_pages = cfg.capacity_bytes // cfg.page_bytes
        if num_pages < 1 or cfg.page_bytes % 8:
            raise InvalidArgument(f"host tier needs >= 1 page of a multiple of 8 bytes, got "
                                  f"capacity_bytes={cfg.capacity_bytes} page_bytes={cfg.page_bytes}")
        # The pid lets a later daemon recognise slabs left behind by one that died.
        name = slab_name or f"tiercache-{os.getpid()}-{secrets.token_hex(6)}.slab"
        if os.path.basename(name) != name or name in ("", ".", ".."):
            raise InvalidArgument(f"slab_name must be a plain file name, got {name!r}")
        path = os.path.join(cfg.shm_dir, name)
        remove_orphan_slabs(cfg.shm_dir)
        header_bytes = header_bytes_for(num_pages)
        size = header_bytes + num_pages * cfg.page_bytes
        self._mmap = create_slab(path, size)
        self._path = path
        self._index_path = path.removesuffix(".slab") + ".index"
        try:
            self._index_buf = create_slab(self._index_path, index_size(num_pages)[1])
            # Held for the daemon's life: readers tell a live daemon from a dead one by this lock,
            # which the kernel drops with the process, whatever pid namespace either runs in.
            self._index_lock = os.open(self._index_path, os.O_RDONLY)
            fcntl.flock(self._index_lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BaseException:
            self._mmap.close()
            for created in (path, self._index_path):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(created)
            raise
        self._index = HostIndex(self._index_buf, num_pages)
        self._closed = False
        self._generations, pool = slab_views(self._mmap, cfg.page_bytes, num_pages)
        pool.zero_()  # fault every page in now, so no request pays for it (the header is written below)
        super().__init__("host", pool)
        self.header_bytes = header_bytes
        HEADER.pack_into(self._mmap, 0, b"\0" * 8, VERSION, 0, cfg.page_bytes, num_pages, header_bytes)
        self._mmap[:8] = MAGIC  # last, so a reader never validates a half-written header
        self._pinned = _cuda_register(self._mmap)
        logger.info("host slab %s: pages=%d page_bytes=%d bytes=%d pinned=%s",
                    path, num_pages, cfg.page_bytes, size, self._pinned)

    @property
    def slab_path(self) -> str:
        return self._path

    @property
    def index_path(self) -> str:
        return self._index_path

    def note_presence(self, key: bytes, delta: int, *, expires: bool) -> None:
        self._index.present(key, delta)
        if delta > 0 and expires:
            self._index.withhold(key)
        elif delta < 0:
            self._index.release(key)

    def mark_every_key_present(self) -> None:
        self._index.saturate_presence()

    def put(self, block: Block) -> bool:
        stored = super().put(block)
        if stored:  # published once its pages hold it (generations even again)
            self._index.publish(block.meta, self._entries[block.meta.key].pages)
        return stored

    def adopt(self, meta: BlockMeta, pages: tuple[int, ...]) -> bool:
        stored = super().adopt(meta, pages)
        if stored:  # published once its pages are the block's (generations even again)
            self._index.publish(meta, pages)
        return stored

    def _drop(self, key: bytes) -> bool:
        self._index.unpublish(key)  # before its pages are freed: see samehost/index.py
        return super()._drop(key)

    def checksums(self, blocks: Sequence[tuple[tuple[int, ...], int]]) -> list[int]:
        """The checksum (layout.checksum) of each block given as (pages, nbytes), hashed where it lies
        in the slab (a block in several runs is gathered first). Takes no lock: for pages that nobody
        else writes (a reservation's)."""
        flat, page_bytes = self._pool.flat.numpy(), self.page_bytes
        sums = []
        for pages, nbytes in blocks:
            if is_run(pages):
                start = pages[0] * page_bytes
                sums.append(xxh3_64_intdigest(flat[start : start + nbytes]))
            else:
                sums.append(checksum(self.payload_view(pages, nbytes)))
        return sums

    def pinned_view(self, key: bytes) -> tuple[torch.Tensor, Callable[[], None]]:
        """The block's bytes for a reader outside the store's lock (the disk writer), and the release
        it calls when done: a view of the slab, its pages kept from reuse until then, when they are
        one run (the common case); else a copy, with nothing held. NotFound if absent."""
        entry = self._entries.get(key)
        if entry is None:
            raise NotFound(f"block {key.hex()} is not in the host tier")
        if is_run(entry.pages):
            start = entry.pages[0] * self.page_bytes
            return self._pool.flat[start : start + entry.meta.nbytes], self.pin(key)
        out = torch.empty(entry.meta.nbytes, dtype=torch.uint8)
        self._pool.gather(entry.pages, out, entry.index)
        return out, _nothing_held

    def _bump(self, pages: Sequence[int], by: int) -> None:
        generations = self._generations
        for page in pages:
            generations[page] += by

    def _begin_write(self, pages: Sequence[int]) -> None:
        self._bump(pages, 1)

    def _end_write(self, pages: Sequence[int]) -> None:
        self._bump(pages, 1)

    def _on_free(self, pages: Sequence[int]) -> None:
        self._bump(pages, 2)

    def locate(self, key: bytes) -> tuple[list[int], list[int]]:
        """The block's pages and their current (even) generations, for SlabReader.read in another
        process. Does not mutate, does not touch LRU order or counters. Raises NotFound if absent."""
        entry = self._entries.get(key)
        if entry is None:
            raise NotFound(f"block {key.hex()} is not in the host tier")
        generations = [self._generations[page] for page in entry.pages]
        assert all(g % 2 == 0 for g in generations), "locate while a page is being written"
        return list(entry.pages), generations

    def payload_view(self, pages: Sequence[int], nbytes: int) -> torch.Tensor:
        """The bytes of a block located by locate(), as a zero-copy view of the slab when its pages
        are one run (the common case), else gathered into a new tensor. Takes no lock: the caller
        must check still_valid() after its last read of the view and discard what it read if not."""
        if is_run(pages):
            start = pages[0] * self.page_bytes
            return self._pool.flat[start : start + nbytes]
        out = torch.empty(nbytes, dtype=torch.uint8)
        self._pool.gather(pages, out)
        return out

    def still_valid(self, pages: Sequence[int], generations: Sequence[int]) -> bool:
        """Whether no page of a located block has been written or freed since locate() (the seqlock)."""
        now = self._generations
        return not self._closed and all(now[p] == g for p, g in zip(pages, generations))

    def check_integrity(self) -> None:
        super().check_integrity()
        odd = [p for entry in self._entries.values() for p in entry.pages if self._generations[p] % 2]
        assert not odd, f"used pages {odd} have odd generations outside a write"

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # Readers still holding the mapping must never validate a page again.
        for page in range(self.num_pages):
            self._generations[page] |= 1
        if self._pinned:
            err = int(torch.cuda.cudart().cudaHostUnregister(self._pool.pages.data_ptr() - self.header_bytes))
            if err:
                logger.warning("cudaHostUnregister of %s failed: cudaError=%d", self._path, err)
        self._index.close()
        self._index_buf.close()
        os.close(self._index_lock)
        for path in (self._index_path,):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        self._entries.clear()
        self._generations.release()
        del self._pool
        try:
            self._mmap.close()
        except BufferError:  # a caller still holds a view; the mapping goes when that does
            logger.warning("host slab %s still has views at close", self._path)
        try:
            os.unlink(self._path)
        except FileNotFoundError:
            pass


def _cuda_register(slab: mmap.mmap) -> bool:
    """Pin the slab for fast device copies when CUDA is present; whether it was pinned."""
    if not torch.cuda.is_available():
        return False
    whole = torch.frombuffer(slab, dtype=torch.uint8)
    err = int(torch.cuda.cudart().cudaHostRegister(whole.data_ptr(), whole.numel(), 1))  # 1: Portable
    if err:
        logger.warning("cudaHostRegister of the host slab failed (cudaError=%d); copies stay unpinned", err)
    return not err


def _nothing_held() -> None:
    """The release of a copy (pinned_view): nothing is held."""
