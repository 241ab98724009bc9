"""A model's weights identity (the `weights` field of a namespace): a digest of its files or tensors."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
from typing import Any

import torch

from tiercache.errors import InvalidArgument

logger = logging.getLogger(__name__)

_DIGEST_BYTES = 32


def default_digest_cache() -> pathlib.Path:
    """Where file digests are remembered: $XDG_CACHE_HOME/tiercache/weights-digests.json (~/.cache by default)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "tiercache" / "weights-digests.json"


def weights_digest(source: torch.nn.Module | str | os.PathLike[str], *,
                   cache_file: str | os.PathLike[str] | None = None) -> str:
    """Hex BLAKE2b-256 identity of a model's weights.

    For a module: every state_dict tensor in name order (name, dtype, shape, bytes). For a directory:
    config.json plus every *.safetensors file, each file hashed once and remembered in `cache_file`
    (default_digest_cache() when None) under (path, size, mtime); config.json is included because
    settings such as rope scaling change the KV of the same weights.
    """
    digest = hashlib.blake2b(digest_size=_DIGEST_BYTES)
    if isinstance(source, torch.nn.Module):
        for name, tensor in sorted(source.state_dict().items()):
            flat = tensor.detach().to("cpu").contiguous().reshape(-1)
            digest.update(f"{name}\0{flat.dtype}\0{tuple(tensor.shape)}\0".encode())
            digest.update(flat.view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()
    path = pathlib.Path(source).resolve()
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise InvalidArgument(f"no *.safetensors weights in {str(path)!r}")
    if (path / "config.json").is_file():
        files.append(path / "config.json")
    cache_path = pathlib.Path(cache_file) if cache_file is not None else default_digest_cache()
    remembered = _read_digest_cache(cache_path)
    changed = False
    for file in files:
        stat = file.stat()
        entry = remembered.get(str(file))
        if not entry or entry.get("size") != stat.st_size or entry.get("mtime_ns") != stat.st_mtime_ns:
            with open(file, "rb") as handle:
                file_hex = hashlib.file_digest(handle, lambda: hashlib.blake2b(digest_size=_DIGEST_BYTES)).hexdigest()
            entry = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "blake2b": file_hex}
            remembered[str(file)] = entry
            changed = True
            logger.debug("hashed weights file=%s bytes=%d", file, stat.st_size)
        digest.update(f"{file.name}\0{entry['blake2b']}\0".encode())
    if changed:
        _write_digest_cache(cache_path, remembered)
    return digest.hexdigest()


def _read_digest_cache(path: pathlib.Path) -> dict[str, dict[str, Any]]:
    try:
        data = json.loads(path.read_text())
        files = data["files"] if data.get("version") == 1 else {}
        return files if isinstance(files, dict) else {}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        # Only a memo: a damaged one costs a rehash, never a wrong digest.
        logger.warning("ignoring unreadable weights digest cache %s: %s", path, exc)
        return {}


def _write_digest_cache(path: pathlib.Path, files: dict[str, dict[str, Any]]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"version": 1, "files": files}, indent=1, sort_keys=True))
        os.replace(tmp, path)  # atomic: concurrent workers never read a half-written file
    except OSError as exc:
        logger.warning("cannot save weights digest cache %s: %s", path, exc)
