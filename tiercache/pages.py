"""Fixed-size page accounting for the pooled tiers: which pages are free, no torch, no I/O."""

from __future__ import annotations

import numpy as np


class PageAllocator:
    """Hands out page indices of one preallocated pool, as runs of consecutive pages where it can.

    A multi-page allocation takes the pages right after the previous one when they are free (next
    fit: a chain put in one go lies back to back), else the first run of free pages long enough for
    all of them (first fit); when none is, the longest runs there are, so a block lies in as few runs as the free space
    allows (the shared index describes a block by its runs: samehost/index.py). One page: the
    lowest free one, which keeps a small working set compact.

    Invariants (checked by check_integrity):
      - num_free + num_used == num_pages
      - every page index is in [0, num_pages) and is either free or used, never both
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self._is_free = np.ones(num_pages, dtype=bool)
        self._num_free = num_pages
        self._used: set[int] = set()
        self._cursor = 0  # where the last multi-page allocation ended: tried first (next fit)

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_used(self) -> int:
        return len(self._used)

    def alloc(self, count: int) -> list[int] | None:
        """Take `count` pages, in runs as long as the free space has; None, changing nothing, if
        too few are free."""
        if count < 0:
            raise ValueError(f"page count must be >= 0, got {count}")
        if count > self._num_free:
            return None
        if count == 0:
            return []
        pages = self._pick(count)
        self._mark(pages, False)
        self._num_free -= count
        self._used.update(pages)
        return pages

    def _mark(self, pages: list[int], free: bool) -> None:
        if pages == list(range(pages[0], pages[0] + len(pages))):  # a run, ascending: one slice
            self._is_free[pages[0] : pages[-1] + 1] = free
        else:
            self._is_free[pages] = free

    def _pick(self, count: int) -> list[int]:
        if count == 1:
            return [int(np.argmax(self._is_free))]  # argmax stops at the first free page
        start = self._cursor  # blocks put one after another take the run that follows the last one
        if start + count <= self.num_pages and self._is_free[start : start + count].all():
            self._cursor = start + count
            return list(range(start, start + count))
        edges = np.flatnonzero(np.diff(self._is_free, prepend=False, append=False))
        starts, lengths = edges[0::2], edges[1::2] - edges[0::2]
        fits = np.flatnonzero(lengths >= count)
        if fits.size:
            start = int(starts[fits[0]])
            self._cursor = start + count
            return list(range(start, start + count))
        pages: list[int] = []
        for i in np.argsort(-lengths, kind="stable").tolist():  # the longest runs first
            start = int(starts[i])
            pages += range(start, start + min(int(lengths[i]), count - len(pages)))
            if len(pages) == count:
                break
        return sorted(pages)

    def free(self, pages: list[int]) -> None:
        """Return pages to the pool; every one must currently be used."""
        if not pages:
            return
        if len(set(pages)) != len(pages) or not self._used.issuperset(pages):  # the pool's own invariant
            raise AssertionError(f"freeing pages {sorted(pages)}: twice, or not in use")
        self._used.difference_update(pages)
        self._mark(pages, True)
        self._num_free += len(pages)

    def check_integrity(self) -> None:
        free = set(np.flatnonzero(self._is_free).tolist())
        assert len(free) == self._num_free, "the free count differs from the free map"
        assert not free & self._used, "a page is both free and used"
        assert len(free) + len(self._used) == self.num_pages, "free + used != num_pages"
        assert all(0 <= p < self.num_pages for p in free | self._used), "page index out of range"
