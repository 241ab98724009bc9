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


class ScopedKeys:
    """scope_keys of one tenant, remembered: a worker's lookups and fetches name the same chains
    again and again, and hashing 128 keys costs more than the rest of a Lookup. Bounded: emptied
    when full. Safe across threads (a race at worst hashes a key twice)."""

    def __init__(self, tenant: str, limit: int = 1 << 16) -> None:  # 64 Ki keys: about 10 MiB
        self.tenant = tenant
        self._limit = limit
        self._memo: dict[bytes, bytes] = {}

    def __len__(self) -> int:
        return len(self._memo)

    def __call__(self, keys: Sequence[bytes]) -> list[bytes]:
        memo = self._memo
        scoped = list(map(memo.get, keys))
        if None not in scoped:
            return scoped  # type: ignore[return-value]  # no None in it; a TypeGuard would cost a call per lookup
        missing = [k for k, v in zip(keys, scoped) if v is None]
        fresh = dict(zip(missing, scope_keys(self.tenant, missing)))
        if len(memo) + len(fresh) > self._limit:
            memo.clear()
        if len(fresh) <= self._limit:
            memo.update(fresh)  # used from here, not read back: another thread may empty the memo meanwhile
        return [v if v is not None else fresh[k] for k, v in zip(keys, scoped)]
