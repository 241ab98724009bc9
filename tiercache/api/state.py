"""What every router shares: the pool, the chat format, the keys, the metrics, and the checks they all make."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tiercache.api.errors import APIError
from tiercache.api.generate import Outcome
from tiercache.api.pool import WorkerPool
from tiercache.api.prompts import ChatFormat
from tiercache.metrics import RequestMetrics
from tiercache.web.board import Reading, StatusBoard

DEFAULT_MAX_TOKENS = 256  # when a request sets no limit


class APIMetrics:
    """Prometheus figures of the API: tiercache_api_requests_total, tokens_reused_total, tokens_computed_total,
    ttft_seconds (request arrival to first token, queue included), responses_total{api, status},
    tokens_generated_total, queue_depth and workers_busy."""

    def __init__(self, pool: WorkerPool) -> None:
        self.registry = CollectorRegistry()
        self.requests = RequestMetrics(self.registry, "tiercache_api_")
        self.responses = Counter("tiercache_api_responses", "HTTP responses by API family and status",
                                 ["api", "status"], registry=self.registry)
        self.registry.register(_PoolCollector(pool))

    def observe(self, outcome: Outcome) -> None:
        self.requests.observe(cached_tokens=outcome.cached_tokens,
                              computed_tokens=outcome.prompt_tokens - outcome.cached_tokens,
                              ttft_s=outcome.ttft_s, prefill_s=outcome.prefill_s, tiers=outcome.tiers,
                              tenant=outcome.tenant)

    def totals(self) -> tuple[int, int]:
        """(prompt tokens reused, computed) since the server started."""
        return int(self.requests.total("tokens_reused")), int(self.requests.total("tokens_computed"))


class _PoolCollector:
    """The pool's own figures, read at each scrape."""

    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool

    def collect(self):
        yield CounterMetricFamily("tiercache_api_tokens_generated", "Tokens generated (cancelled requests' too)",
                                  value=self.pool.num_tokens)
        yield GaugeMetricFamily("tiercache_api_queue_depth", "Requests waiting for a worker",
                                value=self.pool.num_waiting)
        yield GaugeMetricFamily("tiercache_api_workers_busy", "Workers running a request", value=self.pool.num_busy)
        yield GaugeMetricFamily("tiercache_api_workers_ready", "Workers with the model loaded",
                                value=self.pool.num_ready)
        yield CounterMetricFamily("tiercache_api_worker_restarts", "Workers started again after one exited",
                                  value=self.pool.num_restarts)


def _no_daemon(metrics: APIMetrics) -> Callable[[], Reading]:
    def read() -> Reading:
        reused, computed = metrics.totals()
        return Reading([], 0, reused, computed)
    return read


@dataclass
class APIState:
    pool: WorkerPool
    chat: ChatFormat
    keys: dict[str, str] | None = None  # API key -> tenant; None: loopback callers only
    started: float = field(default_factory=time.time)
    model_name: str = ""  # the served model's name, known before the workers load it ("" if not)
    model_context: int = 0  # its context in tokens, likewise
    load_wait_s: float = 30.0  # how long a request waits for the workers to load the model, then 503
    metrics: APIMetrics = field(init=False)
    # The status page's figures: the API's own requests; `tiercache api` gives it its daemon too (status.py).
    status: StatusBoard = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = APIMetrics(self.pool)
        self.status = StatusBoard("api", _no_daemon(self.metrics), lambda tenant: ([], {}),
                                  self.metrics.requests.recent)

    @property
    def model_id(self) -> str:
        return self.pool.info.get("name") or self.model_name

    @property
    def context(self) -> int:
        return int(self.pool.info.get("context") or self.model_context)

    def check_model(self, name: str, *, ollama: bool = False) -> None:
        """404 unless `name` is the served model (Ollama clients may add the tag ":latest")."""
        if not self.model_id:
            return  # the name is known once a worker loads the model; until then, 503 (ready())
        if name == self.model_id or (ollama and name == f"{self.model_id}:latest"):
            return
        raise APIError(404, f"model {name!r} is not served here; this server serves {self.model_id!r}",
                       param="model", code="model_not_found")

    def max_tokens(self, prompt_tokens: int, asked: int | None, param: str) -> int:
        """The generation limit for a prompt: `asked`, else DEFAULT_MAX_TOKENS within the context; a prompt
        that leaves no room, or an explicit limit past the context, is a 400 naming `param`."""
        context = self.context
        if context and prompt_tokens >= context:
            raise APIError(400, f"the prompt's {prompt_tokens} tokens exceed the model's context of {context} "
                                f"tokens", param="messages", code="context_length_exceeded")
        if asked is None:
            return min(DEFAULT_MAX_TOKENS, context - prompt_tokens) if context else DEFAULT_MAX_TOKENS
        if context and prompt_tokens + asked > context:
            raise APIError(400, f"the prompt's {prompt_tokens} tokens plus {param}={asked} exceed the model's "
                                f"context of {context} tokens", param=param, code="context_length_exceeded")
        return asked


def state(request: Request) -> APIState:
    """The server's APIState (a FastAPI dependency)."""
    return request.app.state.api


async def ready(request: Request) -> APIState:
    """The server's APIState once a worker has loaded the model (a FastAPI dependency for the routes that
    generate): a request that arrives while the workers load waits up to load_wait_s, then gets 503."""
    api: APIState = request.app.state.api
    await api.pool.wait_loaded(api.load_wait_s)
    return api


State = Annotated[APIState, Depends(state)]
Ready = Annotated[APIState, Depends(ready)]  # routes that need a worker
