"""Conversion between a transformers KV cache and canonical blocks, plus suffix-only prefill and greedy decoding."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionCacheLayerMixin

from tiercache.errors import InvalidArgument
from tiercache.layout import DTYPE_NAMES, BlockLayout
from tiercache.worker.geometry import KVGeometry, KVPairs, cache_argument, forward_params, layer_kv, probe_kv

logger = logging.getLogger(__name__)


def hold_sliding_layers(cache: Cache, hold: bool) -> None:
    """While held, sliding-window layers keep every token the forward passes add (transformers'
    past recording), so that cache_to_blocks can cut a prompt longer than the window; released,
    they go back to their last sliding_window - 1 tokens, as after any forward pass."""
    for layer in cache.layers:
        if not isinstance(layer, DynamicSlidingWindowLayer) or not hasattr(layer, "record_past"):
            continue
        layer.record_past = hold
        keep = layer.sliding_window - 1
        keys, values = layer.keys, layer.values
        if not hold and layer.is_initialized and keys is not None and values is not None and keys.shape[-2] > keep:
            layer.keys, layer.values = keys[:, :, -keep:, :], values[:, :, -keep:, :]


def first_held_token(past_key_values: Cache | KVPairs) -> int:
    """The first token every layer still holds: 0, unless a sliding-window layer has let the
    prompt's first tokens go (cache_to_blocks can cut blocks from here on only)."""
    return max((first for _, _, first in layer_kv(past_key_values)), default=0)


def cache_to_blocks(past_key_values: Cache | KVPairs, layout: BlockLayout,
                    start_token: int, end_token: int) -> list[torch.Tensor]:
    """Cut tokens [start_token, end_token) of a batch-1 cache into contiguous CPU block tensors.

    Each block is [num_layers, 2, num_kv_heads, tokens, head_dim] with tokens == layout.block_tokens,
    except the last, which may be shorter (a breakpoint tail). start_token must be a block boundary.
    Does not modify the cache. Raises InvalidArgument for a range outside the cache, a shape or dtype
    that does not match the layout, or a layer that no longer holds the range (sliding window).
    """
    size = layout.block_tokens
    per_layer = [torch.stack([keys[0, :, lo:hi], values[0, :, lo:hi]])
                 for keys, values, lo, hi in _cut(past_key_values, layout, start_token, end_token)]
    # One stack and one device-to-host copy for the whole range; the split below is free.
    whole = torch.stack(per_layer).to("cpu")
    return [part.contiguous() for part in torch.split(whole, size, dim=3)]


def cache_into(past_key_values: Cache | KVPairs, layout: BlockLayout, start_token: int,
               outs: Sequence[torch.Tensor]) -> None:
    """Write tokens from start_token on of a batch-1 cache into `outs`, canonical block tensors
    [num_layers, 2, num_kv_heads, tokens, head_dim] one after the other (room reserved in the daemon's
    slab, say): one copy of each layer's K and V per block, straight from the cache. The same checks
    as cache_to_blocks, and InvalidArgument for an out of another dtype or shape."""
    end = start_token + sum(out.shape[3] for out in outs)
    layers = _cut(past_key_values, layout, start_token, end)
    at = 0
    for out in outs:
        tokens = out.shape[3]
        if out.dtype != layout.torch_dtype or tuple(out.shape) != layout.shape(tokens):
            raise InvalidArgument(f"an out of {tuple(out.shape)} {out.dtype} for a block of {layout.shape(tokens)}")
        for layer, (keys, values, lo, _) in zip(out, layers):
            layer[0].copy_(keys[0, :, lo + at : lo + at + tokens])
            layer[1].copy_(values[0, :, lo + at : lo + at + tokens])
        at += tokens


