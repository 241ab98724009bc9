"""PageAllocator: every page free or used, never both; blocks get runs of consecutive pages."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from tiercache.pages import PageAllocator
from tiercache.samehost.index import page_runs


def test_a_block_gets_one_run_when_one_is_free_however_fragmented_the_pool() -> None:
    pool = PageAllocator(64)
    singles = [pool.alloc(1) for _ in range(40)]
    for pages in singles[::2]:
        pool.free(pages)  # 20 holes of one page, then 24 free pages from 40 on
    block = pool.alloc(18)
    assert block == list(range(40, 58))  # the first run long enough, not the holes
    scattered = pool.alloc(8)  # only holes and a 6-page tail left: the longest runs first
    assert len(scattered) == 8 and page_runs(scattered) == [(0, 1), (2, 1), (58, 6)]
    assert pool.alloc(pool.num_free + 1) is None
    pool.check_integrity()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 12)), max_size=80), st.integers(0, 2**32))
def test_random_allocs_and_frees_keep_the_accounting(ops: list[tuple[bool, int]], seed: int) -> None:
    rng = random.Random(seed)
    pool, held, model_free = PageAllocator(48), [], set(range(48))
    for is_alloc, count in ops:
        if is_alloc or not held:
            pages = pool.alloc(count)
            if count > len(model_free):
                assert pages is None
                continue
            assert pages is not None and len(pages) == count and set(pages) <= model_free
            longest = max((n for _, n in page_runs(sorted(model_free))), default=0)
            if longest >= count:
                assert len(page_runs(pages)) == 1, "a run long enough was free"
            model_free -= set(pages)
            held.append(pages)
        else:
            pages = held.pop(rng.randrange(len(held)))
            pool.free(pages)
            model_free |= set(pages)
        assert pool.num_free == len(model_free)
        pool.check_integrity()
