"""How a process on the daemon's host reaches it: the daemon's socket, with the same-host paths, when its
account may connect there; else the daemon's public socket, as the tenant the daemon gives its uid."""

from __future__ import annotations

import os
from typing import Any

from tiercache.client.core import Client

_EFFECTIVE = os.access in os.supports_effective_ids


def may_connect(socket: str) -> bool:
    """Whether this process may connect to the Unix socket at `socket`: write permission on it, as
    connect() checks. A socket not there (the daemon restarting) is judged by its directory: a
    process that cannot pass through it is not one of the daemon's user or group."""
    if os.path.exists(socket):
        return os.access(socket, os.W_OK, effective_ids=_EFFECTIVE)
    return os.access(os.path.dirname(os.path.abspath(socket)), os.X_OK, effective_ids=_EFFECTIVE)


def local_client(socket: str, public_socket: str = "", **kwargs: Any) -> Client:
    """A Client of the daemon on this host (kwargs go to Client).

    On `socket` (server.socket) when this process may connect to it: the daemon's user or a member
    of server.local_group, with the shared index, the slab and staged Puts. Otherwise on
    `public_socket` (server.public_socket) over the byte path, as the tenant server.public_tenants
    names for this process's uid (or, with token=, the token's). Without a public socket, on `socket`
    whatever the permissions say (calls then fail as Unavailable, as with a daemon that is down)."""
    if not public_socket or may_connect(socket):
        return Client(f"unix:{socket}", **kwargs)
    return Client(f"unix:{public_socket}", **{**kwargs, "shared_memory": False})
