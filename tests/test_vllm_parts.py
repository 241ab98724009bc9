"""The vLLM connector's parts that need no vLLM: settings, namespaces, the scheduler's plan, the
whole-block packing of vLLM's CPU and FlashAttention KV layouts, and the worker's transfers
through a real daemon (a dropped daemon and a damaged block are misses, never wrong bytes)."""

from __future__ import annotations

import dataclasses
import pathlib

import pytest
import torch

from benchmarks.daemons import cleanup, running_server, short_dir, small_config
from benchmarks.tiny_llama import save_tiny_llama
from tiercache.client import Client
from tiercache.config import HostConfig, StoreConfig
from tiercache.integrations.vllm.link import DaemonLink
from tiercache.integrations.vllm.naming import Namespaces, base_namespace, request_salt
from tiercache.integrations.vllm.packing import KVPacking, UnsupportedLayout
from tiercache.integrations.vllm.plan import Planner
from tiercache.integrations.vllm.settings import ConnectorSettings
from tiercache.integrations.vllm.transfer import KVTransfer
from tiercache.keys import Namespace, block_keys
from tiercache.weights import weights_digest

NS = Namespace(model="llama/tiny", weights="w", dtype="float32", num_layers=2, num_kv_heads=2, head_dim=8,
               block_tokens=4, adapter="engine=vllm;tp=0/1")


# ---- settings and namespaces --------------------------------------------------------------------

def test_settings_name_the_bad_key_or_value() -> None:
    s = ConnectorSettings.from_extra_config({"socket": "/run/t.sock", "timeout_ms": 500, "salt": "alice"})
    assert (s.target, s.timeout_ms, s.salt, s.read_token()) == ("unix:/run/t.sock", 500, "alice", None)
    assert ConnectorSettings.from_extra_config({"address": "nas:7070", "token": "t"}).read_token() == "t"
    for extra, words in [({"socket": "/s", "sokcet": "/s"}, r"unknown kv_connector_extra_config key\(s\) sokcet"),
                         ({}, "needs socket"), ({"socket": "/s", "address": "h:1"}, "not both"),
                         ({"socket": "/s", "timeout_ms": -1}, "timeout_ms must be a positive number"),
                         ({"socket": "/s", "timeout_ms": 1.5}, "timeout_ms must be an integer"),
                         ({"socket": "/s", "share_with_hf_worker": "yes"},
                          "share_with_hf_worker must be true or false"),
                         ({"socket": 7}, "socket must be a string")]:
        with pytest.raises(ValueError, match=words):
            ConnectorSettings.from_extra_config(extra)


def test_namespaces_carry_engine_rank_lora_and_salts(tmp_path: pathlib.Path) -> None:
    model = save_tiny_llama(tmp_path / "tiny")
    settings = ConnectorSettings(socket="/s", salt="site")
    base = base_namespace(settings, model=str(model), revision=None, model_type="llama", dtype="float32",
                          num_layers=2, num_kv_heads=2, head_dim=64, block_tokens=128,
                          digest_cache=tmp_path / "memo.json")
    # The HF worker names the same directory the same way (tiercache/weights.py).
    assert base.model == "llama/tiny" and base.weights == weights_digest(model, cache_file=tmp_path / "m2.json")
    spaces = Namespaces(settings, base, tp_size=2)
    rank0, rank1 = spaces.of()
    assert (rank0.adapter, rank1.adapter) == ("engine=vllm;tp=0/2", "engine=vllm;tp=1/2")
    assert rank0.salt == "site" and spaces.of() is spaces.of()
    lora = spaces.of("sql", "user-7")[0]
    assert lora.adapter == "engine=vllm;tp=0/2;lora=sql" and lora.salt == request_salt(settings, "user-7") != "site"
    # Every field changes every key: no two of these share a chain.
    firsts = {block_keys(ns, list(range(128)))[0] for ns in (rank0, rank1, lora, spaces.of(None, "user-8")[0])}
    assert len(firsts) == 4
    shared = Namespaces(ConnectorSettings(socket="/s", share_with_hf_worker=True), base, tp_size=1).of("sql")[0]
    assert shared.adapter == "lora=sql"
    with pytest.raises(ValueError, match="share_with_hf_worker needs tensor_parallel_size 1"):
        Namespaces(ConnectorSettings(socket="/s", share_with_hf_worker=True), base, tp_size=2)
    with pytest.raises(ValueError, match="cannot find a local copy of model 'no/such-model'"):
        base_namespace(settings, model="no/such-model", revision=None, model_type="llama", dtype="float32",
                       num_layers=2, num_kv_heads=2, head_dim=64, block_tokens=128)


