"""Memory bound: under a mixed workload with a full disk tier (steady-state eviction), the daemon's resident
memory stays within its host pool plus a fixed overhead, and does not trend upward (per operation, see the test)."""

from __future__ import annotations

import pytest

from benchmarks.daemons import cleanup, short_dir
from benchmarks.scenarios.memory import run_memory


@pytest.mark.slow
def test_resident_memory_stays_within_pools_plus_fixed_overhead_and_does_not_trend_up():
    """A 28 s soak; after its first 8 s the heap may grow by at most 768 bytes per worker operation.

    What the bound means: a leak of 768 bytes or more per operation (a kept 32 KiB block every 40
    operations; a kept message, traceback or per-key record on every one) fails here. At this test's
    rate (about 500-650 operations/s on 2 cores) that is about 450 KiB/s; on a NAS serving 100 000
    calls a day (a household's requests, 3-4 calls each) it is 73 MiB a day: the 96 MiB of fixed
    overhead gone in a day and a half. The old bound, 1 MiB/s over the last 6 s of 12, let a leak of
    1 KiB per call through (536 KiB/s measured with one injected); this one fails it (1042 bytes per
    operation).

    Why not tighter: what the heap gains after the warm-up is bounded memory still filling, and a
    30 s test cannot wait it out. The per-block memos (server/fetching.py HEADER_CACHE_BLOCKS, 16384
    entries each; tiercache/codec.py PARSED_MEMO_HEADERS) take a block when it is first fetched, and
    the workers fetch ever older chains, so they fill more and more slowly; the allocators' arenas
    reach their high-water marks the same way. Measured here (2 cores shared with other jobs): 165-330
    bytes per operation over 8-28 s (83-220 KiB/s), decaying (91 KiB/s over 30-60 s of a 60 s soak);
    with the memos cut to 256 entries, 190-240 bytes per operation. The bound is 2.3 times the worst.
    Smaller leaks are for `scripts/torture.py --only memory --seconds 600`, whose slope is fitted over
    all of its soak but the first 8 s.
    """
    base = short_dir()
    try:
        report = run_memory(base, seconds=28.0)
        print({k: v for k, v in report.__dict__.items() if k != "samples"})
        assert not report.problems, report.problems
        assert report.ops > 2000 and report.blocks_indexed > 500
    finally:
        cleanup(base)
