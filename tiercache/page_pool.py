"""A pool tensor of fixed-size pages and the copies of blocks into and out of them (the host slab's
pages in the daemon and in same-host readers, the gpu tier's device pool)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def pages_for(nbytes: int, page_bytes: int) -> int:
    """Pages a payload of `nbytes` occupies (the last one possibly partial)."""
    return -(-nbytes // page_bytes)


def payload_bytes(payload: torch.Tensor) -> torch.Tensor:
    """The payload as a flat contiguous uint8 tensor (zero-copy when it already is contiguous)."""
    if payload.dtype == torch.uint8 and payload.dim() == 1 and payload.is_contiguous():
        return payload  # what decoded records are: two torch calls fewer per block
    flat = payload.contiguous().reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def is_run(pages: Sequence[int]) -> bool:
    """Whether the pages are consecutive and ascending, so the block is one stretch of the pool."""
    return bool(pages) and list(pages) == list(range(pages[0], pages[0] + len(pages)))


class PagePool:
    """A uint8 tensor [num_pages, page_bytes] and the copies of blocks into and out of its pages.

    Each copy is a fixed number of torch calls whatever the page count: one for a block in
    consecutive pages, else one index_select/index_copy_ for the full pages and one for the tail.
    """

    def __init__(self, pages: torch.Tensor) -> None:
        assert pages.dtype == torch.uint8 and pages.dim() == 2 and pages.is_contiguous()
        self.pages = pages
        self.flat = pages.view(-1)  # kept: a view per copy costs as much as a small copy
        self.num_pages, self.page_bytes = pages.shape
        self.device = pages.device

    def full_page_index(self, pages: Sequence[int], nbytes: int) -> torch.Tensor | None:
        """The block's full pages as an index tensor for gather/scatter; None when the pages are one
        run (copied as one slice). Worth keeping per block: building it costs as much as a copy."""
        return None if is_run(pages) else self._index(pages, nbytes)

    def _index(self, pages: Sequence[int], nbytes: int) -> torch.Tensor:
        return torch.tensor(pages[: nbytes // self.page_bytes], dtype=torch.long, device=self.device)

    def gather(self, pages: Sequence[int], out: torch.Tensor, index: torch.Tensor | None = None) -> None:
        """Copy the block in `pages` into flat uint8 `out`, whose length is the block's nbytes;
        `index` is full_page_index(pages, nbytes) when the caller kept it."""
        nbytes, page_bytes = out.numel(), self.page_bytes
        if is_run(pages):
            start = pages[0] * page_bytes
            out.copy_(self.flat[start : start + nbytes])
            return
        num_full, tail = divmod(nbytes, page_bytes)
        if num_full:
            index = self._index(pages, nbytes) if index is None else index
            torch.index_select(self.pages, 0, index, out=out[: num_full * page_bytes].view(num_full, page_bytes))
        if tail:
            out[num_full * page_bytes :].copy_(self.pages[pages[num_full], :tail])

    def scatter(self, pages: Sequence[int], src: torch.Tensor, index: torch.Tensor | None = None) -> None:
        """Copy flat uint8 `src` into `pages`, in order; the inverse of gather."""
        nbytes, page_bytes = src.numel(), self.page_bytes
        if is_run(pages):
            start = pages[0] * page_bytes
            self.flat[start : start + nbytes].copy_(src)
            return
        num_full, tail = divmod(nbytes, page_bytes)
        if num_full:
            index = self._index(pages, nbytes) if index is None else index
            full = src[: num_full * page_bytes].view(num_full, page_bytes).to(self.device)
            self.pages.index_copy_(0, index, full)
        if tail:
            self.pages[pages[num_full], :tail].copy_(src[num_full * page_bytes :])
