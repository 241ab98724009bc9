"""Cached prefix + suffix prefill equals a full recompute, for tiny Llama (GQA) and GPT-2 models."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
)

from tiercache.errors import InvalidArgument
from tiercache.keys import Namespace, block_keys, tail_keys
from tiercache.layout import BlockLayout
from tiercache.worker.geometry import KVGeometry, ProbeMemo, kv_geometry, probe_kv
from tiercache.worker.kvcache import (
    GROWTH_MIN_TOKENS,
    ReservedLayer,
    _segments,
    blocks_to_cache,
    cache_to_blocks,
    first_held_token,
    greedy_generate,
    hold_sliding_layers,
    new_cache,
    prefill,
)
from tiercache.worker.model import ByteTokenizer, namespace_for, wrap_model

BLOCK = 16
TOL = 1e-4
VOCAB = ByteTokenizer.vocab_size


def _seeded(build, seed: int = 0) -> PreTrainedModel:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build().eval()


@pytest.fixture(scope="module")
def llama() -> PreTrainedModel:
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                         initializer_range=0.1, attn_implementation="eager")
    return _seeded(lambda: LlamaForCausalLM(config))


@pytest.fixture(scope="module")
def gpt2() -> PreTrainedModel:
    config = GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=1024,
                        initializer_range=0.1, bos_token_id=1, eos_token_id=2, attn_implementation="eager")
    return _seeded(lambda: GPT2LMHeadModel(config))


@pytest.fixture(params=["llama", "gpt2"])
def model(request: pytest.FixtureRequest) -> PreTrainedModel:
    return request.getfixturevalue(request.param)


def _layout(model: PreTrainedModel) -> BlockLayout:
    g = kv_geometry(model.config)
    return BlockLayout(g.num_layers, g.num_kv_heads, g.head_dim, BLOCK, "float32")


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_kv_geometry_reads_each_family(llama: PreTrainedModel, gpt2: PreTrainedModel) -> None:
    assert (kv_geometry(llama.config).num_kv_heads, kv_geometry(llama.config).head_dim) == (2, 16)
    assert kv_geometry(gpt2.config).num_kv_heads == 4  # GPT-2 is plain multi-head: kv heads == heads
    assert (kv_geometry(gpt2.config).num_layers, kv_geometry(gpt2.config).head_dim) == (2, 16)


# (prefix the two prompts share, tokens reused from the cache):
#   37 shared, only the 2 full blocks reused (prefix ends inside a block);
#   48 shared, 3 full blocks reused (exactly on a block boundary);
#   37 shared, 2 full blocks + a 5-token breakpoint tail reused.
@pytest.mark.parametrize(("shared", "reused"), [(37, 32), (48, 48), (37, 37)],
                         ids=["inside-block", "on-boundary", "breakpoint-tail"])
def test_cached_prefix_matches_full_recompute(model: PreTrainedModel, shared: int, reused: int) -> None:
    layout = _layout(model)
    prompt = _tokens(shared + 11, seed=1)
    full_logits, full_cache = prefill(model, prompt, None)
    expected = greedy_generate(model, full_cache, full_logits, 8)

    # The prefix's KV comes from an earlier request that saw only the shared tokens.
    _, prefix_cache = prefill(model, prompt[:shared], None)
    blocks = cache_to_blocks(prefix_cache, layout, 0, reused)
    assert [b.shape[3] for b in blocks] == [BLOCK] * (reused // BLOCK) + ([reused % BLOCK] if reused % BLOCK else [])
    assert all(b.is_contiguous() and b.device.type == "cpu" and b.shape[:3] == layout.shape()[:3] for b in blocks)

    cache = blocks_to_cache(blocks, model)
    assert cache.get_seq_length() == reused
    logits, cache = prefill(model, prompt[reused:], cache)
    diff = (logits - full_logits).abs().max().item()
    assert diff < TOL, f"max abs diff {diff}"
    assert greedy_generate(model, cache, logits, 8) == expected


def test_greedy_generate_matches_transformers_generate(llama: PreTrainedModel) -> None:
    prompt = _tokens(40, seed=2)
    _, prefix_cache = prefill(llama, prompt[:32], None)
    cache = blocks_to_cache(cache_to_blocks(prefix_cache, _layout(llama), 0, 32), llama)
    logits, cache = prefill(llama, prompt[32:], cache)
    with torch.inference_mode():
        reference = llama.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert greedy_generate(llama, cache, logits, 8) == reference[0, len(prompt):].tolist()


def test_reserved_room_takes_the_suffix_and_generated_tokens_in_place(llama: PreTrainedModel) -> None:
    prompt = _tokens(40, seed=6)
    _, prefix_cache = prefill(llama, prompt[:32], None)
    cache = blocks_to_cache(cache_to_blocks(prefix_cache, _layout(llama), 0, 32), llama, reserve_tokens=8 + 8)
    layers = cache.layers
    assert all(isinstance(layer, ReservedLayer) for layer in layers)
    rooms = [layer.room for layer in layers]
    assert all(room is not None and room.shape[-2] == 32 + 16 for room in rooms)
    first_keys = layers[0].keys
    first_seen = first_keys.clone()
    logits, cache = prefill(llama, prompt[32:], cache)
    with torch.inference_mode():
        reference = llama.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert greedy_generate(llama, cache, logits, 8) == reference[0, len(prompt):].tolist()
    # Nothing was appended by copying: the suffix and 7 fed-back tokens were written into the rooms.
    assert [layer.room for layer in cache.layers] == rooms and cache.get_seq_length() == 40 + 7
    assert torch.equal(first_keys, first_seen)  # a view taken earlier still shows what it showed


def test_a_layer_out_of_room_moves_and_keeps_every_token(llama: PreTrainedModel) -> None:
    """No reserve at all: generating past the room moves each layer to a bigger one, and the
    tokens stay right (same text as transformers' own generate); a crop, then more tokens,
    overwrite only what the crop dropped; a view taken before a move still holds its tokens."""
    prompt = _tokens(24, seed=7)
    steps = GROWTH_MIN_TOKENS + 20
    logits, cache = prefill(llama, prompt, new_cache(llama))
    layer = cache.layers[0]
    assert isinstance(layer, ReservedLayer) and layer.room is not None and layer.room.shape[-2] == 24
    before = layer.keys.clone()
    view = layer.keys
    with torch.inference_mode():
        reference = llama.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False, pad_token_id=0)
    assert greedy_generate(llama, cache, logits, steps) == reference[0, len(prompt):].tolist()
    assert layer.room.shape[-2] >= 24 + steps - 1 and torch.equal(view, before)
    held = cache.get_seq_length()
    kept = layer.keys[:, :, : held - 5].clone()
    cache.crop(-5)
    logits, cache = prefill(llama, reference[0, len(prompt) + steps - 6 : len(prompt) + steps - 1].tolist(), cache)
    assert cache.get_seq_length() == held and torch.equal(layer.keys[:, :, : held - 5], kept)
    with torch.inference_mode():
        full = llama(reference[:, : len(prompt) + steps - 1]).logits[0, -1]
    assert (logits - full).abs().max().item() < TOL


def test_a_reserved_layer_whose_tokens_were_replaced_starts_a_new_room() -> None:
    """What transformers' beam and batch helpers do (keys = keys[indices]): the replaced tokens are
    the ones the next update extends, not the room's old ones."""
    layer = ReservedLayer(reserve_tokens=8)
    first, second = torch.randn(2, 1, 2, 4, 16), torch.randn(2, 1, 2, 3, 16)
    layer.update(first[0], first[1])
    old_room = layer.room
    replaced = torch.randn(1, 2, 4, 16)
    layer.keys, layer.values = replaced, replaced + 1
    keys, values = layer.update(second[0], second[1])
    assert layer.room is not old_room
    assert torch.equal(keys, torch.cat([replaced, second[0]], dim=-2))
    assert torch.equal(values, torch.cat([replaced + 1, second[1]], dim=-2))


def test_a_reset_reserved_layer_writes_into_a_new_room() -> None:
    layer = ReservedLayer(reserve_tokens=8)
    first, second = torch.randn(2, 1, 2, 4, 16), torch.randn(2, 1, 2, 3, 16)
    keys, _ = layer.update(first[0], first[1])
    room = layer.room
    layer.reset()
    assert layer.get_seq_length() == 0
    again, _ = layer.update(second[0], second[1])
    assert layer.room is not room and torch.equal(again, second[0])
    assert torch.equal(keys, first[0])  # the tokens held before the reset were not written over


def test_a_cache_filled_in_inference_mode_takes_tokens_outside_it(llama: PreTrainedModel) -> None:
    """A miss's cache is first written inside prefill's inference mode, where its rooms become
    inference tensors, which torch will not write into outside it: such an update moves instead."""
    _, cache = prefill(llama, _tokens(20, seed=8), None, reserve_tokens=8)
    layer = cache.layers[0]
    assert isinstance(layer, ReservedLayer) and layer.room is not None and layer.room.is_inference()
    held = layer.keys.clone()
    extra = torch.randn(2, 1, 2, 4, 16)
    with torch.no_grad():
        keys, values = layer.update(extra[0], extra[1])
    assert not layer.room.is_inference() and keys.shape[-2] == 24
    assert torch.equal(keys[:, :, :20], held) and torch.equal(keys[:, :, 20:], extra[0])
    assert torch.equal(values[:, :, 20:], extra[1])


def _gemma2_prefix(seed: int) -> tuple[PreTrainedModel, list[int], torch.Tensor, list[torch.Tensor]]:
    """A tiny Gemma-2 (sliding-window and full-attention layers alternate), a 48-token prompt, its
    full-recompute logits and the blocks of its first 32 tokens."""
    config = Gemma2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=64,
                          attn_implementation="eager")
    model = _seeded(lambda: Gemma2ForCausalLM(config))
    prompt = _tokens(48, seed=seed)
    full_logits, _ = prefill(model, prompt, None)
    _, prefix_cache = prefill(model, prompt[:32], None)
    g = kv_geometry(model.config)
    layout = BlockLayout(g.num_layers, g.num_kv_heads, g.head_dim, BLOCK, "float32")
    return model, prompt, full_logits, cache_to_blocks(prefix_cache, layout, 0, 32)