# ---- the scheduler's plan -----------------------------------------------------------------------

class FakeLookup:
    """Stands in for the daemon's answer only: how many leading blocks it holds."""

    def __init__(self, hits: int) -> None:
        self.hits = hits
        self.calls = 0

    def __call__(self, chains: list[list[bytes]]) -> int:
        self.calls += 1
        return min(self.hits, *(len(c) for c in chains))


def test_plan_loads_hits_and_saves_what_vllm_computes() -> None:
    lookup = FakeLookup(hits=3)
    plan = Planner(4, lookup)
    tokens = list(range(22))  # 5 full blocks and 2 tokens
    keys = block_keys(NS, tokens)
    assert plan.matched("r", tokens, (NS,), num_computed=4) == 8  # blocks 1-2 past vLLM's own block 0
    plan.allocated("r", [10, 11, 12, 13, 14, 15], num_external=8)
    # Chunked prefill: 6 tokens of the 10 left this step, 4 in the next.
    loads, saves = plan.step([("r", 12, 6, [10, 11, 12, 13, 14, 15], True)])
    assert [(t.block_ids, t.chains) for t in loads] == [([11, 12], [keys[1:3]])]
    assert [(t.block_ids, t.chains, t.parents) for t in saves] == [([13], [keys[3:4]], [keys[2]])]
    assert saves[0].namespaces == [NS.to_dict()]
    loads, saves = plan.step([("r", 18, 4, None, False)])
    assert not loads and [t.block_ids for t in saves] == [[14]]
    loads, saves = plan.step([("r", 22, 1, None, False)])  # decoding: nothing new of the prompt
    assert (loads, saves) == ([], [])
    plan.finished("r")
    assert len(plan) == 0 and plan.step([("r", 23, 1, None, False)]) == ([], [])


def test_plan_full_hit_leaves_the_last_token_and_local_hits_are_saved_when_missing() -> None:
    plan = Planner(4, FakeLookup(hits=9))
    tokens = list(range(8))
    assert plan.matched("full", tokens, (NS,), 0) == 7  # vLLM computes token 7 to sample from it
    plan.allocated("full", [5, 6], num_external=7)
    loads, saves = plan.step([("full", 7, 1, [5, 6], True)])
    assert [t.block_ids for t in loads] == [[5, 6]] and saves == []  # the whole last block loads
    # The daemon lost what vLLM's own prefix cache still holds: it is written back.
    plan = Planner(4, FakeLookup(hits=0))
    assert plan.matched("local", tokens, (NS,), 4) == 0
    plan.allocated("local", [3, 4], num_external=0)
    loads, saves = plan.step([("local", 4, 4, [3, 4], True)])
    assert loads == [] and [t.block_ids for t in saves] == [[3, 4]]
    # A prompt shorter than a block asks nothing.
    lookup = FakeLookup(hits=5)
    assert Planner(4, lookup).matched("short", [1, 2, 3], (NS,), 0) == 0 and lookup.calls == 0


def test_plan_resumed_request_takes_its_new_blocks() -> None:
    plan = Planner(4, FakeLookup(hits=0))
    tokens = list(range(12))
    plan.matched("r", tokens, (NS,), 0)
    plan.allocated("r", [1, 2, 3], 0)
    assert [t.block_ids for t in plan.step([("r", 0, 4, [1, 2, 3], True)])[1]] == [[1]]
    # Preempted, then resumed with other blocks: vLLM asks again and recomputes from 0.
    plan.matched("r", tokens, (NS,), 0)
    plan.allocated("r", [7, 8, 9], 0)
    loads, saves = plan.step([("r", 0, 12, [7, 8, 9], True)])
    assert [t.block_ids for t in saves] == [[7, 8, 9]]


