"""A same-host caller's writable map of the daemon's slab, for the pages the daemon reserved to it."""

from __future__ import annotations

import mmap
import os
from collections.abc import Sequence

import numpy as np
import torch

from tiercache.errors import InvalidArgument, NotFound
from tiercache.samehost.index import page_runs
from tiercache.samehost.slab import GENERATIONS_OFFSET, HEADER, header_problem


class SlabWriter:
    """The slab mapped read-write by a caller of the daemon's own user (or group): it writes the
    payloads of blocks into pages the daemon reserved for them (Reserve), and nowhere else. The
    daemon publishes nothing until the caller's Commit, and then hashes the pages itself, so a
    write that strays cannot make a block look intact to readers: it is a verified miss."""

    def __init__(self, path: str) -> None:
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise NotFound(f"slab {path} does not exist") from None
        except PermissionError:
            raise InvalidArgument(f"slab {path} is not writable by this process (another user?)") from None
        try:
            size = os.fstat(fd).st_size
            if size < GENERATIONS_OFFSET:
                raise InvalidArgument(f"{path} is not a tiercache slab: bytes={size}")
            # MAP_POPULATE: the page tables filled now, once, rather than by a fault on the first
            # write to each page of every reservation (147 MB of first writes cost 3x their copy here).
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self._mmap = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        magic, version, _, page_bytes, num_pages, header_bytes = HEADER.unpack_from(self._mmap, 0)
        problem = header_problem(size, magic, version, page_bytes, num_pages, header_bytes)
        if problem:
            self._mmap.close()
            raise InvalidArgument(f"{path} is not a valid tiercache slab: {problem}")
        self.path = path
        self.page_bytes: int = page_bytes
        self.num_pages: int = num_pages
        self._flat = np.frombuffer(self._mmap, dtype=np.uint8, offset=header_bytes,
                                   count=num_pages * page_bytes)

    def runs(self, pages: Sequence[int], nbytes: int) -> list[np.ndarray]:
        """The block's memory as writable uint8 arrays, one per run of consecutive pages, in order,
        together nbytes long (one array when the daemon found one run, as it does when it can)."""
        page_bytes = self.page_bytes
        if nbytes < 0 or -(-nbytes // page_bytes) != len(pages):
            raise InvalidArgument(f"nbytes={nbytes} does not fill {len(pages)} pages of {page_bytes} bytes")
        if any(not 0 <= p < self.num_pages for p in pages):
            raise InvalidArgument(f"page index out of range [0, {self.num_pages}) in {list(pages)}")
        out, left = [], nbytes
        for first, count in page_runs(pages):
            size = min(count * page_bytes, left)
            out.append(self._flat[first * page_bytes : first * page_bytes + size])
            left -= size
        return out

    def close(self) -> None:
        self._flat = np.empty(0, dtype=np.uint8)
        try:
            self._mmap.close()
        except BufferError:  # a view is still held by the caller: the map goes with its last user
            pass


def fill(runs: Sequence[np.ndarray], sources: Sequence[torch.Tensor]) -> None:
    """Copy the bytes of `sources` (CPU tensors, each read in its memory order when contiguous, else
    made contiguous) one after the other into `runs` (SlabWriter.runs): the block's payload in its
    canonical order. InvalidArgument unless they are exactly as long."""
    total = sum(r.size for r in runs)
    given = sum(t.numel() * t.element_size() for t in sources)
    if given != total:
        raise InvalidArgument(f"sources hold {given} bytes for a block of {total}")
    run_i, at = 0, 0
    for tensor in sources:
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        src = tensor.contiguous().view(-1).view(torch.uint8).numpy()
        done = 0
        while done < src.size:
            run = runs[run_i]
            n = min(run.size - at, src.size - done)
            run[at : at + n] = src[done : done + n]
            done += n
            at += n
            if at == run.size:
                run_i, at = run_i + 1, 0
