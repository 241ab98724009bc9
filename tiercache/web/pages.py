"""The status page's files and routes: /status (the page), /status/<file>, /status.json (the figures)."""

from __future__ import annotations

import hmac
import importlib.resources
import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from tiercache.web.board import StatusBoard

# The page's files (package data: tiercache/web/static/) and their content types.
FILES = {"index.html": "text/html; charset=utf-8", "status.js": "text/javascript; charset=utf-8",
         "status.css": "text/css; charset=utf-8"}
# No inline script or style, nothing fetched from elsewhere: the page is read-only and stays so.
HEADERS = [("Content-Security-Policy", "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'"),
           ("X-Content-Type-Options", "nosniff"), ("Cache-Control", "no-store")]


def static_file(name: str) -> tuple[bytes, str] | None:
    """(bytes, content type) of one of the page's files, None for any other name."""
    if name not in FILES:
        return None
    return (importlib.resources.files("tiercache.web") / "static" / name).read_bytes(), FILES[name]


def bearer(authorization: str | None, api_key: str | None = None) -> str | None:
    """The key a request carries: `x-api-key`, else `Authorization: Bearer KEY`."""
    if api_key:
        return api_key
    scheme, _, value = (authorization or "").partition(" ")
    return value.strip() or None if scheme.lower() == "bearer" else None


def tenant_of(given: str | None, keys: Mapping[str, str]) -> str | None:
    """The tenant whose key `given` is (every key compared, in constant time), None for no match."""
    tenant = None
    for key, name in keys.items():
        if given is not None and hmac.compare_digest(key.encode(), given.encode()):
            tenant = name
    return tenant


class StatusPages:
    """The status page as a WSGI app (the daemon's metrics port). With `tokens` (token -> tenant, the
    daemon's server.tokens), status.json needs one, and shows only its tenant's namespaces; without,
    everything (the port is the operator's: loopback unless server.metrics_host says otherwise)."""

    def __init__(self, board: StatusBoard, tokens: Mapping[str, str] | None = None) -> None:
        self.board, self.tokens = board, dict(tokens or {})

    def __call__(self, environ: dict, start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/":
            start_response("302 Found", [("Location", "/status"), ("Content-Length", "0")])
            return [b""]
        if environ.get("REQUEST_METHOD", "GET") not in ("GET", "HEAD"):
            return _reply(start_response, "405 Method Not Allowed", {"error": "the status page is read-only"})
        if path == "/status.json":
            blocks_of = None
            if self.tokens:
                given = bearer(environ.get("HTTP_AUTHORIZATION"), environ.get("HTTP_X_API_KEY"))
                blocks_of = tenant_of(given, self.tokens)
                if blocks_of is None:
                    return _reply(start_response, "401 Unauthorized",
                                  {"error": "this daemon has server.tokens: send `Authorization: Bearer TOKEN`"})
            return _reply(start_response, "200 OK", self.board.snapshot(blocks_of=blocks_of))
        found = static_file("index.html" if path in ("/status", "/status/") else path.removeprefix("/status/"))
        if found is None:
            return _reply(start_response, "404 Not Found", {"error": f"no page {path}"})
        body, kind = found
        start_response("200 OK", [("Content-Type", kind), ("Content-Length", str(len(body))), *HEADERS])
        return [body]


def _reply(start_response: Callable[..., Any], status: str, payload: dict) -> list[bytes]:
    body = json.dumps(payload).encode()
    start_response(status, [("Content-Type", "application/json"), ("Content-Length", str(len(body))), *HEADERS])
    return [body]