def test_plan_writes_back_blocks_whose_load_failed_once_vllm_recomputed_them() -> None:
    """Regression (issue 35): after '5 of 5 blocks could not be loaded; vLLM recomputes them' the
    recomputed blocks were never written back (they counted as stored), so the prompt stayed a miss."""
    plan = Planner(4, FakeLookup(hits=5))
    tokens = list(range(22))  # 5 full blocks, all in tiercache
    keys = block_keys(NS, tokens)
    assert plan.matched("r", tokens, (NS,), 0) == 20
    plan.allocated("r", [10, 11, 12, 13, 14, 15], num_external=20)
    loads, saves = plan.step([("r", 20, 2, [10, 11, 12, 13, 14, 15], True)])
    assert [t.block_ids for t in loads] == [[10, 11, 12, 13, 14]] and saves == []
    plan.load_failed({12, 99})  # the worker could load blocks 0-1 only; 99 is no block of this request
    # vLLM takes its computed tokens back to the first failed block and recomputes from there.
    loads, saves = plan.step([("r", 8, 14, None, False)])
    assert loads == [] and [(t.block_ids, t.chains, t.parents) for t in saves] == [([12, 13, 14], [keys[2:5]],
                                                                                     [keys[1]])]
    assert saves[0].prefix_block_ids == [10, 11]  # what they were computed over
    assert plan.step([("r", 22, 1, None, False)]) == ([], [])  # stored once
    # A request that shared the failed block through vLLM's prefix cache writes it back too.
    plan = Planner(4, FakeLookup(hits=2))
    assert plan.matched("s", tokens, (NS,), 8) == 0  # blocks 0-1 from vLLM's own prefix cache
    plan.allocated("s", [10, 11, 20, 21, 22, 23], 0)
    assert [t.block_ids for t in plan.step([("s", 8, 14, [10, 11, 20, 21, 22, 23], True)])[1]] == [[20, 21, 22]]
    plan.load_failed({11})
    assert [t.block_ids for t in plan.step([("s", 4, 18, None, False)])[1]] == [[11, 20, 21, 22]]


# ---- packing of vLLM's layouts ------------------------------------------------------------------

def cpu_cache(num_blocks: int, heads: int, tokens: int, dim: int, seed: int) -> torch.Tensor:
    return torch.randn(num_blocks, heads, tokens, 2 * dim, generator=torch.Generator().manual_seed(seed))


def test_cpu_packing_reads_k_rows_then_v_rows() -> None:
    layers = [cpu_cache(6, 2, 4, 8, seed) for seed in range(3)]
    packing = KVPacking("CPU_ATTN", layers, num_kv_heads=2, head_dim=8, block_size=4)
    blocks = packing.gather([4, 1])
    assert blocks.shape == (2, 3, 2, 2, 4, 8) and blocks.is_contiguous()
    for n, vb in enumerate([4, 1]):
        for layer, cache in enumerate(layers):
            slab = cache[vb].reshape(2, 8, 8)  # each head's (2 * block_size, head_size) rows
            assert torch.equal(blocks[n, layer, 0], slab[:, :4])  # K: the first block_size rows
            assert torch.equal(blocks[n, layer, 1], slab[:, 4:])  # V: the rest
    others = [layer.clone() for layer in layers]
    target = KVPacking("CPU_ATTN", others, num_kv_heads=2, head_dim=8, block_size=4)
    target.scatter(blocks, [0, 5])
    for layer, other in zip(layers, others):
        assert torch.equal(other[0], layer[4]) and torch.equal(other[5], layer[1])
        assert torch.equal(other[1:5], layer[1:5])  # nothing else written


def test_flash_attention_packing_reads_k_then_v_channels() -> None:
    cache = torch.randn(3, 2, 4, 16)
    blocks = KVPacking("FLASH_ATTN", [cache], num_kv_heads=2, head_dim=8, block_size=4).gather([2])
    assert torch.equal(blocks[0, 0, 0], cache[2, :, :, :8]) and torch.equal(blocks[0, 0, 1], cache[2, :, :, 8:])


def test_packing_refuses_what_it_cannot_copy() -> None:
    with pytest.raises(UnsupportedLayout, match="attention backend 'TRITON_ATTN' is not supported"):
        KVPacking("TRITON_ATTN", [torch.zeros(2, 2, 4, 16)], num_kv_heads=2, head_dim=8, block_size=4)
    with pytest.raises(UnsupportedLayout, match=r"KV layer 0 has shape \(2, 2, 4, 12\)"):
        KVPacking("CPU_ATTN", [torch.zeros(2, 2, 4, 12)], num_kv_heads=2, head_dim=8, block_size=4)
    with pytest.raises(UnsupportedLayout, match="cannot be viewed"):
        KVPacking("CPU_ATTN", [torch.zeros(2, 4, 2, 16).transpose(1, 2)], num_kv_heads=2, head_dim=8, block_size=4)


# ---- the worker's transfers through a real daemon -----------------------------------------------