def test_sliding_and_full_layers_in_one_model_match_a_full_recompute() -> None:
    """Gemma-2 alternates sliding-window and full-attention layers: only the full ones get a room,
    each its own allocation, and cached prefix + suffix + generation equal a full recompute."""
    model, prompt, full_logits, blocks = _gemma2_prefix(seed=9)
    cache = blocks_to_cache(blocks, model, reserve_tokens=16 + 24)
    rooms = [layer.room for layer in cache.layers if isinstance(layer, ReservedLayer)]
    assert 0 < len(rooms) < len(cache.layers), [type(layer).__name__ for layer in cache.layers]
    assert all(room.untyped_storage().nbytes() == room.numel() * room.element_size() for room in rooms)
    logits, cache = prefill(model, prompt[32:], cache)
    assert (logits - full_logits).abs().max().item() < TOL
    with torch.inference_mode():
        reference = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, pad_token_id=0)
    assert greedy_generate(model, cache, logits, 24) == reference[0, len(prompt):].tolist()


def test_held_sliding_layers_let_a_prompt_past_the_window_be_cut_then_return_to_it() -> None:
    """Gemma-2 with a 64-token window and a 160-token prompt: held, its sliding layers keep all 160
    tokens (so every block can be cut); released, the last 63 only, and the cut blocks, fed back as
    a prefix, give the same scores and tokens as a full recompute."""
    model, _, _, _ = _gemma2_prefix(seed=3)
    prompt = _tokens(176, seed=4)
    full_logits, _ = prefill(model, prompt, None)
    g = kv_geometry(model.config)
    layout = BlockLayout(g.num_layers, g.num_kv_heads, g.head_dim, BLOCK, "float32")
    cache = new_cache(model)
    with pytest.raises(InvalidArgument, match="holds tokens"):  # without holding: the window let them go
        prefill(model, prompt[:160], cache)
        cache_to_blocks(cache, layout, 0, 160)
    cache = new_cache(model)
    hold_sliding_layers(cache, True)
    _, cache = prefill(model, prompt[:160], cache)
    assert first_held_token(cache) == 0
    blocks = cache_to_blocks(cache, layout, 0, 160)
    hold_sliding_layers(cache, False)
    assert first_held_token(cache) == 160 - 63
    assert {layer.keys.shape[-2] for layer in cache.layers if getattr(layer, "is_sliding", False)} == {63}
    logits, cache = prefill(model, prompt[160:], blocks_to_cache(blocks, model, reserve_tokens=16 + 8))
    assert (logits - full_logits).abs().max().item() < TOL
    with torch.inference_mode():
        reference = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert greedy_generate(model, cache, logits, 8) == reference[0, len(prompt):].tolist()


