"""The HTTP app: the three routers over one worker pool, error shapes, metrics, and the server's lifetime."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tiercache.api import anthropic, errors, ollama, openai, status
from tiercache.api.auth import Who
from tiercache.api.state import APIMetrics, APIState

logger = logging.getLogger(__name__)


class _CountResponses:
    """Counts each API response by family and status (tiercache_api_responses_total). Plain ASGI: a
    BaseHTTPMiddleware would pass every streamed chunk through an extra task and queue."""

    def __init__(self, app, metrics: APIMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "")
        family = "ollama" if path.startswith("/api/") else "anthropic" if path.startswith("/v1/messages") else \
            "openai" if path.startswith("/v1/") else None
        if scope["type"] != "http" or family is None:  # /health and /metrics are not counted
            return await self.app(scope, receive, send)

        async def counting_send(message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.responses.labels(family, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


def create_app(api: APIState) -> FastAPI:
    """The app serving `api`: its pool starts with the app (a request waits for a worker to load the model,
    up to api.load_wait_s, then gets 503) and is closed with it, as is the status page's board."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        api.pool.start()
        api.status.start()
        try:
            yield
        finally:
            api.status.stop()
            await asyncio.to_thread(api.pool.close)

    app = FastAPI(title="tiercache", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.api = api
    errors.install(app)
    app.include_router(openai.router)
    app.include_router(anthropic.router)
    app.include_router(ollama.router)
    app.include_router(status.router)

    app.add_middleware(_CountResponses, metrics=api.metrics)

    @app.get("/metrics", include_in_schema=False)
    async def metrics(who: Who) -> Response:  # with --api-keys, a key is needed
        return Response(generate_latest(api.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health", include_in_schema=False)
    async def health() -> Response:
        """200 and "ready" once a worker has loaded the model; 503 and "loading" (or "failed": every worker
        exited while loading) before."""
        pool = api.pool
        state = "ready" if pool.ready else "loading" if pool.loading else "failed"
        return JSONResponse({"status": state, "model": api.model_id, "workers_ready": pool.num_ready,
                             "workers": pool.num_workers}, status_code=200 if pool.ready else 503,
                            headers=None if pool.ready else {"Retry-After": str(errors.RETRY_AFTER_S)})

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def root() -> Response:
        return Response("Ollama is running", media_type="text/plain")  # what Ollama clients probe for (HEAD too)

    return app
