"""Tenant-scoped store keys: the wire contract's formula, shared by the daemon and the admin tools."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from tiercache.keys import KEY_BYTES

LOCAL_TENANT = "local"  # Unix-socket callers without a token; the operator
_TENANT_TAG = b"tiercache.tenant.v1\0"


def scope_key(tenant: str, key: bytes) -> bytes:
    """The store key of a tenant's client key: BLAKE2b(tag + tenant + NUL + key, 32 bytes).

    Cryptographic, so no tenant can name (or collide with) another tenant's store key.
    """
    return hashlib.blake2b(_TENANT_TAG + tenant.encode() + b"\0" + key, digest_size=KEY_BYTES).digest()


def scope_keys(tenant: str, keys: Sequence[bytes]) -> list[bytes]:
    """scope_key of each key; the tenant prefix is hashed once and the state copied per key."""
    prefix = hashlib.blake2b(_TENANT_TAG + tenant.encode() + b"\0", digest_size=KEY_BYTES)
    scoped = []
    for key in keys:
        h = prefix.copy()
        h.update(key)
        scoped.append(h.digest())
    return scoped