def test_blocks_round_trip_bit_exact(model: PreTrainedModel) -> None:
    _, cache = prefill(model, _tokens(40, seed=3), None)
    rebuilt = blocks_to_cache(cache_to_blocks(cache, _layout(model), 0, 40), model)
    for original, copy in zip(cache.layers, rebuilt.layers, strict=True):
        assert torch.equal(original.keys, copy.keys) and torch.equal(original.values, copy.values)


def _placed(blocks: list[torch.Tensor], gap: int) -> list[torch.Tensor]:
    """Copies of the blocks in one buffer, `gap` elements before each (0: back to back; else like
    records with headers), as views of it."""
    stride = blocks[0].numel() + gap
    buffer = torch.full((len(blocks) * stride,), float("nan"))
    views = [buffer[i * stride + gap : i * stride + gap + b.numel()].view(b.shape) for i, b in enumerate(blocks)]
    for view, block in zip(views, blocks):
        view.copy_(block)
    return views


def test_blocks_in_one_buffer_fill_the_cache_a_run_at_a_time(llama: PreTrainedModel) -> None:
    """Blocks at even steps in one buffer (slab views, a disk read) are copied a run at a time; every
    placement, runs mixed with loose blocks and a shorter tail included, fills the same cache."""
    _, cache = prefill(llama, _tokens(8 * BLOCK + 8, seed=21), None)
    blocks = cache_to_blocks(cache, _layout(llama), 0, 8 * BLOCK + 8)  # 8 full blocks and a tail of 8 tokens
    reference = blocks_to_cache(blocks, llama, reserve_tokens=4)
    mixed = [*_placed(blocks[:3], 0), blocks[3].clone(), *_placed(blocks[4:8], 5), blocks[8]]
    placements = {"back to back": _placed(blocks[:8], 0) + [blocks[8]],
                  "with gaps": _placed(blocks[:8], 7) + [blocks[8]], "mixed": mixed}
    for name, placed in placements.items():
        built = blocks_to_cache(placed, llama, reserve_tokens=4)
        for want, got in zip(reference.layers, built.layers, strict=True):
            assert torch.equal(want.keys, got.keys) and torch.equal(want.values, got.values), name
    assert [(lo, hi, span is not None) for lo, hi, _, span in _segments(mixed)] == [
        (0, 3, True), (3, 4, False), (4, 8, True), (8, 9, False)]
    assert [(lo, hi, span is not None) for lo, hi, _, span in _segments(placements["with gaps"])] == [
        (0, 8, True), (8, 9, False)]


