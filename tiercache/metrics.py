"""Prometheus request metrics (a worker's own, or the daemon's sum of worker reports) and the HTTP endpoint."""

from __future__ import annotations

import logging
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

from tiercache.errors import InvalidArgument

logger = logging.getLogger(__name__)

TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
THROUGHPUT_BUCKETS = (100.0, 300.0, 1e3, 3e3, 1e4, 3e4, 1e5, 3e5, 1e6)


class RequestMetrics:
    """Per-request figures of served prompts, as Prometheus counters and histograms under `prefix`.

    Metrics (prefix "tiercache_" in the daemon, "tiercache_worker_" in a worker):
    requests_total, tokens_reused_total (prompt tokens served from the cache), tokens_computed_total
    (prompt tokens prefilled), prefill_seconds_total (time spent prefilling them; prefill throughput
    is rate(tokens_computed_total) / rate(prefill_seconds_total)), ttft_seconds (histogram: request
    received to first-token scores) and prefill_tokens_per_second (histogram, one sample per request
    that prefilled anything). tokens_reused + tokens_computed = prompt tokens of every request.
    """

    def __init__(self, registry: CollectorRegistry, prefix: str) -> None:
        self.registry = registry
        self.prefix = prefix
        self._requests = Counter(f"{prefix}requests", "Requests served", registry=registry)
        self._reused = Counter(f"{prefix}tokens_reused", "Prompt tokens served from the cache", registry=registry)
        self._computed = Counter(f"{prefix}tokens_computed", "Prompt tokens prefilled", registry=registry)
        self._prefill_s = Counter(f"{prefix}prefill_seconds", "Seconds spent prefilling computed tokens",
                                  registry=registry)
        self._ttft = Histogram(f"{prefix}ttft_seconds", "Time to first token", buckets=TTFT_BUCKETS_S,
                               registry=registry)
        self._throughput = Histogram(f"{prefix}prefill_tokens_per_second", "Prefill throughput per request",
                                     buckets=THROUGHPUT_BUCKETS, registry=registry)

    def observe(self, *, cached_tokens: int, computed_tokens: int, ttft_s: float, prefill_s: float) -> None:
        """Count one request (the caller has checked that the figures are finite and >= 0)."""
        self._requests.inc()
        self._reused.inc(cached_tokens)
        self._computed.inc(computed_tokens)
        self._prefill_s.inc(prefill_s)
        self._ttft.observe(ttft_s)
        if computed_tokens and prefill_s > 0:
            self._throughput.observe(computed_tokens / prefill_s)

    def total(self, name: str) -> float:
        """The current value of one of the counters, e.g. total("tokens_reused")."""
        return self.registry.get_sample_value(f"{self.prefix}{name}_total") or 0.0


def serve_metrics(registry: CollectorRegistry, port: int, host: str = "127.0.0.1") -> Callable[[], None]:
    """Serve `registry` at http://host:port/metrics from a daemon thread; returns the function that stops it.

    Loopback by default: the endpoint has no authentication, so reaching it from the network is the
    operator's choice (server.metrics_host, `tiercache worker --metrics-host`)."""
    try:
        httpd, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as e:
        raise InvalidArgument(f"cannot serve metrics on {host}:{port} ({e.strerror}); "
                              "choose another server.metrics_port") from None
    logger.info("metrics on http://%s:%d/metrics", host, httpd.server_port)

    def stop() -> None:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5.0)
    return stop
