"""Who is calling: an API key from the keys file names a tenant, and the tenant's salt isolates its cache."""

from __future__ import annotations

import hmac
import ipaddress
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from tiercache.api.errors import APIError

HOUSEHOLD = "household"  # the one tenant when there is no keys file (loopback callers only)


@dataclass(frozen=True)
class Caller:
    tenant: str
    salt: str  # "" for the household: one shared namespace


def load_keys(path: str) -> dict[str, str]:
    """`KEY TENANT` per line (blank lines and # comments skipped); ValueError naming the line that is wrong."""
    keys: dict[str, str] = {}
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise ValueError(f"--api-keys {path!r}: {e.strerror}") from None
    for number, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ValueError(f"--api-keys {path}:{number}: expected 'KEY TENANT', got {len(parts)} fields")
        key, tenant = parts
        if len(key) < 16:
            raise ValueError(f"--api-keys {path}:{number}: a key needs at least 16 characters")
        if key in keys:
            raise ValueError(f"--api-keys {path}:{number}: this key is listed twice")
        keys[key] = tenant
    if not keys:
        raise ValueError(f"--api-keys {path}: no keys in the file")
    return keys


def salt_for(tenant: str) -> str:
    """The cache salt the server assigns a tenant: tenants never share blocks, keys of one tenant do."""
    return f"tiercache.api.tenant:{tenant}"


def is_loopback(host: str | None) -> bool:
    if host is None:
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def caller(request: Request) -> Caller:
    """The caller of `request` (a FastAPI dependency). With keys: the key of `Authorization: Bearer KEY` or
    `x-api-key: KEY` (constant-time compare), else 401. Without: loopback callers only, else 403."""
    keys: dict[str, str] | None = request.app.state.api.keys
    if keys is None:
        host = request.client.host if request.client else None
        if not is_loopback(host):
            raise APIError(403, f"this server has no --api-keys and serves loopback callers only, not {host}",
                           code="loopback_only")
        return Caller(HOUSEHOLD, "")
    given = request.headers.get("x-api-key")
    if given is None:
        scheme, _, value = request.headers.get("authorization", "").partition(" ")
        given = value.strip() if scheme.lower() == "bearer" else None
    if not given:
        raise APIError(401, "no API key: send `Authorization: Bearer KEY` or `x-api-key: KEY`",
                       code="invalid_api_key")
    tenant = None
    for key, name in keys.items():  # every key compared, so the time taken does not say which one matched
        if hmac.compare_digest(key.encode(), given.encode()):
            tenant = name
    if tenant is None:
        raise APIError(401, "the API key is not valid", code="invalid_api_key")
    return Caller(tenant, salt_for(tenant))


Who = Annotated[Caller, Depends(caller)]  # the caller of a route (401/403 before the route runs)