def _cut(past_key_values: Cache | KVPairs, layout: BlockLayout, start_token: int, end_token: int
         ) -> list[tuple[torch.Tensor, torch.Tensor, int, int]]:
    """Each layer's keys, values and the range [lo, hi) of them that holds tokens [start_token,
    end_token), checked against the layout (see cache_to_blocks)."""
    size = layout.block_tokens
    if start_token % size or not 0 <= start_token < end_token:
        raise InvalidArgument(f"token range [{start_token}, {end_token}) must be non-empty and start "
                              f"on a multiple of block_tokens={size}")
    layers = layer_kv(past_key_values)
    if len(layers) != layout.num_layers:
        raise InvalidArgument(f"cache has {len(layers)} layers, layout expects {layout.num_layers}")
    cut = []
    for index, (keys, values, first) in enumerate(layers):
        batch, heads, stored, head_dim = keys.shape
        if batch != 1 or heads != layout.num_kv_heads or head_dim != layout.head_dim or values.shape != keys.shape:
            raise InvalidArgument(f"layer {index} keys {tuple(keys.shape)} / values {tuple(values.shape)} do not match "
                                  f"[1, {layout.num_kv_heads}, tokens, {layout.head_dim}]")
        if keys.dtype != layout.torch_dtype:
            raise InvalidArgument(f"layer {index} holds {DTYPE_NAMES.get(keys.dtype, keys.dtype)}, "
                                  f"layout expects {layout.dtype}")
        if start_token < first or end_token > first + stored:
            raise InvalidArgument(f"layer {index} holds tokens [{first}, {first + stored}), "
                                  f"not [{start_token}, {end_token})")
        cut.append((keys, values, start_token - first, end_token - first))
    return cut


GROWTH_MIN_TOKENS = 256  # a ReservedLayer out of room grows by at least this, or half what it holds


