"""The namespace of vLLM's blocks, within the key spec's nine fields (DESIGN.md, block keys).

model        the model's name as the HF worker writes it ("llama/<directory name>"), or model_name
weights      the digest of the model directory's weights and config (tiercache/weights.py)
dtype        the KV cache dtype (vLLM's, which follows the model's unless set)
num_layers, num_kv_heads, head_dim, block_tokens
             vLLM's attention layers on this rank, KV heads per rank, head size, vLLM's block size
adapter      "engine=vllm;tp=<rank>/<size>", then ";lora=<name>" for a LoRA request; "" (and then
             "lora=<name>") when share_with_hf_worker is set, so the HF worker's blocks match
salt         the connector's salt, and the request's cache_salt when it has one

The engine is part of the namespace unless a user opts in: vLLM's and transformers' kernels round
differently, so their KV for the same tokens is close but not identical.
"""

from __future__ import annotations

import json
import os
import pathlib

from tiercache.integrations.vllm.settings import ENGINE, ConnectorSettings
from tiercache.keys import Namespace
from tiercache.weights import weights_digest


def model_directory(model: str, revision: str | None = None) -> pathlib.Path:
    """The local directory of vLLM's `model` (a path, or a Hugging Face id already downloaded);
    ValueError when it has no local copy, since then its weights cannot be named."""
    path = pathlib.Path(model).expanduser()
    if path.is_dir():
        return path.resolve()
    try:
        from huggingface_hub import snapshot_download

        return pathlib.Path(snapshot_download(model, revision=revision, local_files_only=True))
    except Exception as e:  # noqa: BLE001 - any failure means the same thing here
        raise ValueError(f"tiercache connector: cannot find a local copy of model {model!r} to digest its "
                         f"weights ({e}); download it first or pass a directory") from None


def model_name(model_type: str, directory: pathlib.Path, settings: ConnectorSettings) -> str:
    """The namespace's model field: model_name when set, else the HF worker's "<type>/<directory name>"."""
    return settings.model_name or f"{model_type}/{directory.name}"


def request_salt(settings: ConnectorSettings, cache_salt: str | None) -> str:
    """The salt field: the connector's salt alone, or with the request's cache_salt (unambiguously joined)."""
    if not cache_salt:
        return settings.salt
    return json.dumps([settings.salt, cache_salt], separators=(",", ":"))


def adapter_field(settings: ConnectorSettings, tp_rank: int, tp_size: int, lora: str | None) -> str:
    parts = [] if settings.share_with_hf_worker else [f"engine={ENGINE}", f"tp={tp_rank}/{tp_size}"]
    if lora:
        parts.append(f"lora={lora}")
    return ";".join(parts)


class Namespaces:
    """The namespaces of one engine's ranks, per (LoRA, cache_salt); built once each.

    `base` holds the fields every request shares (adapter and salt aside)."""

    def __init__(self, settings: ConnectorSettings, base: Namespace, tp_size: int) -> None:
        if tp_size > 1 and settings.share_with_hf_worker:
            raise ValueError("tiercache connector: share_with_hf_worker needs tensor_parallel_size 1 "
                             f"(the HF worker holds every KV head), got {tp_size}")
        self.settings = settings
        self.base = base
        self.tp_size = tp_size
        self._memo: dict[tuple[str | None, str | None], tuple[Namespace, ...]] = {}

    def of(self, lora: str | None = None, cache_salt: str | None = None) -> tuple[Namespace, ...]:
        """One namespace per tensor-parallel rank, in rank order."""
        found = self._memo.get((lora, cache_salt))
        if found is None:
            fields = self.base.to_dict()
            fields["salt"] = request_salt(self.settings, cache_salt)
            found = tuple(
                Namespace.from_dict({**fields, "adapter": adapter_field(self.settings, rank, self.tp_size, lora)})
                for rank in range(self.tp_size))
            if len(self._memo) > 4096:  # many distinct cache_salts: forget, recompute (cheap)
                self._memo.clear()
            self._memo[(lora, cache_salt)] = found
        return found


def base_namespace(settings: ConnectorSettings, *, model: str, revision: str | None, model_type: str,
                   dtype: str, num_layers: int, num_kv_heads: int, head_dim: int, block_tokens: int,
                   digest_cache: str | os.PathLike[str] | None = None) -> Namespace:
    """The fields shared by every request of this engine (adapter and salt left empty)."""
    directory = model_directory(model, revision)
    return Namespace(model=model_name(model_type, directory, settings),
                     weights=weights_digest(directory, cache_file=digest_cache), dtype=dtype,
                     num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, block_tokens=block_tokens)
