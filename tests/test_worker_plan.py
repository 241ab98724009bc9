"""The worker's planner without a daemon or a model: what it fetches, computes, writes back and pins."""

from __future__ import annotations

from tiercache.keys import Namespace, block_keys, tail_keys
from tiercache.worker.cost import CostModel
from tiercache.worker.plan import BlockToWrite, FetchPlan, Prompt, plan_fetch, plan_pin, plan_write_back, stored_preview

NS = Namespace(model="tiny", weights="w", dtype="float16", num_layers=2, num_kv_heads=2, head_dim=16,
               block_tokens=16)
TOKEN_BYTES = 2 * 2 * 2 * 16 * 2  # layers * (K, V) * kv heads * head_dim * 2 bytes


def prompt(num_tokens: int, breakpoints: tuple[int, ...] = ()) -> Prompt:
    tokens = [3 + i % 200 for i in range(num_tokens)]
    keys = block_keys(NS, tokens)
    return Prompt(keys, tail_keys(NS, tokens, breakpoints, keys), num_tokens, NS.block_tokens, TOKEN_BYTES, breakpoints)


class Store:
    """What the daemon holds, as a set of keys; records the tail lookups the planner makes."""

    def __init__(self, keys: list[bytes] = (), tier: str = "host") -> None:
        self.keys, self.tier, self.asked = set(keys), tier, []

    def lookup(self, keys: list[bytes]) -> list[str]:
        found = 0
        while found < len(keys) and keys[found] in self.keys:
            found += 1
        return [self.tier] * found

    def lookup_tail(self, key: bytes) -> list[str]:
        self.asked.append(key)
        return self.lookup([key])


def fetch(p: Prompt, store: Store, cost: CostModel | None = None) -> FetchPlan:
    return plan_fetch(p, store.lookup(p.query()), store.lookup_tail, cost)


def test_nothing_cached_fetches_nothing_and_writes_every_full_block_and_tail() -> None:
    p = prompt(70, breakpoints=(40,))
    assert fetch(p, Store()) == FetchPlan()
    plan = plan_write_back(p, num_cached=0, first_held=0)
    assert plan.num_full == 4 and plan.maybe_present == frozenset()
    assert plan.blocks[:4] == [BlockToWrite(p.keys[i], p.keys[i - 1] if i else b"", 16 * i, 16 * (i + 1))
                               for i in range(4)]
    assert plan.blocks[4:] == [BlockToWrite(p.tails[40], p.keys[1], 32, 40)]  # its parent: the full block before it


def test_a_partial_prefix_is_fetched_and_the_blocks_after_it_are_written() -> None:
    p = prompt(70)
    plan = fetch(p, Store(p.keys[:2]))
    assert (plan.keys, plan.tiers, plan.num_tokens) == (p.keys[:2], ["host", "host"], 32)
    write = plan_write_back(p, plan.num_tokens, first_held=0)
    assert [b.key for b in write.blocks] == p.keys[2:] and write.blocks[0].parent == p.keys[1]


def test_a_fully_cached_prompt_leaves_its_last_block_to_compute() -> None:
    # 64 tokens, all four blocks cached: the last token's logits start generation, so its block is computed.
    p = prompt(64)
    assert p.query() == p.keys[:3]
    plan = fetch(p, Store(p.keys))
    assert plan.keys == p.keys[:3] and plan.num_tokens == 48
    assert [b.key for b in plan_write_back(p, 48, 0).blocks] == [p.keys[3]]  # present already: a no-op put
    one_more = prompt(65)
    assert fetch(one_more, Store(one_more.keys)).num_tokens == 64


def test_a_breakpoint_tail_extends_a_chain_of_its_full_blocks() -> None:
    p = prompt(70, breakpoints=(40,))
    store = Store([*p.keys[:2], p.tails[40]])  # a 40-token system prompt, cached by an earlier request
    plan = fetch(p, store)
    assert (plan.keys, plan.num_tokens) == ([*p.keys[:2], p.tails[40]], 40)
    # The tail's full block (tokens 32-48) is new to this chain; the tail itself was fetched.
    write = plan_write_back(p, 40, first_held=0)
    assert [b.key for b in write.blocks] == p.keys[2:] and write.maybe_present == frozenset()


