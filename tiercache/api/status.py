"""The status page in `tiercache api`: its daemon's tiers and namespaces (asked through a client), its own requests."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request, Response

from tiercache.api.auth import Who
from tiercache.web.board import (
    BlockRow,
    Reading,
    RecentRequests,
    StatusBoard,
    TierReading,
)
from tiercache.web.pages import HEADERS, static_file

if TYPE_CHECKING:
    from tiercache.api.state import APIState
    from tiercache.client import Client

router = APIRouter(tags=["status"])

LIST_LIMIT = 4096  # blocks asked of the daemon per page view, most recently used first


def api_board(client_factory: Callable[[], Client] | None, totals: Callable[[], tuple[int, int]],
              recent: RecentRequests, version: str = "") -> StatusBoard:
    """A StatusBoard over the daemon that `client_factory` reaches (None: no daemon, only the API's own
    requests); `totals` gives the API's (tokens reused, tokens computed)."""
    holder: list[Client] = []

    def client() -> Client | None:
        if client_factory is None:
            return None
        if not holder:
            holder.append(client_factory())
        return holder[0]

    def read() -> Reading:
        reused, computed = totals()
        c = client()
        if c is None:
            return Reading([], 0, reused, computed)
        stats = c.stats()
        tiers = [TierReading(t.tier, t.capacity_bytes, t.used_bytes, t.num_blocks, t.lookup_hits) for t in stats.tiers]
        return Reading(tiers, stats.lookup_misses, reused, computed)

    def blocks(tenant: str | None) -> tuple[list[BlockRow], dict[bytes, tuple[str, bool]]]:
        c = client()
        if c is None:
            return [], {}
        listing = c.listing(limit=LIST_LIMIT)
        rows = [BlockRow(e.namespace, e.parent_store_key, e.num_tokens, e.tiers, e.hits, e.last_access, e.pinned,
                         e.preview) for e in listing.entries]
        return rows, {d.digest: (d.model, bool(d.salt_digest)) for d in listing.namespaces}

    return StatusBoard("api", read, blocks, recent, version=version)


def _file(name: str) -> Response:
    found = static_file(name)
    if found is None:
        return Response(f"no file {name}\n", status_code=404, media_type="text/plain")
    body, kind = found
    return Response(body, media_type=kind, headers=dict(HEADERS))


@router.get("/status", include_in_schema=False)
async def page() -> Response:
    return _file("index.html")


@router.get("/status/{name}", include_in_schema=False)
async def asset(name: str) -> Response:
    return _file(name)


@router.get("/status.json", include_in_schema=False)
async def figures(request: Request, who: Who) -> Any:
    """The page's figures. With --api-keys: a key is needed, no preview is shown and only the caller's
    tenant's requests are listed; without, everything (loopback callers only)."""
    api: APIState = request.app.state.api
    assert api.status is not None
    keyed = api.keys is not None
    snapshot = await asyncio.to_thread(api.status.snapshot, requests_of=who.tenant if keyed else None,
                                       previews=not keyed)
    pool = api.pool
    snapshot.update(model=api.model_id, workers={"ready": pool.num_ready, "busy": pool.num_busy,
                                                 "total": pool.num_workers, "queued": pool.num_waiting})
    return Response(_json(snapshot), media_type="application/json", headers=dict(HEADERS))


def _json(value: dict) -> bytes:
    import json

    return json.dumps(value).encode()
