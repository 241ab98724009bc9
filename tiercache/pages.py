"""Fixed-size page accounting for the pooled tiers: a free list, no torch, no I/O."""

from __future__ import annotations


class PageAllocator:
    """Hands out page indices of one preallocated pool.

    Invariants (checked by check_integrity):
      - num_free + num_used == num_pages
      - every page index is in [0, num_pages) and is either free or used, never both
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        # Pop from the end: low page indices go out first, which keeps a small working set compact.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def alloc(self, count: int) -> list[int] | None:
        """Take `count` pages (not necessarily contiguous); None, changing nothing, if too few are free."""
        if count < 0:
            raise ValueError(f"page count must be >= 0, got {count}")
        if count > len(self._free):
            return None
        pages = [self._free.pop() for _ in range(count)]
        self._used.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        """Return pages to the pool; every one must currently be used. Pushed in reverse, so that
        the next alloc of as many pages pops them in ascending order: a run of pages comes back
        as a run (the shared index keeps a block's pages as runs, see tiers/host_index.py)."""
        for page in reversed(pages):
            assert page in self._used, f"freeing page {page} that is not in use"
            self._used.remove(page)
            self._free.append(page)

    def check_integrity(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "a page is on the free list twice"
        assert not free & self._used, "a page is both free and used"
        assert len(free) + len(self._used) == self.num_pages, "free + used != num_pages"
        assert all(0 <= p < self.num_pages for p in free | self._used), "page index out of range"
