"""The HTTP app: the three routers over one worker pool, error shapes, metrics, and the server's lifetime."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tiercache.api import anthropic, errors, ollama, openai
from tiercache.api.state import APIMetrics, APIState

logger = logging.getLogger(__name__)


class _CountResponses:
    """Counts each API response by family and status (tiercache_api_responses_total). Plain ASGI: a
    BaseHTTPMiddleware would pass every streamed chunk through an extra task and queue."""

    def __init__(self, app, metrics: APIMetrics) -> None:  # noqa: ANN001 - an ASGI app
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001
        path = scope.get("path", "")
        family = "ollama" if path.startswith("/api/") else "anthropic" if path.startswith("/v1/messages") else \
            "openai" if path.startswith("/v1/") else None
        if scope["type"] != "http" or family is None:  # /health and /metrics are not counted
            return await self.app(scope, receive, send)

        async def counting_send(message) -> None:  # noqa: ANN001
            if message["type"] == "http.response.start":
                self.metrics.responses.labels(family, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


def create_app(api: APIState) -> FastAPI:
    """The app serving `api`: its pool starts with the app (requests get 503 until a worker is ready) and is
    closed with it."""
    api.metrics = api.metrics or APIMetrics(api.pool)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        api.pool.start()
        try:
            yield
        finally:
            await asyncio.to_thread(api.pool.close)

    app = FastAPI(title="tiercache", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.api = api
    errors.install(app)
    app.include_router(openai.router)
    app.include_router(anthropic.router)
    app.include_router(ollama.router)

    app.add_middleware(_CountResponses, metrics=api.metrics)

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        return Response(generate_latest(api.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health", include_in_schema=False)
    async def health() -> Response:
        ready = api.pool.ready
        return Response("ok\n" if ready else "loading\n", status_code=200 if ready else 503, media_type="text/plain")

    @app.get("/", include_in_schema=False)
    async def root() -> Response:
        return Response("Ollama is running", media_type="text/plain")  # what Ollama clients probe for

    return app
