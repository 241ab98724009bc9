"""The worker's model: the embedded default (seeded small Llama, byte tokenizer) or a local HF directory."""

from __future__ import annotations

import logging
import os
import pathlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedModel

from tiercache.errors import InvalidArgument
from tiercache.keys import Namespace
from tiercache.layout import DTYPE_NAMES
from tiercache.weights import default_digest_cache as default_digest_cache  # re-exported: callers name it here
from tiercache.weights import weights_digest
from tiercache.worker.geometry import probe_kv

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "tiercache/default-llama-v1"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class Tokenizer(Protocol):
    """What the worker needs from a tokenizer; ByteTokenizer and HFTokenizer both provide it."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def bos_token_id(self) -> int | None: ...

    @property
    def eos_token_id(self) -> int | None: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes shifted past three special ids (pad 0, bos 1, eos 2): no vocabulary file, no download."""

    pad_token_id = 0
    bos_token_id = 1
    eos_token_id = 2
    offset = 3
    vocab_size = offset + 256

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
        """bos (unless add_bos is False) followed by one id per UTF-8 byte of `text`."""
        ids = [byte + self.offset for byte in text.encode("utf-8")]
        return [self.bos_token_id, *ids] if add_bos else ids

    def decode(self, ids: Sequence[int]) -> str:
        """The text of the byte ids; special ids are skipped, invalid UTF-8 becomes U+FFFD."""
        data = bytearray()
        for position, token in enumerate(ids):
            if not 0 <= token < self.vocab_size:
                raise InvalidArgument(f"token id {token} at position {position} is outside [0, {self.vocab_size})")
            if token >= self.offset:
                data.append(token - self.offset)
        return data.decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face tokenizer behind the Tokenizer interface (its own special-token conventions kept)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.vocab_size: int = len(tokenizer)
        self.bos_token_id: int | None = tokenizer.bos_token_id
        self.eos_token_id: int | None = tokenizer.eos_token_id

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text))

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=True)


@dataclass
class LoadedModel:
    """A model ready for inference plus everything its namespace needs (see namespace_for)."""

    model: PreTrainedModel
    tokenizer: Tokenizer
    name: str
    weights: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    device: torch.device
    uncacheable: str = ""  # why the model's KV cannot be cut into blocks (kvcache.probe_kv); "" when it can


def default_model_config() -> LlamaConfig:
    """The embedded default: a small GQA Llama over the byte vocabulary."""
    tokenizer = ByteTokenizer()
    return LlamaConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=8192,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False,
        # eager, not sdpa: on CPU float32 it makes cached-prefix + suffix bit-identical to a full
        # recompute (measured max abs diff 0.0; sdpa ~5e-8), so tests can demand exactness. The config
        # takes it among its **kwargs, which the signature its dataclass shows mypy leaves out.
        attn_implementation="eager",  # type: ignore[call-arg]  # see above
    )


def load_default_model(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                       seed: int = 0) -> LoadedModel:
    """The embedded default with weights drawn from `seed`; the caller's global RNG state is left untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(default_model_config())
    # transformers wraps Module.to with functools.wraps, whose stub mypy reads as a plain callable
    # (not a method): it then wants `self` passed. Here and in load_model.
    model = model.to(device=device, dtype=dtype).eval()  # type: ignore[call-arg]  # see above
    return wrap_model(model, ByteTokenizer(), f"{DEFAULT_MODEL_NAME}-seed{seed}")


def load_model(model_dir: str | os.PathLike[str] | None, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32, *,
               digest_cache: str | os.PathLike[str] | None = None) -> LoadedModel:
    """A causal LM from a local Hugging Face directory (safetensors weights), or the default when model_dir is None.

    Never downloads. The directory's tokenizer is used when it has one, else ByteTokenizer.
    Raises InvalidArgument for a missing directory, one without config.json or *.safetensors
    weights, or one whose tokenizer or model fails to load.
    """
    if model_dir is None:
        return load_default_model(device, dtype)
    path = pathlib.Path(model_dir).resolve()
    if not path.is_dir():
        raise InvalidArgument(f"model directory {str(path)!r} does not exist")
    if not (path / "config.json").is_file() or not any(path.glob("*.safetensors")):
        raise InvalidArgument(f"model directory {str(path)!r} needs config.json and *.safetensors weights")
    try:
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, use_safetensors=True, dtype=dtype)
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"cannot load the model in {str(path)!r}: {exc}") from exc
    model = model.to(device).eval()  # type: ignore[arg-type]  # Module.to's wraps: see load_default_model
    tokenizer: Tokenizer = ByteTokenizer()
    if any((path / name).is_file() for name in _TOKENIZER_FILES):
        try:
            tokenizer = HFTokenizer(AutoTokenizer.from_pretrained(path, local_files_only=True))
        except (OSError, ValueError) as exc:
            # Falling back to bytes would silently feed the model ids it was never trained on.
            raise InvalidArgument(f"cannot load the tokenizer in {str(path)!r}: {exc}") from exc
    name = f"{model.config.model_type}/{path.name}"
    return wrap_model(model, tokenizer, name, weights_digest(path, cache_file=digest_cache))


def wrap_model(model: PreTrainedModel, tokenizer: Tokenizer, name: str, weights: str | None = None) -> LoadedModel:
    """A LoadedModel for a model already in memory; `weights` defaults to weights_digest(model)."""
    if weights is None:
        weights = weights_digest(model)
    if model.dtype not in DTYPE_NAMES:
        raise InvalidArgument(f"model dtype {model.dtype} has no KV dtype name; "
                              f"use one of {', '.join(DTYPE_NAMES.values())}")
    geometry, uncacheable = probe_kv(model)
    logger.info("loaded model=%s weights=%s dtype=%s layers=%d kv_heads=%d head_dim=%d", name, weights[:16],
                DTYPE_NAMES[model.dtype], geometry.num_layers, geometry.num_kv_heads, geometry.head_dim)
    if uncacheable:
        logger.warning("model=%s runs without the cache: %s", name, uncacheable)
    return LoadedModel(model, tokenizer, name, weights, DTYPE_NAMES[model.dtype], geometry.num_layers,
                       geometry.num_kv_heads, geometry.head_dim, model.device, uncacheable)


def namespace_for(loaded: LoadedModel, *, block_tokens: int, adapter: str = "", salt: str = "") -> Namespace:
    """The key namespace of this model at this block size, adapter and salt."""
    return Namespace(model=loaded.name, weights=loaded.weights, dtype=loaded.dtype, num_layers=loaded.num_layers,
                     num_kv_heads=loaded.num_kv_heads, head_dim=loaded.head_dim, block_tokens=block_tokens,
                     adapter=adapter, salt=salt)