REAL = Namespace(model="llama/real", weights="w", dtype="float32", num_layers=8, num_kv_heads=8, head_dim=64,
                 block_tokens=128, adapter="engine=vllm;tp=0/1")  # 4 MiB blocks, as scripts/bench_vllm.py


@pytest.fixture
def daemon() -> str:
    base = short_dir()
    config = small_config(base, disk_bytes=256 << 20)
    config = dataclasses.replace(config, host=HostConfig(capacity_bytes=96 << 20, shm_dir=config.host.shm_dir),
                                 store=StoreConfig(max_block_bytes=8 << 20))
    try:
        with running_server(config) as (_, address):
            yield address
    finally:
        cleanup(base)


def test_worker_round_trip_of_real_sized_blocks_and_misses(daemon: str) -> None:
    socket = daemon.removeprefix("unix:")
    layers = [cpu_cache(12, 8, 128, 64, seed) for seed in range(8)]
    source = KVTransfer(DaemonLink(ConnectorSettings(socket=socket)),
                        KVPacking("CPU_ATTN", layers, num_kv_heads=8, head_dim=64, block_size=128), 0, 64)
    tokens = list(range(5 * 128))
    keys = block_keys(REAL, tokens)
    plan = Planner(128, source.link.lookup)
    assert plan.matched("a", tokens, (REAL,), 0) == 0
    plan.allocated("a", [3, 7, 0, 9, 2], 0)
    _, saves = plan.step([("a", 0, len(tokens), [3, 7, 0, 9, 2], True)])
    source.save(saves[0])
    assert source.flush(30.0) and source.num_saved == 5
    with Client(daemon) as client:
        assert client.lookup(keys) == ["host"] * 5
        stored = client.fetch(keys[:1])[0]
        assert stored.meta.shape == (8, 2, 8, 128, 64) and stored.meta.parent == b""
    # Another worker (a fresh vLLM) loads them into other blocks of its own cache.
    others = [torch.zeros(12, 8, 128, 128) for _ in range(8)]
    sink = KVTransfer(DaemonLink(ConnectorSettings(socket=socket)),
                      KVPacking("CPU_ATTN", others, num_kv_heads=8, head_dim=64, block_size=128), 0, 64)
    plan = Planner(128, sink.link.lookup)
    assert plan.matched("b", tokens, (REAL,), 0) == 5 * 128 - 1
    plan.allocated("b", [11, 1, 4, 5, 6], 5 * 128 - 1)
    loads, _ = plan.step([("b", 5 * 128 - 1, 1, [11, 1, 4, 5, 6], True)])
    assert sink.load(loads[0]) == []
    for src, dst in zip(layers, others):
        for a, b in zip([3, 7, 0, 9, 2], [11, 1, 4, 5, 6]):
            assert torch.equal(dst[b], src[a])
    # Blocks the daemon does not hold come back as failed vLLM block ids: vLLM recomputes them.
    partial = dataclasses.replace(loads[0], chains=[keys[:2] + [b"\x01" * 32] * 3])
    assert sink.load(partial) == [4, 5, 6] and sink.num_load_failed == 3
    source.close()
    sink.close()


def test_worker_writes_no_block_computed_over_a_failed_load_until_it_is_recomputed(daemon: str) -> None:
    """A failed load leaves zeros in vLLM's block until vLLM recomputes it: what was computed over it
    meanwhile (this step, or a step vLLM scheduled before it heard of the failure) is not written back;
    once the scheduler names the block as recomputing, the same blocks are."""
    socket = daemon.removeprefix("unix:")
    layers = [cpu_cache(8, 8, 128, 64, seed) for seed in range(8)]
    worker = KVTransfer(DaemonLink(ConnectorSettings(socket=socket)),
                        KVPacking("CPU_ATTN", layers, num_kv_heads=8, head_dim=64, block_size=128), 0, 64)
    tokens = list(range(4 * 128))
    keys = block_keys(REAL, tokens)
    plan = Planner(128, lambda chains: 2)  # as if the daemon held blocks 0-1; it holds none
    assert plan.matched("r", tokens, (REAL,), 0) == 256
    plan.allocated("r", [5, 6, 7, 1], 256)
    loads, saves = plan.step([("r", 256, 256, [5, 6, 7, 1], True)])
    assert worker.load(loads[0]) == [5, 6]
    worker.save(saves[0])  # blocks 2-3, computed over the two that failed
    assert worker.flush(30.0) and (worker.num_saved, worker.num_save_unfilled) == (0, 2)
    plan.load_failed({5, 6})
    worker.recomputing([5, 6])
    _, saves = plan.step([("r", 0, 512, None, False)])  # vLLM recomputes the whole prompt
    worker.save(saves[0])
    assert worker.flush(30.0) and worker.num_saved == 4
    with Client(daemon) as client:
        assert client.lookup(keys) == ["host"] * 4
    worker.close()