class ReservedLayer(DynamicLayer):
    """A full-attention cache layer that writes new tokens into room set aside behind the ones it
    holds, instead of concatenating: DynamicLayer copies the whole layer on every update (for a
    2000-token prefix of the default model, 8 MB over its 4 layers for the suffix, then again for
    each generated token). `keys` and `values` stay views of the room ([batch, heads, tokens, dim],
    tokens strided by the room's capacity), so everything that reads a DynamicLayer reads this one.
    Out of room, it moves to a new room with space for half as many tokens again (at least
    GROWTH_MIN_TOKENS). Tokens held are never written again, except those a crop dropped (the next
    update writes where they were), so views and copies of held tokens taken earlier stay true.
    A room made in inference mode (by a prefill) is an inference tensor: an update outside
    inference mode moves to a new room rather than write into it."""

    def __init__(self, reserve_tokens: int = 0) -> None:
        super().__init__()
        self.reserve_tokens = reserve_tokens
        self.room: torch.Tensor | None = None  # [2, batch, heads, capacity, dim]: keys, then values

    def adopt(self, room: torch.Tensor, num_tokens: int) -> None:
        """Hold the first num_tokens of `room` ([2, batch, heads, capacity, dim]) as this layer's tokens."""
        self.lazy_initialization(room[0, :, :, :0], room[1, :, :, :0])
        self.room = room
        self.keys, self.values = room[0, :, :, :num_tokens], room[1, :, :, :num_tokens]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object,
               **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        if self.room is None and key_states.shape != value_states.shape:
            # Keys and values of different widths (MLA) share no room: appended, as DynamicLayer does.
            return super().update(key_states, value_states, *args, **kwargs)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        held = self.get_seq_length()
        added = key_states.shape[-2]
        room = self._room_for(key_states)
        if room is None or held + added > room.shape[-2]:
            room = self._move(key_states, held, added)
        room[0, :, :, held : held + added].copy_(key_states)
        room[1, :, :, held : held + added].copy_(value_states)
        self.keys, self.values = room[0, :, :, : held + added], room[1, :, :, : held + added]
        return self.keys, self.values

    def reset(self) -> None:
        self.room = None  # a view taken before the reset still holds the tokens it showed
        super().reset()

    def _room_for(self, states: torch.Tensor) -> torch.Tensor | None:
        """The room, if keys/values are still its first tokens (a crop keeps them there; a batch
        reorder, or anything else that replaced them, does not) and `states` can be written into it."""
        room = self.room
        if room is None or room.dtype != states.dtype or room.device != states.device:
            return None
        if room.is_inference() and not torch.is_inference_mode_enabled():
            return None  # torch refuses in-place writes to it out there
        if (room.shape[1], room.shape[2], room.shape[4]) != (states.shape[0], states.shape[1], states.shape[3]):
            return None
        keys, values = self.keys, self.values
        assert keys is not None and values is not None  # update() initialized the layer first
        if keys.numel() == 0:
            return room
        in_room = keys.data_ptr() == room[0].data_ptr() and values.data_ptr() == room[1].data_ptr() \
            and keys.stride() == room[0].stride()
        return room if in_room else None

    def _move(self, states: torch.Tensor, held: int, added: int) -> torch.Tensor:
        """A new room for held + added tokens and more to come, holding the held ones: the layer's room
        from now on."""
        needed = held + added
        capacity = needed + (self.reserve_tokens if self.room is None else max(GROWTH_MIN_TOKENS, needed // 2))
        batch, heads, _, dim = states.shape
        room = torch.empty((2, batch, heads, capacity, dim), dtype=states.dtype, device=states.device)
        if held:
            keys, values = self.keys, self.values
            assert keys is not None and values is not None  # it holds tokens
            room[0, :, :, :held].copy_(keys)
            room[1, :, :, :held].copy_(values)
        self.room = room
        return room


def new_cache(model: PreTrainedModel, reserve_tokens: int = 0) -> DynamicCache:
    """An empty DynamicCache for `model`: the config picks each layer's class (full or sliding
    window), and each plain full-attention layer is a ReservedLayer with room for reserve_tokens
    more than its first update brings."""
    cache = DynamicCache(config=model.config)
    cache.layers = [ReservedLayer(reserve_tokens) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


Segment = tuple[int, int, int, torch.Tensor | None]  # blocks [lo, hi), their tokens, their span or None


def _segments(blocks: Sequence[torch.Tensor]) -> list[Segment]:
    """The blocks cut into segments, each copied into a layer's room by one torch call: a run of two
    or more blocks alike (shape and strides) lying at even steps in one storage (views of one stretch
    of the daemon's slab, or of one buffer read from its disk tier) comes with one strided view
    [blocks, layers, 2, heads, tokens, dim] over them all, its span; the other blocks come together,
    with None, to be concatenated. Without runs, a 2000-token prefix took 125 views and a 125-way
    concatenation per layer; scripts/bench_cache_build.py measures both ways."""
    n = len(blocks)
    tokens = [block.shape[3] for block in blocks]
    if n < 2:
        return [(0, n, sum(tokens), None)] if n else []
    ptrs = [block.data_ptr() for block in blocks]
    size = blocks[0].element_size()  # blocks_to_cache checked they share one dtype
    bases = [ptr - block.storage_offset() * size for ptr, block in zip(ptrs, blocks)]
    if len(set(bases)) == n:  # each block in its own buffer: no runs, one concatenation
        return [(0, n, sum(tokens), None)]
    # Alike: shape, strides and torch's lazy negation flag (a span takes the first block's).
    shapes = [(block.shape, block.stride(), block.is_neg()) for block in blocks]
    steps = [b - a for a, b in zip(ptrs, ptrs[1:])]
    if bases.count(bases[0]) == n and shapes.count(shapes[0]) == n and steps.count(steps[0]) == n - 1:
        cuts = [0, n]  # the usual case: the whole prefix in one stretch (list.count is one C loop each)
    else:  # runs grown greedily: block i continues the run from lo if it lies one more step on
        cuts, lo = [0], 0
        for i in range(1, n):
            if not (bases[i] == bases[lo] and shapes[i] == shapes[lo] and (i - lo == 1 or steps[i - 1] == steps[lo])):
                cuts.append(i)
                lo = i
        cuts.append(n)
    segments: list[Segment] = []
    loose = 0  # the first block not yet in a segment
    for lo, hi in zip(cuts, cuts[1:]):
        span = _span(blocks[lo], hi - lo, steps[lo] // size) if hi - lo >= 2 else None
        if span is not None:
            if loose < lo:
                segments.append((loose, lo, sum(tokens[loose:lo]), None))
            segments.append((lo, hi, sum(tokens[lo:hi]), span))
            loose = hi
    if loose < n:
        segments.append((loose, n, sum(tokens[loose:]), None))
    return segments


def _span(first: torch.Tensor, count: int, step: int) -> torch.Tensor | None:
    """[count, *first.shape]: first and the count - 1 blocks after it, `step` elements apart in its
    storage (0: the same block again); None when they would not all lie in it (as_strided checks:
    two storages may abut) or lie before it (it refuses negative steps)."""
    try:
        return first.as_strided((count, *first.shape), (step, *first.stride()), first.storage_offset())
    except RuntimeError:
        return None


def _fill(out: torch.Tensor, blocks: Sequence[torch.Tensor], segments: list[Segment], layer: int) -> None:
    """Copy layer `layer` of the blocks, in order, into out ([2, heads, tokens, dim], strided or not)."""
    at = 0
    for lo, hi, tokens, span in segments:
        if span is not None:
            out[:, :, at : at + tokens].unflatten(2, (hi - lo, tokens // (hi - lo))).copy_(
                span[:, layer].permute(1, 2, 0, 3, 4))
        else:
            torch.cat([block[layer] for block in blocks[lo:hi]], dim=2, out=out[:, :, at : at + tokens])
        at += tokens


def _check_blocks(blocks: Sequence[torch.Tensor], model: PreTrainedModel) -> KVGeometry:
    """The model's KV geometry; InvalidArgument for a block whose shape or dtype does not fit it."""
    geometry = probe_kv(model)[0]
    expected = (geometry.num_layers, 2, geometry.num_kv_heads, geometry.head_dim)
    for index, block in enumerate(blocks):
        if block.dim() != 5 or (*block.shape[:3], block.shape[4]) != expected or block.shape[3] == 0:
            raise InvalidArgument(f"block {index} has shape {tuple(block.shape)}, expected "
                                  f"[{expected[0]}, 2, {expected[2]}, tokens>0, {expected[3]}] for this model")
        if block.dtype != model.dtype:
            raise InvalidArgument(f"block {index} is {DTYPE_NAMES.get(block.dtype, block.dtype)}, "
                                  f"the model runs in {DTYPE_NAMES.get(model.dtype, model.dtype)}")
    return geometry


def extend_cache(cache: Cache, blocks: Sequence[torch.Tensor], model: PreTrainedModel) -> None:
    """Append the blocks' tokens, in order, after the tokens `cache` holds: the cached blocks after a
    hole the worker computed (their KV depends only on the tokens before them, which the cache now
    holds exactly). InvalidArgument as blocks_to_cache."""
    if not blocks:
        return
    _check_blocks(blocks, model)
    # In inference mode, as prefill: a room a prefill made is written in place, not moved.
    with torch.inference_mode():
        both = torch.cat([block.to(model.device) for block in blocks], dim=3)  # [layers, 2, heads, tokens, dim]
        for index, layer in enumerate(cache.layers):
            if not isinstance(layer, DynamicLayer):  # checked at the prefix's load (blocks_to_cache) too
                raise InvalidArgument(f"cache layer {index} is {type(layer).__name__}: it holds no keys and values "
                                      "to load blocks into")
            layer.update(both[index, 0].unsqueeze(0), both[index, 1].unsqueeze(0))


def blocks_to_cache(blocks: Sequence[torch.Tensor], model: PreTrainedModel, reserve_tokens: int = 0) -> DynamicCache:
    """A new cache for `model` (see new_cache) holding the blocks' tokens, in order, on its device and dtype.

    The blocks are copied once, into each full-attention layer's room, which has space for
    reserve_tokens more (the suffix and the tokens to generate: they are then written in place).
    Blocks lying at even steps in one buffer are copied a run at a time (see _segments).
    The blocks are no longer read once it returns. Raises InvalidArgument for a block whose shape
    or dtype does not fit the model. No blocks gives an empty cache.
    """
    geometry = _check_blocks(blocks, model)
    device, dtype = model.device, model.dtype
    # Async only host-to-device: a non-blocking copy into host memory could be read before it lands.
    moved = [block.to(device, non_blocking=device.type == "cuda") for block in blocks]
    cache = new_cache(model, reserve_tokens)
    if not moved:
        return cache
    segments = _segments(moved)
    num_tokens = sum(tokens for _, _, tokens, _ in segments)
    for index, layer in enumerate(cache.layers):
        if isinstance(layer, ReservedLayer):
            # A room per layer: a layer that outgrows its room frees it when it moves.
            room = torch.empty((2, 1, geometry.num_kv_heads, num_tokens + reserve_tokens, geometry.head_dim),
                               dtype=dtype, device=device)
            _fill(room[:, 0, :, :num_tokens], moved, segments, index)
            layer.adopt(room, num_tokens)
        else:  # sliding-window and other layers keep their own bookkeeping (and copies)
            if isinstance(layer, LinearAttentionCacheLayerMixin) and not isinstance(layer, DynamicLayer):
                raise InvalidArgument(f"cache layer {index} is {type(layer).__name__}: it holds no keys and values "
                                      "to load blocks into")
            both = torch.empty((2, 1, geometry.num_kv_heads, num_tokens, geometry.head_dim), dtype=dtype, device=device)
            _fill(both[:, 0], moved, segments, index)
            layer.update(both[0], both[1])
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()  # the callers may recycle the source blocks now
    return cache


def prefill(model: PreTrainedModel, input_ids: Sequence[int] | torch.Tensor,
            cache: Cache | None, reserve_tokens: int = 0) -> tuple[torch.Tensor, Cache]:
    """Run the forward pass for `input_ids` only, continuing after the tokens already in `cache`.

    Positions start at cache.get_seq_length(), so the result equals a full recompute of prefix +
    input_ids. Returns the logits of the last position ([vocab_size]) and the cache: `cache` itself,
    extended in place with input_ids (a new_cache with room for reserve_tokens more when `cache` is
    None). Raises InvalidArgument for an empty input (there would be no position to score).
    """
    ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(-1)
    if ids.numel() == 0:
        raise InvalidArgument("prefill needs at least one token; keep the last prompt token out of the cached prefix")
    if cache is None:
        cache = new_cache(model, reserve_tokens)
    past = cache.get_seq_length()
    positions = torch.arange(past, past + ids.numel(), device=model.device)
    kwargs: dict[str, object] = {"position_ids": positions.unsqueeze(0), "use_cache": True, "logits_to_keep": 1}
    params = forward_params(type(model).forward)
    kwargs[cache_argument(model)] = cache
    if "cache_position" in params:
        kwargs["cache_position"] = positions
    with torch.inference_mode():
        out = model(ids.to(model.device).unsqueeze(0), **kwargs)
    returned = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
    return out.logits[0, -1], returned if returned is not None else cache


def greedy_generate(model: PreTrainedModel, cache: Cache, first_logits: torch.Tensor, max_new_tokens: int,
                    eos_token_id: int | None = None) -> list[int]:
    """Greedy decoding: up to max_new_tokens ids, starting from the argmax of first_logits.

    Extends `cache` in place with every generated token except the last (which is never fed back).
    Stops early after emitting eos_token_id.
    """
    if max_new_tokens < 0:
        raise InvalidArgument(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    tokens: list[int] = []
    logits = first_logits
    while len(tokens) < max_new_tokens:
        token = int(torch.argmax(logits).item())
        tokens.append(token)
        if token == eos_token_id or len(tokens) == max_new_tokens:
            break
        logits, cache = prefill(model, [token], cache)
    return tokens