def _same_cache(model: PreTrainedModel, blocks: list[torch.Tensor], placed: list[torch.Tensor]) -> None:
    want, got = blocks_to_cache([b.clone() for b in blocks], model, 4), blocks_to_cache(placed, model, 4)
    for a, b in zip(want.layers, got.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_blocks_in_one_buffer_that_do_not_continue_a_run_end_it(llama: PreTrainedModel) -> None:
    """In one buffer, a block that is not one more step on (another step, other strides, a shorter
    tail) ends the run before it; views of one tensor split along the tokens (not contiguous) form
    runs with their own strides."""
    _, cache = prefill(llama, _tokens(6 * BLOCK + 8, seed=22), None)
    blocks = cache_to_blocks(cache, _layout(llama), 0, 6 * BLOCK + 8)  # 6 full blocks and a tail of 8 tokens
    size = blocks[0].numel()
    buffer = torch.full((16 * size,), float("nan"))
    starts = [0, size, 2 * size, 4 * size, 5 * size, 6 * size]  # a step of one block, then two, then one
    uneven = [buffer[at : at + size].view(b.shape) for at, b in zip(starts, blocks)]
    tail_at = 7 * size  # one more step after block 5: the tail's shape still ends the run
    uneven.append(buffer[tail_at : tail_at + blocks[6].numel()].view(blocks[6].shape))
    for view, block in zip(uneven, blocks):
        view.copy_(block)
    _same_cache(llama, blocks, uneven)
    _same_cache(llama, [blocks[2], blocks[1], blocks[0]], uneven[2::-1])  # steps back: no run
    _same_cache(llama, [blocks[1]] * 3, [uneven[1]] * 3)  # the same block again: a step of 0
    assert [(lo, hi, span is not None) for lo, hi, _, span in _segments(uneven)] == [
        (0, 3, True), (3, 6, True), (6, 7, False)]
    # Other strides in the same buffer: block 2 laid out tokens-first, with the same shape.
    shape = blocks[2].shape
    region = buffer[2 * size : 3 * size]
    permuted = region.view(shape[3], shape[0], shape[1], shape[2], shape[4]).permute(1, 2, 3, 0, 4)
    permuted.copy_(blocks[2])
    strided = [*uneven[:2], permuted, uneven[3]]
    _same_cache(llama, blocks[:4], strided)
    assert [(lo, hi, span is not None) for lo, hi, _, span in _segments(strided)] == [(0, 2, True), (2, 4, False)]
    # cache_to_blocks' own split, before its .contiguous(): token slices of one tensor, not contiguous.
    whole = torch.stack([torch.stack([layer.keys[0], layer.values[0]]) for layer in cache.layers])
    split = list(torch.split(whole[:, :, :, : 6 * BLOCK], BLOCK, dim=3))
    assert not split[0].is_contiguous()
    _same_cache(llama, blocks[:6], split)
    assert [(lo, hi, span is not None) for lo, hi, _, span in _segments(split)] == [(0, 6, True)]


def test_runs_fill_sliding_window_layers_too() -> None:
    """Gemma-2's sliding-window layers take their tokens from the same segments as its full ones."""
    model, prompt, full_logits, blocks = _gemma2_prefix(seed=23)
    placed = _placed(blocks, 3)
    assert _segments(placed)[0][3] is not None
    logits, _ = prefill(model, prompt[32:], blocks_to_cache(placed, model, reserve_tokens=16))
    assert (logits - full_logits).abs().max().item() < TOL


def test_blocks_in_two_storages_at_one_address_are_not_read_past_the_first() -> None:
    """Two storages may start at one address (two tensors over one buffer): blocks in them at an even
    step are no run when the span would leave the first block's storage; they are concatenated."""
    first, second = torch.randn(2, 2, 1, 3, 4), torch.randn(2, 2, 1, 3, 4)
    raw = bytearray(2 * first.numel() * 4)
    short = torch.frombuffer(raw, dtype=torch.float32, count=first.numel())  # its storage: the first half
    whole = torch.frombuffer(raw, dtype=torch.float32)
    a, b = short.view(first.shape), whole[first.numel() :].view(second.shape)
    a.copy_(first)
    b.copy_(second)
    assert _segments([a, b]) == [(0, 2, 6, None)]
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=8, intermediate_size=8, num_hidden_layers=2,
                         num_attention_heads=1, num_key_value_heads=1, head_dim=4)
    model = LlamaForCausalLM(config).eval()
    cache = blocks_to_cache([a, b], model)
    assert torch.equal(cache.layers[1].keys[0], torch.cat([first[1, 0], second[1, 0]], dim=1))
    assert _segments([whole[: first.numel()].view(first.shape), b])[0][3] is not None  # in one storage: a run