def test_the_latest_breakpoint_is_tried_first_then_an_earlier_one() -> None:
    p = prompt(70, breakpoints=(20, 40, 45))
    store = Store([*p.keys[:2], p.tails[20], p.tails[40]])
    plan = fetch(p, store)
    assert plan.keys == [*p.keys[:2], p.tails[40]] and plan.num_tokens == 40
    assert store.asked == [p.tails[45], p.tails[40]]  # 45 missing, 40 found; 20 is inside the chain already


def test_tails_the_chain_cannot_reach_or_that_end_the_prompt_are_not_asked() -> None:
    p = prompt(70, breakpoints=(50, 70))
    store = Store([p.keys[0], p.tails[50], p.tails[70]])
    assert fetch(p, store).keys == [p.keys[0]]
    # 50 needs three full blocks (one cached); 70 is the whole prompt, which leaves nothing to compute.
    assert store.asked == []


def test_a_tail_inside_the_cached_prefix_is_written_but_checked_first() -> None:
    p = prompt(70, breakpoints=(40,))
    plan = fetch(p, Store(p.keys))
    assert plan.num_tokens == 64 and plan.keys == p.keys[:4]  # whole blocks past the tail: no tail asked
    write = plan_write_back(p, plan.num_tokens, first_held=0)
    assert [b.key for b in write.blocks] == [p.tails[40]]  # no full block is new
    assert write.blocks[0] == BlockToWrite(p.tails[40], p.keys[1], 32, 40)
    assert write.maybe_present == frozenset({p.tails[40]})


def test_the_cost_model_may_say_recompute() -> None:
    p = prompt(70)
    store = Store(p.keys, tier="disk")
    cost = CostModel()
    assert fetch(p, store, cost).num_tokens == 64  # nothing measured yet: fetch, and so measure
    cost.observe_prefill(1000, 0.001)  # a million tokens a second
    cost.observe_fetch("disk", 1000, 1.0)  # a thousand bytes a second
    assert fetch(p, store, cost) == FetchPlan()
    assert fetch(p, store, None).num_tokens == 64  # a retry: decided already
    cost.observe_fetch("host", 10**12, 1.0)
    assert fetch(p, Store(p.keys, tier="host"), cost).num_tokens == 64


def test_the_slowest_tier_prices_the_whole_chain() -> None:
    assert FetchPlan([b"a", b"b", b"c"], ["gpu", "disk", "host"], 48).slowest == "disk"


def test_a_sliding_window_that_let_tokens_go_stops_the_write_back() -> None:
    p = prompt(70, breakpoints=(20, 40))
    assert plan_write_back(p, 0, first_held=16) == plan_write_back(p, 32, first_held=40)  # nothing
    assert plan_write_back(p, 0, first_held=16).blocks == []
    # Held from token 32 on with 48 cached: the blocks past 48 and the tail at 40 can be cut, the
    # tail at 20 (tokens 16-20) cannot.
    write = plan_write_back(p, 48, first_held=32)
    assert [b.key for b in write.blocks] == [p.keys[3], p.tails[40]]


def test_pins_cover_the_chain_up_to_the_last_breakpoint() -> None:
    p = prompt(90, breakpoints=(20, 64))
    assert plan_pin(p) == [*p.keys[:4], p.tails[20]]  # 64 is a block boundary: no tail of its own
    q = prompt(90, breakpoints=(20, 70))
    assert plan_pin(q) == [*q.keys[:4], q.tails[20], q.tails[70]]
    assert plan_pin(prompt(90)) == []
    assert plan_pin(prompt(90, breakpoints=(5,))) == [prompt(90, breakpoints=(5,)).tails[5]]


def test_previews_are_plain_text_never_salted_and_short() -> None:
    assert stored_preview("You are helpful.", salted=False, previews=True) == "You are helpful."
    assert stored_preview("You are helpful.", salted=True, previews=True) == ""
    assert stored_preview("You are helpful.", salted=False, previews=False) == ""
    assert stored_preview('Say "hi"', salted=False, previews=True) == "Say "  # a canonical header takes no quotes
    assert stored_preview("é", salted=False, previews=True) == ""
    assert stored_preview("x" * 100, salted=False, previews=True) == "x" * 64
