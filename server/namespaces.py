"""The namespace registry: what workers said each namespace digest is, per tenant, in a JSON sidecar."""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Mapping

from tiercache.errors import InvalidArgument
from tiercache.keys import KEY_BYTES
from tiercache.layout import DTYPES

logger = logging.getLogger(__name__)

FILE_NAME = "namespaces.json"
VERSION = 1
MAX_TEXT_CHARS = 256
MAX_ENTRIES = 4096  # past this, descriptions of namespaces that no longer hold blocks are dropped
STR_FIELDS = ("model", "weights", "dtype", "adapter", "salt_digest")
INT_FIELDS = ("num_layers", "num_kv_heads", "head_dim", "block_tokens")
FIELDS = STR_FIELDS + INT_FIELDS


def check_fields(fields: Mapping[str, object]) -> dict[str, str | int]:
    """The nine descriptive fields, validated; InvalidArgument naming the first bad one."""
    out: dict[str, str | int] = {}
    for name in STR_FIELDS:
        value = fields.get(name, "")
        if not isinstance(value, str) or len(value) > MAX_TEXT_CHARS:
            raise InvalidArgument(f"namespace.{name} must be a string of at most {MAX_TEXT_CHARS} characters")
        out[name] = value
    for name in INT_FIELDS:
        value = fields.get(name, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidArgument(f"namespace.{name} must be an integer >= 1, got {value!r}")
        out[name] = value
    if not out["model"]:
        raise InvalidArgument("namespace.model is empty")
    if out["dtype"] not in DTYPES:
        raise InvalidArgument(f"namespace.dtype {out['dtype']!r} is not one of {', '.join(DTYPES)}")
    digest = str(out["salt_digest"])
    if digest and (len(digest) != 2 * KEY_BYTES or any(c not in "0123456789abcdef" for c in digest)):
        raise InvalidArgument("namespace.salt_digest must be empty or 64 lowercase hex digits")
    return out


class NamespaceRegistry:
    """(tenant, namespace digest) -> descriptive fields, persisted atomically in <data_dir>/namespaces.json.

    Descriptive only: nothing the store does depends on it. Written when a description is new or
    changed (rare: once per namespace), so the cost is one small file write per new model or salt.
    A damaged file is logged and ignored (descriptions come back with the next Put of each namespace).
    """

    def __init__(self, data_dir: str) -> None:
        self.path = os.path.join(data_dir, FILE_NAME)
        self._lock = threading.Lock()
        self._entries: dict[tuple[str, bytes], dict[str, str | int]] = {}
        self._load()

    def _load(self) -> None:
        try:
            with open(self.path, encoding="utf-8") as f:
                data = json.load(f)
            if data.get("version") != VERSION:
                raise ValueError(f"unknown version {data.get('version')!r}")
            for item in data["namespaces"]:
                digest = bytes.fromhex(item["digest"])
                if len(digest) != KEY_BYTES:
                    raise ValueError(f"digest of {len(digest)} bytes")
                self._entries[(str(item["tenant"]), digest)] = check_fields(item["fields"])
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError, AttributeError, InvalidArgument) as e:
            logger.warning("ignoring unreadable namespace registry %s: %s", self.path, e)
            self._entries.clear()
            return
        logger.info("namespace registry: namespaces=%d", len(self._entries))

    def register(self, tenant: str, digest: bytes, fields: Mapping[str, str | int],
                 live: Callable[[], set[tuple[str, bytes]]] | None = None) -> bool:
        """Remember (or update) a description; returns whether the file was rewritten. `live` gives
        the (tenant, digest) pairs that still hold blocks, used to prune past MAX_ENTRIES."""
        with self._lock:
            if self._entries.get((tenant, digest)) == fields:
                return False
            self._entries[(tenant, digest)] = dict(fields)
            if len(self._entries) > MAX_ENTRIES and live is not None:
                keep = live() | {(tenant, digest)}
                self._entries = {k: v for k, v in self._entries.items() if k in keep}
            self._save()
        logger.debug("namespace described: tenant=%s digest=%s model=%s", tenant, digest.hex()[:12], fields["model"])
        return True

    def describe(self, tenant: str, digests: set[bytes]) -> dict[bytes, dict[str, str | int]]:
        """The descriptions the tenant's workers gave for these digests (absent ones left out)."""
        with self._lock:
            return {d: dict(f) for (t, d), f in self._entries.items() if t == tenant and d in digests}

    def _save(self) -> None:
        items = [{"tenant": t, "digest": d.hex(), "fields": f} for (t, d), f in sorted(self._entries.items())]
        tmp = f"{self.path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump({"version": VERSION, "namespaces": items}, f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)  # atomic: a crash leaves the old file or the new one
        except OSError as e:
            # Descriptions are a convenience: losing one must never fail a Put.
            logger.warning("cannot save namespace registry %s: %s", self.path, e)