def test_cache_to_blocks_slices_from_a_later_block(llama: PreTrainedModel) -> None:
    _, cache = prefill(llama, _tokens(50, seed=4), None)
    layout = _layout(llama)
    whole = cache_to_blocks(cache, layout, 0, 50)
    later = cache_to_blocks(cache, layout, 16, 40)
    assert [b.shape[3] for b in later] == [16, 8]
    assert torch.equal(later[0], whole[1]) and torch.equal(later[1], whole[2][:, :, :, :8])


def test_bad_input_raises_invalid_argument(llama: PreTrainedModel) -> None:
    layout = _layout(llama)
    _, cache = prefill(llama, _tokens(20, seed=5), None)
    with pytest.raises(InvalidArgument, match="multiple of block_tokens"):
        cache_to_blocks(cache, layout, 3, 20)
    with pytest.raises(InvalidArgument, match="holds tokens"):
        cache_to_blocks(cache, layout, 0, 21)
    with pytest.raises(InvalidArgument, match="layout expects float16"):
        cache_to_blocks(cache, BlockLayout(2, 2, 16, BLOCK, "float16"), 0, 16)
    with pytest.raises(InvalidArgument, match="layers"):
        cache_to_blocks(cache, BlockLayout(3, 2, 16, BLOCK, "float32"), 0, 16)
    block = cache_to_blocks(cache, layout, 0, 16)[0]
    with pytest.raises(InvalidArgument, match="block 1 has shape"):
        blocks_to_cache([block, block[:, :, :1]], llama)
    with pytest.raises(InvalidArgument, match="block 0 is float16"):
        blocks_to_cache([block.half()], llama)
    with pytest.raises(InvalidArgument, match="at least one token"):
        prefill(llama, [], None)


