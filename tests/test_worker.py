"""The worker through a real daemon: reuse equals recompute, best effort when the daemon fails, JSON lines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    FalconConfig,
    FalconForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
)

from benchmarks.daemons import REPO, cleanup, open_store, running_server, short_dir, small_config
from tiercache.block import Block
from tiercache.client import Client
from tiercache.errors import InvalidArgument, Unavailable
from tiercache.keys import block_keys, tail_keys
from tiercache.store import TieredStore
from tiercache.tenancy import LOCAL_TENANT, scope_keys
from tiercache.worker import GENERATE_RESERVE_TOKENS, Request, Worker
from tiercache.worker import request as worker_module
from tiercache.worker.cli import _device
from tiercache.worker.kvcache import ReservedLayer
from tiercache.worker.model import ByteTokenizer, wrap_model

VOCAB = ByteTokenizer.vocab_size
TOL = 1e-4


def _seeded(build):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return build().eval()


def tiny(arch: str):
    if arch == "llama":
        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                          initializer_range=0.1, attn_implementation="eager")
        model = _seeded(lambda: LlamaForCausalLM(cfg))
    elif arch == "mistral":  # a sliding window shorter than some prompts
        cfg = MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                            sliding_window=512, initializer_range=0.1, attn_implementation="eager")
        model = _seeded(lambda: MistralForCausalLM(cfg))
    else:
        cfg = GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=2048, initializer_range=0.1,
                         bos_token_id=1, eos_token_id=2, attn_implementation="eager")
        model = _seeded(lambda: GPT2LMHeadModel(cfg))
    return wrap_model(model, ByteTokenizer(), f"tiny-{arch}")


def toks(n: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture
def base():
    path = short_dir()
    yield path
    cleanup(path)


def worker_for(loaded, address: str, timeout_s: float = 5.0, retry_after_s: float = 0.0) -> Worker:
    return Worker(loaded, lambda: Client(address, timeout_s=timeout_s), retry_after_s=retry_after_s)


def assert_same(cached, full) -> None:
    assert cached.tokens == full.tokens, "greedy generation differs from a full recompute"
    a = dict(cached.scores)
    b = dict(full.scores)
    assert a.keys() == b.keys()
    assert max(abs(a[t] - b[t]) for t in a) < TOL


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("prefix_len, note", [(64, "on a block boundary"), (70, "inside a block")])
def test_hit_equals_recompute_through_daemon(base, arch: str, prefix_len: int, note: str) -> None:
    loaded = tiny(arch)
    prefix = toks(prefix_len, 1)
    with running_server(small_config(base)) as (store, address):
        worker = worker_for(loaded, address)
        first = worker.run(Request(tuple(prefix + toks(5, 2)), max_new_tokens=8, return_scores=5))
        assert first.cached_tokens == 0 and not first.degraded
        worker.drain()
        # The write-back was cut straight into room reserved in the daemon's slab, and committed.
        assert store.snapshot_counters().get("reserved_blocks_committed", 0) == (prefix_len + 5) // 16
        prompt = tuple(prefix + toks(6, 3))
        hit = worker.run(Request(prompt, max_new_tokens=8, return_scores=5))
        full = worker.run(Request(prompt, max_new_tokens=8, return_scores=5, cache=False))
        worker.close()
    assert hit.cached_tokens == (prefix_len // 16) * 16, note
    assert hit.computed_tokens == len(prompt) - hit.cached_tokens
    assert hit.tiers and set(hit.tiers) <= {"host", "disk"}
    assert_same(hit, full)


def test_the_cache_has_room_for_the_suffix_and_the_generated_tokens(base, monkeypatch) -> None:
    """The worker's cache, after a miss and after a hit, holds the prompt in a room with space for
    the tokens it generates (up to GENERATE_RESERVE_TOKENS): generation never moves it."""
    caches = []
    real_prefill = worker_module.prefill

    def prefill(*args, **kwargs):
        logits, cache = real_prefill(*args, **kwargs)
        caches.append(cache)
        return logits, cache

    monkeypatch.setattr(worker_module, "prefill", prefill)
    loaded = tiny("llama")
    prefix = toks(64, 11)
    with running_server(small_config(base)) as (_, address):
        worker = worker_for(loaded, address)
        rooms = []
        for suffix_seed, new_tokens in ((12, 8), (13, 8), (14, GENERATE_RESERVE_TOKENS + 40)):
            prompt = prefix + toks(5, suffix_seed)
            result = worker.run(Request(tuple(prompt), max_new_tokens=new_tokens))
            worker.drain()
            layer = caches[-1].layers[0]
            assert isinstance(layer, ReservedLayer) and layer.room is not None
            assert caches[-1].get_seq_length() == len(prompt) + new_tokens - 1  # the last token is not fed back
            rooms.append((result.cached_tokens, layer.room.shape[-2], len(prompt) + new_tokens - 1))
        worker.close()
    (miss, miss_room, miss_held), (hit, hit_room, hit_held), (_, long_room, long_held) = rooms
    assert miss == 0 and hit == 64
    assert miss_room == hit_room == len(prefix) + 5 + 8 and miss_held == hit_held == miss_room - 1
    # Past the reserve the room grew as generation went on (the first room was prompt + 512).
    assert long_room >= long_held > len(prefix) + 5 + GENERATE_RESERVE_TOKENS


def test_breakpoint_tail_409_token_system_prompt(base) -> None:
    """A 409-token system prompt cached once; two questions compute only their own tokens."""
    loaded = tiny("llama")
    system = toks(409, 7)
    with running_server(small_config(base, host_pages=512)) as (_, address):
        worker = worker_for(loaded, address)
        worker.run(Request(tuple(system + toks(6, 8)), max_new_tokens=1, breakpoints=(409,)))
        worker.drain()
        for seed in (9, 10):
            prompt = tuple(system + toks(6, seed))
            hit = worker.run(Request(prompt, max_new_tokens=4, breakpoints=(409,), return_scores=8))
            full = worker.run(Request(prompt, max_new_tokens=4, return_scores=8, cache=False))
            assert hit.cached_tokens == 409
            assert hit.computed_tokens == 6 and hit.computed_tokens / len(prompt) < 0.02
            assert_same(hit, full)
        worker.close()


def test_a_breakpoint_inside_an_already_cached_prefix_is_stored_too(base) -> None:
    """A caches whole blocks past token 410; B asks to cache up to 410 (inside them); C shares exactly
    the first 410 tokens and must hit all 410, not only the 25 whole blocks before it."""
    loaded = tiny("llama")
    shared, rest = toks(410, 11), toks(30, 12)
    with running_server(small_config(base, host_pages=512)) as (_, address):
        worker = worker_for(loaded, address)
        worker.run(Request(tuple(shared + rest), max_new_tokens=1))
        worker.drain()
        b = worker.run(Request(tuple(shared + rest[:10] + toks(10, 13)), max_new_tokens=1, breakpoints=(410,)))
        worker.drain()
        assert b.cached_tokens == 416  # 26 whole blocks: the tail at 410 was not there yet
        prompt = tuple(shared + toks(6, 14))
        c = worker.run(Request(prompt, max_new_tokens=3, breakpoints=(410,), return_scores=8))
        assert c.cached_tokens == 410 and c.tiers == ["host"] * 26
        assert_same(c, worker.run(Request(prompt, max_new_tokens=3, return_scores=8, cache=False)))
        worker.close()


def test_a_sliding_window_model_answers_prompts_longer_than_its_window(base, caplog) -> None:
    """Its sliding layers keep the whole prompt until its blocks are cut, then go back to the window:
    a prompt longer than the window is cached whole, and a hit equals a full recompute."""
    loaded = tiny("mistral")
    with running_server(small_config(base, host_pages=512)) as (_, address):
        worker = worker_for(loaded, address)
        for prompt, reused in ((tuple(toks(1200, 21)), 1184), (tuple(toks(420, 22)), 416)):
            full = worker.run(Request(prompt, max_new_tokens=4, return_scores=8, cache=False))
            first = worker.run(Request(prompt, max_new_tokens=4, return_scores=8))
            worker.drain()
            again = worker.run(Request(prompt, max_new_tokens=4, return_scores=8))
            assert (first.cached_tokens, again.cached_tokens, first.degraded) == (0, reused, "")
            assert_same(first, full)
            assert_same(again, full)
        worker.close()
    assert "not caching" not in caplog.text


def test_falcon_with_one_kv_head_is_cached_by_the_heads_its_cache_holds(base) -> None:
    # Falcon with multi_query (falcon-7b/40b) keeps one KV head; its config says num_kv_heads=4. Read
    # from the config, every block failed to cut and nothing was ever cached.
    cfg = FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, multi_query=True,
                       new_decoder_architecture=False, alibi=False, max_position_embeddings=2048,
                       attn_implementation="eager")
    loaded = wrap_model(_seeded(lambda: FalconForCausalLM(cfg)), ByteTokenizer(), "tiny-falcon")
    assert (loaded.num_kv_heads, loaded.head_dim, loaded.uncacheable) == (1, 16, "")
    prompt = tuple(toks(97, 31))
    with running_server(small_config(base, host_pages=256)) as (_, address):
        worker = worker_for(loaded, address)
        worker.cost.worth_fetching = lambda *args: True  # tiny models recompute faster than they fetch
        full = worker.run(Request(prompt, max_new_tokens=4, return_scores=5, cache=False))
        worker.run(Request(prompt, max_new_tokens=4, return_scores=5))
        worker.drain()
        hit = worker.run(Request(prompt, max_new_tokens=4, return_scores=5))
        worker.close()
    assert hit.cached_tokens == 96 and not hit.degraded
    assert_same(hit, full)


def test_a_model_whose_kv_cannot_be_cut_into_blocks_answers_without_the_cache(base) -> None:
    # DeepSeek-V3 (multi-head latent attention) stores keys and values of different widths: every
    # request failed, even with cache=False, in the reserved cache layers that share one buffer.
    cfg = AutoConfig.for_model("deepseek_v3", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None,
                               kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                               n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                               first_k_dense_replace=1, n_group=1, topk_group=1, max_position_embeddings=2048,
                               attn_implementation="eager")
    loaded = wrap_model(_seeded(lambda: AutoModelForCausalLM.from_config(cfg)), ByteTokenizer(), "tiny-dsv3")
    assert "multi-head latent attention" in loaded.uncacheable
    prompt = tuple(toks(50, 32))
    with running_server(small_config(base)) as (store, address):
        worker = worker_for(loaded, address)
        full = worker.run(Request(prompt, max_new_tokens=4, return_scores=5, cache=False))
        again = [worker.run(Request(prompt, max_new_tokens=4, return_scores=5)) for _ in range(2)]
        worker.drain()
        worker.close()  # its client sends the lookups it answered from the shared index, if any
        assert store.entries() == [] and store.snapshot_counters().get("lookups", 0) == 0  # never asked
    for result in again:
        assert result.cached_tokens == 0 and not result.degraded
        assert_same(result, full)


def test_an_earlier_breakpoint_is_tried_when_a_later_one_misses(base) -> None:
    loaded = tiny("llama")
    system = toks(409, 7)
    with running_server(small_config(base, host_pages=512)) as (_, address):
        worker = worker_for(loaded, address)
        worker.run(Request(tuple(system + toks(6, 8)), max_new_tokens=1, breakpoints=(409, 415)))
        worker.drain()
        hit = worker.run(Request(tuple(system + toks(7, 9)), max_new_tokens=1, breakpoints=(409, 415)))
        assert hit.cached_tokens == 409  # tail 415 is new, tail 409 is there
        worker.close()


def test_slab_pages_recycled_while_the_worker_copies_views_are_fetched_again(base) -> None:
    """The daemon recycles the pages behind the worker's views before it has checked them: the
    worker must notice after its copy, fetch copies, and still answer exactly like a recompute."""

    class Racing(Client):
        races = 1

        def fetch_views(self, keys):
            views = super().fetch_views(keys)
            if Racing.races:  # another worker's traffic lands in the freed pages right after the fetch
                Racing.races -= 1
                copies = [Block(b.meta, b.payload.clone()) for b in views]
                self.evict(keys)
                self.put(copies)  # the same keys again, in other pages: the views are stale
            return views

    loaded = tiny("llama")
    prefix = toks(96, 11)
    with running_server(small_config(base)) as (_, address):
        worker = Worker(loaded, lambda: Racing(address), retry_after_s=0.0)
        worker.run(Request(tuple(prefix + toks(5, 12)), max_new_tokens=1))
        worker.drain()
        prompt = tuple(prefix + toks(6, 13))
        hit = worker.run(Request(prompt, max_new_tokens=6, return_scores=5))
        full = worker.run(Request(prompt, max_new_tokens=6, return_scores=5, cache=False))
        assert worker.num_view_retries == 1 and Racing.races == 0
        assert hit.cached_tokens == 96 and not hit.degraded
        assert_same(hit, full)
        worker.close()


def test_daemon_down_then_back(base) -> None:
    loaded = tiny("llama")
    config = small_config(base)
    address = f"unix:{config.server.socket}"
    worker = worker_for(loaded, address, timeout_s=1.0, retry_after_s=0.0)
    prompt = tuple(toks(40, 4))
    down = worker.run(Request(prompt, max_new_tokens=4, return_scores=3))
    full = worker.run(Request(prompt, max_new_tokens=4, return_scores=3, cache=False))
    assert down.degraded and down.cached_tokens == 0
    assert_same(down, full)
    with running_server(config):
        first = worker.run(Request(prompt, max_new_tokens=4))
        assert not first.degraded, first.degraded
        worker.drain()
        again = worker.run(Request(prompt, max_new_tokens=4, return_scores=3))
        assert again.cached_tokens == 32, "the worker reconnected and used the cache"
        assert_same(again, full)
    worker.close()


def test_a_daemon_that_failed_is_left_alone_for_retry_after_s(base) -> None:
    """The worker's daemon is best effort (tiercache.client.best_effort): one failed request says why,
    the next ones within retry_after_s do not ask at all and are not degraded, only uncached."""
    worker = worker_for(tiny("llama"), f"unix:{base}/none.sock", timeout_s=0.5, retry_after_s=60.0)
    prompt = tuple(toks(40, 4))
    down = worker.run(Request(prompt, max_new_tokens=1))
    skipped = worker.run(Request(prompt, max_new_tokens=1))
    worker.close()
    assert "lookup/fetch" in down.degraded and (skipped.degraded, skipped.cached_tokens) == ("", 0)
    assert (worker.daemon.num_failures, worker.daemon.num_skipped) == (1, 1)


def test_the_prefix_up_to_the_last_breakpoint_is_pinned_and_previewed(base) -> None:
    loaded = tiny("llama")
    prompt = tuple(toks(70, 51))
    with running_server(small_config(base, host_pages=256)) as (store, address):
        worker = worker_for(loaded, address)
        ns = worker.namespace()
        worker.run(Request(prompt, max_new_tokens=1, breakpoints=(40,), pin_ttl_s=60.0, preview='Hi "you"'))
        worker.run(Request(prompt, max_new_tokens=1, salt="alice", preview="Hi"))
        worker.drain()
        worker.close()
        entries = {e.meta.key: e for e in store.entries()}
    keys = block_keys(ns, list(prompt))
    keys.append(tail_keys(ns, list(prompt), (40,), keys)[40])
    keys = scope_keys(LOCAL_TENANT, keys)  # as the daemon stores them
    assert {k for k, e in entries.items() if e.pinned} == {keys[0], keys[1], keys[-1]}
    assert set(keys) <= set(entries) and len(entries) == 2 * len(keys) - 1  # and the salted chain's full blocks
    assert [e.meta.preview for e in entries.values() if e.meta.preview] == ["Hi "]  # not the salted one


class SlowStore(TieredStore):
    def lookup(self, keys, **kwargs):
        time.sleep(1.5)
        return super().lookup(keys, **kwargs)


class BrokenStore(TieredStore):
    def fetch(self, keys):
        raise RuntimeError("disk on fire")

    def locate_host(self, keys):
        raise RuntimeError("disk on fire")


@pytest.mark.parametrize("cls, why", [(SlowStore, "Deadline Exceeded"), (BrokenStore, "RuntimeError")])
def test_daemon_slow_or_failing_still_answers(base, cls, why: str) -> None:
    loaded = tiny("llama")
    config = small_config(base)
    prompt = tuple(toks(48, 5))
    with running_server(config, store=open_store(config, cls=cls)) as (store, address):
        # A client that asks the daemon for everything: through the shared index a same-host worker
        # would read the host blocks without meeting the broken store at all.
        worker = Worker(loaded, lambda: Client(address, timeout_s=0.5, shared_memory=False), retry_after_s=0.0)
        worker.run(Request(prompt, max_new_tokens=1))
        worker.drain()
        if cls is BrokenStore:
            assert store.lookup([]) == []  # the put went through; only fetch fails
        result = worker.run(Request(prompt, max_new_tokens=4, return_scores=3))
        full = worker.run(Request(prompt, max_new_tokens=4, return_scores=3, cache=False))
        worker.close()
    assert why in result.degraded, result.degraded  # slow past its deadline, or failing
    assert result.cached_tokens == 0
    assert_same(result, full)


def test_worker_command_json_lines(base) -> None:
    """`tiercache worker` over stdin/stdout with the embedded default model; bad lines get errors."""
    config = small_config(base, host_pages=256)
    with running_server(config) as (_, address):
        lines = [
            {"prompt": "You are a helpful house assistant. " * 4 + "Turn on the lights.", "max_new_tokens": 4},
            {"prompt": "You are a helpful house assistant. " * 4 + "Close the blinds.", "return_scores": 3, "id": 7},
            "this is not json",
            {"tokens": [1, 2, 99999]},
            {"prompt": "x", "bogus": 1},
            {"tokens": [1, 50, 60, 70], "cache": False, "max_new_tokens": 2},
            "[" * 100_000 + "]" * 100_000,  # deeper than Python's JSON decoder goes
            {"prompt": "", "id": "empty"},
            {"tokens": [65] * 8190, "max_new_tokens": 16},  # past the embedded model's 8192 positions
            {"tokens": [1, 50, 60, 70], "cache": False, "max_new_tokens": 1},  # and the worker still answers
        ]
        stdin = "\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n"
        proc = subprocess.run([sys.executable, "-m", "tiercache.cli", "worker", "--socket", address[5:],
                               "--log-level", "WARNING", "--threads", "1"], input=stdin, capture_output=True,
                              text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=240)
    assert proc.returncode == 0, proc.stderr
    out = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(out) == len(lines)
    assert out[0]["cached_tokens"] == 0 and out[0]["prompt_tokens"] > 140
    assert out[1]["cached_tokens"] >= 128 and out[1]["id"] == 7 and len(out[1]["scores"]) == 3
    assert "error" in out[2] and "error" in out[3] and "vocabulary" in out[3]["error"]
    assert "bogus" in out[4]["error"]
    assert out[5]["cached_tokens"] == 0 and len(out[5]["tokens"]) == 2
    assert "nested too deeply" in out[6]["error"]
    assert out[7] == {"error": "InvalidArgument: the prompt is empty", "id": "empty"}
    assert "8190 tokens plus max_new_tokens=16 exceed the model's context of 8192" in out[8]["error"]
    assert len(out[9]["tokens"]) == 1


def test_worker_command_names_a_device_it_cannot_use() -> None:
    """--device is checked before the model loads (the entry point turns InvalidArgument into exit 2)."""
    with pytest.raises(InvalidArgument, match="'tpu' is not a torch device"):
        _device(torch, "tpu")
    with pytest.raises(InvalidArgument, match="the worker runs on cpu or cuda"):
        _device(torch, "meta")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(InvalidArgument, match="CUDA device"):
        _device(torch, f"cuda:{count}")  # one past the last (or any, without CUDA)
    assert _device(torch, "cpu") == torch.device("cpu")
    assert _device(torch, None).type == ("cuda" if count else "cpu")


def test_unavailable_is_the_error_when_nothing_listens(base) -> None:
    with Client(f"unix:{base}/none.sock", timeout_s=0.5) as client:
        with pytest.raises(Unavailable):
            client.lookup([b"\0" * 32])
