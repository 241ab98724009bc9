"""The Hugging Face worker: the request path (request.py) with its pure planner (plan.py), its I/O
with the daemon (transfer.py) and cost model (cost.py), KV-cache conversion (kvcache.py), model
loading (model.py), the JSON-lines front end (jsonl.py) and its command (cli.py).

The names below load on first use: `tiercache serve` imports this package's cli module for its
argument parser and must not pay for torch and transformers."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {"GENERATE_RESERVE_TOKENS": "request", "Request": "request", "Result": "request", "Worker": "request",
            "run_jsonl": "jsonl", "LoadedModel": "model", "load_model": "model", "load_default_model": "model",
            "namespace_for": "model"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