def test_sliding_window_prefix_within_window_only() -> None:
    config = MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=40,
                           attn_implementation="eager")
    mistral = _seeded(lambda: MistralForCausalLM(config))
    prompt = _tokens(60, seed=6)
    full, _ = prefill(mistral, prompt, None)
    _, short = prefill(mistral, prompt[:32], None)  # within the window: every token still held
    rebuilt = blocks_to_cache(cache_to_blocks(short, _layout(mistral), 0, 32), mistral)
    assert type(rebuilt.layers[0]).__name__ == "DynamicSlidingWindowLayer"  # the config chose the layer class
    logits, _ = prefill(mistral, prompt[32:], rebuilt)
    assert (logits - full).abs().max().item() < TOL
    _, long = prefill(mistral, prompt[:48], None)  # past the window: tokens 0..8 were dropped
    with pytest.raises(InvalidArgument, match=r"holds tokens \[9, 48\)"):
        cache_to_blocks(long, _layout(mistral), 0, 48)


def _lookup(store: dict[bytes, torch.Tensor], namespace: Namespace, prompt: list[int],
            breakpoints: list[int]) -> tuple[list[torch.Tensor], int]:
    """The worker's lookup: the longest run of present full blocks, then a breakpoint tail just after it."""
    keys = block_keys(namespace, prompt)
    found: list[torch.Tensor] = []
    for key in keys:
        if key not in store:
            break
        found.append(store[key])
    cached = len(found) * namespace.block_tokens
    for point, key in sorted(tail_keys(namespace, prompt, breakpoints, keys).items(), reverse=True):
        if cached < point < cached + namespace.block_tokens and key in store:
            found.append(store[key])
            cached = point
            break
    return found, cached


def test_system_prompt_409_tokens_reused_whole_by_two_questions(llama: PreTrainedModel) -> None:
    tokenizer = ByteTokenizer()
    namespace = namespace_for(wrap_model(llama, tokenizer, "test/tiny-llama"), block_tokens=BLOCK)
    layout = BlockLayout.of(namespace)
    system = tokenizer.encode(("You are a terse assistant for a home NAS. " * 10)[:408])
    assert len(system) == 409

    # Cache the system prompt once: 25 full blocks + a 9-token tail under its breakpoint key.
    _, cache = prefill(llama, system, None)
    blocks = cache_to_blocks(cache, layout, 0, len(system))
    keys = block_keys(namespace, system)
    tail = tail_keys(namespace, system, [409], keys)
    assert len(keys) == 25 and list(tail) == [409] and blocks[-1].shape[3] == 9
    store = dict(zip([*keys, tail[409]], blocks, strict=True))

    scores = []
    for question in ("Why?", "Size?"):
        prompt = system + tokenizer.encode(question, add_bos=False)
        found, cached = _lookup(store, namespace, prompt, [409])
        assert cached == 409 and len(found) == 26
        computed = len(prompt) - cached
        assert computed / len(prompt) < 0.02, f"computed {computed} of {len(prompt)} tokens"
        logits, _ = prefill(llama, prompt[cached:], blocks_to_cache(found, llama))
        full, _ = prefill(llama, prompt, None)
        diff = (logits - full).abs().max().item()
        assert diff < TOL, f"{question!r}: max abs diff {diff}"
        scores.append(logits)
    assert not torch.allclose(scores[0], scores[1])  # the questions really were answered separately
    assert len(store) == 26 and torch.equal(store[tail[409]], blocks[-1])  # reuse never mutates stored blocks


