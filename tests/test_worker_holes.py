"""Holes in a cached chain: the worker computes a missing block from the blocks before it, uses the
cached blocks after it as they are, answers as a recompute does, and writes the holes back."""

from __future__ import annotations

import pytest

from benchmarks.daemons import running_server, small_config
from tests.test_worker import assert_same, tiny, toks
from tests.test_worker_plan import NS, TOKEN_BYTES, prompt
from tiercache.client import Client
from tiercache.keys import block_keys
from tiercache.worker import Request, Worker
from tiercache.worker.cost import CostModel
from tiercache.worker.plan import MAX_HOLES, FetchPlan, Run, plan_fetch, plan_write_back


def never(key: bytes) -> list[str]:
    raise AssertionError("no tail lookup expected")


def test_the_runs_after_holes_are_planned_and_the_holes_written_back() -> None:
    p = prompt(200)  # 12 full blocks, 11 of them a fetch may cover
    tiers = ["host", "host", "", "remote", "remote", "", "", "disk", "", "host"]
    plan = plan_fetch(p, tiers, never, None)
    assert (plan.keys, plan.tiers, plan.num_tokens) == (p.keys[:2], ["host", "host"], 32)
    assert plan.later == [Run(3, p.keys[3:5], ["remote", "remote"]), Run(7, p.keys[7:8], ["disk"]),
                          Run(9, p.keys[9:10], ["host"])]
    write = plan_write_back(p, 160, first_held=0, filled=[2, 5, 6, 8])
    assert [b.key for b in write.blocks] == [p.keys[10], p.keys[11], p.keys[2], p.keys[5], p.keys[6], p.keys[8]]
    assert write.num_full == 2 and write.blocks[2].parent == p.keys[1] and write.blocks[2].start == 32
    # A hole at the start: nothing to fetch first, the runs after it all the same.
    assert plan_fetch(p, ["", "host"], never, None) == FetchPlan(later=[Run(1, p.keys[1:2], ["host"])])


def test_at_most_max_holes_are_filled_and_a_slow_tier_is_not_worth_its_runs() -> None:
    p = prompt(16 * (2 * MAX_HOLES + 8))
    tiers = ["host", ""] * (MAX_HOLES + 4)
    assert len(plan_fetch(p, tiers, never, None).later) == MAX_HOLES
    cost = CostModel()
    cost.observe_prefill(10_000, 0.01)  # a million tokens a second
    cost.observe_fetch("host", 1 << 30, 0.1)
    cost.observe_fetch("remote", 1 << 20, 1.0)  # a MiB a second: recomputing is cheaper
    plan = plan_fetch(p, ["host", "", "remote", "remote"], never, cost)
    assert plan.keys == p.keys[:1] and plan.later == []
    assert TOKEN_BYTES * 16 < 1 << 20 and NS.block_tokens == 16


@pytest.mark.parametrize("arch", ["llama", "gpt2", "mistral"])
def test_a_chain_with_evicted_blocks_in_the_middle_is_filled_and_equals_a_recompute(base, arch: str) -> None:
    loaded = tiny(arch)
    shared = toks(600, 31)  # the mistral model's window is 512: its sliding layers must keep every token
    with running_server(small_config(base, host_pages=512)) as (store, address):
        # A TCP-like caller: no shared index, so the lookup with holes is the daemon's answer.
        worker = Worker(loaded, lambda: Client(address, shared_memory=False), retry_after_s=0.0)
        worker.cost.worth_fetching = lambda *args: True  # a tiny model recomputes faster than it fetches
        worker.run(Request(tuple(shared + toks(3, 32)), max_new_tokens=1))
        worker.drain()
        ns = worker.namespace()
        keys = block_keys(ns, shared)  # 37 full blocks
        holes = [0, 5, 6, 20, 36]
        with Client(address, shared_memory=False) as client:
            assert client.evict([keys[i] for i in holes]) == len(holes)
            assert client.lookup(keys, holes=True) == ["" if i in holes else "host" for i in range(36)]
        prompt_tokens = tuple(shared + toks(9, 33))
        hit = worker.run(Request(prompt_tokens, max_new_tokens=6, return_scores=5))
        full = worker.run(Request(prompt_tokens, max_new_tokens=6, return_scores=5, cache=False))
        assert_same(hit, full)
        assert hit.cached_tokens == 16 * (37 - len(holes)) and not hit.degraded
        assert hit.tiers == ["host"] * (37 - len(holes))
        worker.drain()
        with Client(address, shared_memory=False) as client:  # the holes were written back
            assert client.lookup(keys, holes=True) == ["host"] * 37
        again = worker.run(Request(prompt_tokens, max_new_tokens=6, return_scores=5))
        assert again.cached_tokens == 16 * 38  # the holes, and the block after the 37 the first run wrote
        assert_same(again, full)
        worker.close()
        store.check_integrity()
