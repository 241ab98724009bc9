"""Errors at the HTTP edge: one exception, each API family's error shape, and the status of every failure."""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tiercache.api.pool import NotReady, QueueFull, WorkerFailed
from tiercache.errors import InvalidArgument

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1  # what a 429 or 503 tells the client to wait

# status -> Anthropic's error type
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}
_OPENAI_TYPES = {401: "invalid_request_error", 403: "permission_error", 404: "invalid_request_error",
                 429: "rate_limit_error", 503: "service_unavailable_error"}


class APIError(Exception):
    """A refused request: its HTTP status, a message naming the problem, the field (`param`) and a code."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def from_exception(e: Exception) -> APIError:
    """The APIError for a failure below the edge (pool, worker, prompt building)."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, QueueFull):
        return APIError(429, f"{e}; retry in {RETRY_AFTER_S} s", code="queue_full",
                        headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(e, NotReady):
        return APIError(503, str(e), code="loading", headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(e, InvalidArgument) or (isinstance(e, WorkerFailed) and e.kind == "InvalidArgument"):
        message = str(e)
        if "context of" in message:
            return APIError(400, message, param="messages", code="context_length_exceeded")
        return APIError(400, message)
    logger.error("request failed: %s", e)
    return APIError(500, f"internal error: {e}")


def body(request: Request, error: APIError) -> dict:
    """`error` in the shape of the family the request's path belongs to."""
    path = request.url.path
    if path.startswith("/api/"):
        return {"error": error.message}
    if path.startswith("/v1/messages"):
        return anthropic_body(error)
    return {"error": openai_body(error)}


def anthropic_body(error: APIError) -> dict:
    """`error` as Anthropic's error object."""
    kind = _ANTHROPIC_TYPES.get(error.status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def openai_body(error: APIError) -> dict:
    """The value of OpenAI's "error" field for `error`."""
    kind = _OPENAI_TYPES.get(error.status, "invalid_request_error" if error.status < 500 else "server_error")
    return {"message": error.message, "type": kind, "param": error.param, "code": error.code}


def response(request: Request, error: APIError) -> JSONResponse:
    return JSONResponse(body(request, error), status_code=error.status, headers=error.headers)


_TYPE_TAGS = {"str", "int", "float", "bool", "none", "dict", "list"}


def _field(loc: tuple) -> str:
    """A field path as clients write it (messages[0].content), without pydantic's union member tags."""
    parts = [str(p) for p in loc if p != "body"]
    parts = [p for p in parts if p not in _TYPE_TAGS and "[" not in p and not p[:1].isupper()]
    out = ""
    for part in parts:
        out += f"[{part}]" if part.isdigit() else (f".{part}" if out else part)
    return out


def install(app: FastAPI) -> None:
    """Every refusal in its family's shape: APIError, pydantic validation (400 naming the field), bad JSON,
    unknown paths and methods, and failures from the pool."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return response(request, e)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        # Of a union's alternatives, the one that got furthest names the problem best.
        first = max(e.errors(), key=lambda error: len(error.get("loc", ())))
        if first.get("type") == "json_invalid":
            return response(request, APIError(400, f"the body is not valid JSON: {first.get('msg')}"))
        field = _field(tuple(first.get("loc", ())))
        got = first.get("input")
        detail = "" if first.get("type") == "missing" else f", got {json.dumps(got, default=str)[:80]}"
        message = f"{field}: {first.get('msg')}{detail}" if field else f"{first.get('msg')}{detail}"
        return response(request, APIError(400, message, param=field or None, code="invalid_value"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
        message = f"{request.method} {request.url.path}: {e.detail}"
        return response(request, APIError(e.status_code, message))

    for kind in (QueueFull, NotReady, WorkerFailed, InvalidArgument):
        @app.exception_handler(kind)
        async def _below(request: Request, e: Exception) -> JSONResponse:
            return response(request, from_exception(e))
