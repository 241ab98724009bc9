"""A model's KV geometry, probed once per model, and its cache's per-layer tensors as any transformers
release hands them over."""

from __future__ import annotations

import functools
import inspect
import logging
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import Cache, DynamicLayer

from tiercache.errors import InvalidArgument

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVGeometry:
    """The per-token KV shape of a model: what a block holds for one token, per layer."""

    num_layers: int
    num_kv_heads: int
    head_dim: int


def kv_geometry(config: PretrainedConfig) -> KVGeometry:
    """Layers, KV heads and head size of a decoder, for every supported family, derived in this one place.

    Llama, Qwen2 and Mistral name them num_hidden_layers / num_key_value_heads / head_dim; GPT-2 has
    n_layer / n_head / n_embd (reached through its attribute_map) and no separate KV heads (plain MHA).
    """
    text = config.get_text_config(decoder=True)
    num_layers = getattr(text, "num_hidden_layers", None)
    num_heads = getattr(text, "num_attention_heads", None)
    hidden = getattr(text, "hidden_size", None)
    if not (isinstance(num_layers, int) and isinstance(num_heads, int) and isinstance(hidden, int)):
        raise InvalidArgument(f"model type {text.model_type!r}: config lacks num_hidden_layers, "
                              "num_attention_heads or hidden_size; cannot derive the KV layout")
    num_kv_heads = getattr(text, "num_key_value_heads", None) or num_heads
    head_dim = getattr(text, "head_dim", None) or hidden // num_heads
    return KVGeometry(num_layers, num_kv_heads, head_dim)


MAX_PROBED_MODELS = 8  # models whose probe_kv answer is remembered; a process rarely holds more than one or two


class ProbeMemo:
    """probe_kv's answers for the `max_models` models used most recently; safe to share between threads.

    Not functools.lru_cache: keyed by the model it would hold each one strongly, so a model its owner
    dropped (weights, device memory) stayed alive until `max_models` others pushed it out; keyed by
    id() it would hand a new model the answer of a dead one that had the same address. Here an entry
    is keyed by id() and holds a weak reference that must still point at the asking model.
    Invariant: len(self) <= max_models.
    """

    def __init__(self, max_models: int = MAX_PROBED_MODELS) -> None:
        if max_models < 1:
            raise ValueError(f"max_models must be >= 1, got {max_models}")
        self.max_models = max_models
        self._lock = threading.Lock()
        self._entries: OrderedDict[int, tuple[weakref.ref[PreTrainedModel], tuple[KVGeometry, str]]] = OrderedDict()

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def get(self, model: PreTrainedModel) -> tuple[KVGeometry, str] | None:
        """The remembered answer for `model` (now the most recently used), or None."""
        with self._lock:
            entry = self._entries.get(id(model))
            if entry is None or entry[0]() is not model:
                return None
            self._entries.move_to_end(id(model))
            return entry[1]

    def put(self, model: PreTrainedModel, answer: tuple[KVGeometry, str]) -> None:
        """Remember `answer` for `model`; forgets dead models' entries, then the least recently used."""
        ref = weakref.ref(model)
        with self._lock:
            for key in [k for k, (r, _) in self._entries.items() if r() is None]:
                del self._entries[key]
            if id(model) in self._entries:
                self._entries.move_to_end(id(model))
            # Room is made before the entry goes in, so the bound holds at every instant, not only
            # between calls (a reader outside the lock could see max_models + 1 otherwise).
            while len(self._entries) >= self.max_models and id(model) not in self._entries:
                self._entries.popitem(last=False)
            self._entries[id(model)] = (ref, answer)


_probed = ProbeMemo()


def probe_kv(model: PreTrainedModel) -> tuple[KVGeometry, str]:
    """The model's KV geometry as its cache holds it, and why its cache cannot be cut into blocks
    ("" when it can), from a one-token forward pass (once per model). The config alone misleads:
    Falcon with multi_query keeps one KV head where its config says num_kv_heads=4; DeepSeek-V2/V3
    and MiniCPM3 (MLA) store keys and values of different widths; Gemma-3n's shared-KV layers hold
    nothing of their own. Raises InvalidArgument only when neither the probe nor the config gives
    a geometry (the model could not be named in a namespace). Remembered for the last
    MAX_PROBED_MODELS models (ProbeMemo)."""
    remembered = _probed.get(model)
    if remembered is not None:
        return remembered
    # Probed outside the memo's lock: two threads may both probe a new model, and agree.
    try:
        declared: KVGeometry | None = kv_geometry(model.config)
    except InvalidArgument:
        declared = None
    try:
        cache = DynamicCache(config=model.config)
        with torch.inference_mode():
            out = model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=model.device), use_cache=True,
                        **{cache_argument(model): cache})
        returned = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        layers = layer_kv(returned if returned is not None else cache)
        if not layers:
            raise InvalidArgument("its cache has no layers")
        keys, values, _ = layers[0]
        if any(k.shape != v.shape for k, v, _ in layers):
            raise InvalidArgument(f"its keys {tuple(keys.shape)} and values {tuple(values.shape)} differ in "
                                  "shape (multi-head latent attention)")
        if len({(k.shape[1], k.shape[3]) for k, _, _ in layers}) != 1:
            raise InvalidArgument("its layers hold KV of different shapes")
        found = KVGeometry(len(layers), keys.shape[1], keys.shape[3]), ""
    except Exception as e:  # noqa: BLE001 - what stops the probe stops the cache, not the model
        why = str(e) if isinstance(e, InvalidArgument) else f"the probe failed: {type(e).__name__}: {e}"
        if declared is None:
            raise InvalidArgument(f"model type {model.config.model_type!r}: cannot derive its KV layout from its "
                                  f"config or its cache ({why})") from None
        found = declared, f"this model's KV cache cannot be cut into blocks: {why}"
    if declared is not None and found[0] != declared and not found[1]:
        logger.info("KV geometry from the model's cache %s, not the config's %s", found[0], declared)
    _probed.put(model, found)
    return found


KVPairs = Sequence[tuple[torch.Tensor, torch.Tensor]]


def layer_kv(cache: Cache | KVPairs) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """(keys, values, position of the first stored token) of every layer; raises for layers we cannot slice."""
    if not isinstance(cache, Cache):
        return [(k, v, 0) for k, v in cache]
    out = []
    for index, layer in enumerate(cache.layers):
        if not isinstance(layer, DynamicLayer) or not layer.is_initialized or layer.keys is None \
                or layer.values is None:
            raise InvalidArgument(f"cache layer {index} is {type(layer).__name__}; only filled dynamic "
                                  "attention layers can be cut into blocks")
        stored = layer.keys.shape[-2]
        # A sliding-window layer keeps only its last tokens; get_seq_length counts all it has seen.
        out.append((layer.keys, layer.values, layer.get_seq_length() - stored))
    return out


@functools.cache
def forward_params(forward: Callable[..., object]) -> frozenset[str]:
    """The parameter names of a model class's forward (pass type(model).forward: one per class)."""
    return frozenset(inspect.signature(forward).parameters)


def cache_argument(model: PreTrainedModel) -> str:
    # transformers 5.x renamed past_key_values to cache (and dropped cache_position); accept either release.
    return "cache" if "cache" in forward_params(type(model).forward) else "past_key_values"