def test_a_daemon_that_is_gone_is_a_miss_and_left_alone() -> None:
    link = DaemonLink(ConnectorSettings(socket="/tmp/tc-no-such-daemon.sock", timeout_ms=300, retry_after_s=60))
    assert link.lookup([block_keys(NS, list(range(8)))]) == 0 and link.num_failures == 1
    assert link.fetch_into([b"\x00" * 32], [torch.zeros(4)]) == 0
    assert link.num_failures == 1 and link.num_skipped == 1  # not asked again until retry_after_s
    link.close()


def test_a_vllm_on_another_machine_reaches_the_daemon_over_tcp_as_its_tenant() -> None:
    base = short_dir()
    config = small_config(base, disk_bytes=64 << 20, listen="127.0.0.1:0", tokens={"tok-lab": "lab"})
    config = dataclasses.replace(config, store=StoreConfig(max_block_bytes=2 << 20))
    try:
        with running_server(config) as (_, address):
            assert not address.startswith("unix:")
            token_file = pathlib.Path(base, "token")
            token_file.write_text("tok-lab\n")
            settings = ConnectorSettings.from_extra_config({"address": address, "token_file": str(token_file)})
            ns = dataclasses.replace(REAL, num_layers=2, num_kv_heads=2)
            layers = [cpu_cache(6, 2, 128, 64, seed) for seed in range(2)]
            source = KVTransfer(DaemonLink(settings), KVPacking("CPU_ATTN", layers, num_kv_heads=2, head_dim=64,
                                                                block_size=128), 0, 8)
            tokens = list(range(3 * 128))
            plan = Planner(128, source.link.lookup)
            plan.matched("a", tokens, (ns,), 0)
            plan.allocated("a", [5, 0, 2], 0)
            source.save(plan.step([("a", 0, len(tokens), [5, 0, 2], True)])[1][0])
            assert source.flush(30.0) and source.num_saved == 3
            others = [torch.zeros(6, 2, 128, 128) for _ in range(2)]
            sink = KVTransfer(DaemonLink(settings), KVPacking("CPU_ATTN", others, num_kv_heads=2, head_dim=64,
                                                              block_size=128), 0, 8)
            plan = Planner(128, sink.link.lookup)
            assert plan.matched("b", tokens, (ns,), 0) == len(tokens) - 1
            plan.allocated("b", [1, 3, 4], len(tokens) - 1)
            assert sink.load(plan.step([("b", len(tokens) - 1, 1, [1, 3, 4], True)])[0][0]) == []
            for src, dst in zip(layers, others):
                assert [torch.equal(dst[b], src[a]) for a, b in zip([5, 0, 2], [1, 3, 4])] == [True] * 3
            with Client(f"unix:{config.server.socket}") as local:  # another tenant sees none of it
                assert local.lookup(block_keys(ns, tokens)) == []
            source.close()
            sink.close()
    finally:
        cleanup(base)


def test_bfloat16_blocks_copy_bit_for_bit() -> None:
    layers = [cpu_cache(3, 2, 4, 8, seed).to(torch.bfloat16) for seed in range(2)]
    packing = KVPacking("CPU_ATTN", layers, num_kv_heads=2, head_dim=8, block_size=4)
    blocks = packing.gather([2])
    assert blocks.dtype == torch.bfloat16 and torch.equal(blocks[0, 1, 1], layers[1][2].reshape(2, 8, 8)[:, 4:])
    packing.scatter(blocks, [0])
    assert all(torch.equal(layer[0], layer[2]) for layer in layers)


def test_zero_clears_one_block_in_every_layer() -> None:
    layers = [cpu_cache(3, 2, 4, 8, seed) for seed in range(2)]
    before = [layer.clone() for layer in layers]
    KVPacking("CPU_ATTN", layers, num_kv_heads=2, head_dim=8, block_size=4).zero(1)
    for layer, old in zip(layers, before):
        assert layer[1].count_nonzero() == 0 and torch.equal(layer[0], old[0]) and torch.equal(layer[2], old[2])
