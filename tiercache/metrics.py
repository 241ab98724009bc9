"""Prometheus request metrics (a worker's own, or the daemon's sum of worker reports) and the HTTP endpoint."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, Counter, Histogram, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from tiercache.errors import InvalidArgument
from tiercache.web.board import RecentRequests, RequestRow

WSGIApp = Callable[[dict, Callable[..., Any]], Iterable[bytes]]

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

    def __init__(self, registry: CollectorRegistry, prefix: str, recent: RecentRequests | None = None) -> None:
        self.registry = registry
        self.prefix = prefix
        self.recent = recent or RecentRequests()  # the last requests, for the status page
        self._requests = Counter(f"{prefix}requests", "Requests served", registry=registry)
        self._reused = Counter(f"{prefix}tokens_reused", "Prompt tokens served from the cache", registry=registry)
        self._computed = Counter(f"{prefix}tokens_computed", "Prompt tokens prefilled", registry=registry)
        self._prefill_s = Counter(f"{prefix}prefill_seconds", "Seconds spent prefilling computed tokens",
                                  registry=registry)
        self._ttft = Histogram(f"{prefix}ttft_seconds", "Time to first token", buckets=TTFT_BUCKETS_S,
                               registry=registry)
        self._throughput = Histogram(f"{prefix}prefill_tokens_per_second", "Prefill throughput per request",
                                     buckets=THROUGHPUT_BUCKETS, registry=registry)

    def observe(self, *, cached_tokens: int, computed_tokens: int, ttft_s: float, prefill_s: float,
                tiers: Sequence[str] = (), tenant: str = "") -> None:
        """Count one request (the caller has checked that the figures are finite and >= 0)."""
        self.recent.add(RequestRow(time.time(), cached_tokens + computed_tokens, cached_tokens, ttft_s, tuple(tiers),
                                   tenant))
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


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("metrics http: " + format, *args)


def serve_metrics(registry: CollectorRegistry, port: int, host: str = "127.0.0.1",
                  pages: WSGIApp | None = None) -> Callable[[], None]:
    """Serve `registry` at http://host:port/metrics from a daemon thread, and `pages` (the status page) at
    / and /status*; returns the function that stops it.

    Loopback by default: /metrics has no authentication, so reaching it from the network is the
    operator's choice (server.metrics_host, `tiercache worker --metrics-host`)."""
    metrics = make_wsgi_app(registry)

    def app(environ: dict, start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if pages is not None and (path == "/" or path.startswith("/status")):
            return pages(environ, start_response)
        return metrics(environ, start_response)

    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]  # an IPv6 host needs AF_INET6

        class Server(ThreadingWSGIServer):
            address_family = family

        httpd = make_server(host, port, app, Server, handler_class=_QuietHandler)
    except OSError as e:
        raise InvalidArgument(f"cannot serve metrics on {host}:{port} ({e.strerror}); "
                              "choose another server.metrics_port") from None
    thread = threading.Thread(target=httpd.serve_forever, name="metrics-http", daemon=True)
    thread.start()
    logger.info("metrics on http://%s:%d/metrics%s", host, httpd.server_port,
                ", status page on /status" if pages is not None else "")

    def stop() -> None:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5.0)
    return stop
