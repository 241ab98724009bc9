"""A same-host caller's writable map of the daemon's slab, for the pages the daemon reserved to it."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from tiercache.errors import InvalidArgument
from tiercache.samehost.index import map_shared, page_runs
from tiercache.samehost.slab import GENERATIONS_OFFSET, slab_geometry


class SlabWriter:
    """The slab mapped read-write by a caller of the daemon's own user (or group): it writes the
    payloads of blocks into pages the daemon reserved for them (Reserve), and nowhere else. The
    daemon publishes nothing until the caller's Commit, and then hashes the pages itself, so a
    write that strays cannot make a block look intact to readers: it is a verified miss."""

    def __init__(self, path: str) -> None:
        self._mmap = map_shared(path, "slab", GENERATIONS_OFFSET, writable=True)
        page_bytes, num_pages, header_bytes = slab_geometry(self._mmap, path)
        self.path = path
        self.page_bytes: int = page_bytes
        self.num_pages: int = num_pages
        self._flat = np.frombuffer(self._mmap, dtype=np.uint8, offset=header_bytes, count=num_pages * page_bytes)

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