def test_probe_kv_names_layers_that_share_another_layers_kv() -> None:
    # Gemma-3n's shared-KV layers are placeholders in the cache: nothing to cut into blocks.
    cfg = AutoConfig.for_model("gemma3n_text", vocab_size=259, hidden_size=64, intermediate_size=128,
                               num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                               max_position_embeddings=2048,
                               sliding_window=40, num_kv_shared_layers=2, laurel_rank=8, altup_num_inputs=2,
                               layer_types=["sliding_attention", "full_attention"] * 2, hidden_size_per_layer_input=8,
                               vocab_size_per_layer_input=259, activation_sparsity_pattern=[0.0] * 4,
                               attn_implementation="eager")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg).eval()
    geometry, why = probe_kv(model)
    assert "DummyLayer" in why and geometry == kv_geometry(cfg)
    assert probe_kv(model) == (geometry, why)  # probed once per model


class _Model:
    """Stands in for a model in the memo's own tests: weakly referable, compared by identity."""


def test_probe_memo_keeps_only_the_most_recently_used_models() -> None:
    memo = ProbeMemo(max_models=2)
    a, b, c = _Model(), _Model(), _Model()
    answer = (KVGeometry(1, 1, 1), "")
    memo.put(a, answer)
    memo.put(b, answer)
    assert memo.get(a) == answer  # a is now the most recently used: b goes first
    memo.put(c, answer)
    assert len(memo) == 2 and memo.get(b) is None and memo.get(a) == answer and memo.get(c) == answer
    with pytest.raises(ValueError, match="max_models"):
        ProbeMemo(max_models=0)


def test_probe_memo_does_not_keep_a_model_alive_nor_answer_for_a_dead_one() -> None:
    import gc
    import weakref

    memo = ProbeMemo(max_models=4)
    model = _Model()
    gone = weakref.ref(model)
    address = id(model)
    memo.put(model, (KVGeometry(1, 1, 1), ""))
    del model
    gc.collect()
    assert gone() is None, "the memo kept a model its owner dropped"
    for _ in range(1000):  # CPython soon hands the dead model's address to a new object of its size
        newcomer = _Model()
        if id(newcomer) == address:
            assert memo.get(newcomer) is None, "a new model got a dead one's answer"
            break
    memo.put(_Model(), (KVGeometry(2, 2, 2), ""))  # a put forgets entries of dead models
    assert len(memo) <= 1


def test_probe_memo_stays_bounded_and_consistent_under_threads() -> None:
    import threading

    memo = ProbeMemo(max_models=3)
    models = [_Model() for _ in range(12)]
    answers = {id(m): (KVGeometry(i + 1, 1, 1), "") for i, m in enumerate(models)}
    errors: list[str] = []

    def hammer(seed: int) -> None:
        for step in range(3000):
            model = models[(seed * 7 + step) % len(models)]
            found = memo.get(model)
            if found is not None and found != answers[id(model)]:
                errors.append(f"{found} for model {models.index(model)}")
            memo.put(model, answers[id(model)])
            if len(memo) > memo.max_models:
                errors.append(f"{len(memo)} entries")

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors[:5] and len(memo) <= 3


def test_probe_kv_remembers_a_bounded_number_of_models(monkeypatch) -> None:
    from tiercache.worker import geometry as kvcache

    assert kvcache._probed.max_models == kvcache.MAX_PROBED_MODELS  # the process-wide memo is bounded too
    monkeypatch.setattr(kvcache, "_probed", ProbeMemo(max_models=2))
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, attn_implementation="eager")
    models = [_seeded(lambda: LlamaForCausalLM(config), seed) for seed in range(3)]  # noqa: B023 - called at once
    calls = [0, 0, 0]
    for i, m in enumerate(models):
        m.register_forward_pre_hook(lambda module, args, i=i: calls.__setitem__(i, calls[i] + 1))
    for m in models:
        assert probe_kv(m) == (KVGeometry(1, 1, 16), "")
    assert len(kvcache._probed) == 2 and calls == [1, 1, 1]
    probe_kv(models[2])  # remembered
    probe_kv(models[0])  # forgotten by now: probed again
    assert calls == [2, 1, 1]
