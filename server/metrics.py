"""The daemon's Prometheus metrics: store and tier figures read at scrape time, rpc latency, worker reports."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from server.auth import HANDLER_KINDS
from server.namespaces import NamespaceRegistry
from tiercache import __version__
from tiercache.block import TIER_ORDER
from tiercache.metrics import RequestMetrics
from tiercache.store import TieredStore
from tiercache.web.board import BlockRow, Reading, StatusBoard, TierReading

logger = logging.getLogger(__name__)

RPC_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _by_tier(family: CounterMetricFamily | GaugeMetricFamily, values: Mapping[str, float]) -> Metric:
    for tier, value in values.items():
        family.add_metric([tier], value)
    return family


class StoreCollector(Collector):
    """Reads the store's counters and tier stats at every scrape (nothing is kept twice).

    Lookup accounting (one store lock, so it holds in every scrape): each key asked by a Lookup call
    is a hit, counted under the tier that answered, when it is in the present prefix, else a miss
    (every key after the first missing one is a miss; with LookupRequest.holes, each present key is a hit):
    tiercache_lookups_total = sum(tiercache_lookup_hits_total) + tiercache_lookup_misses_total.

    Figures are summed over tenants; with `tenant_labels`, tiercache_tenant_payload_bytes{tenant}
    also names each tenant (off by default: a scrape should not list who uses the cache).
    """

    def __init__(self, store: TieredStore, *, tenant_labels: bool = False) -> None:
        self._store = store
        self._tenant_labels = tenant_labels

    def collect(self) -> Iterator[Metric]:
        c = self._store.snapshot_counters()
        tiers = self._store.tier_stats()
        names = [t.name for t in tiers]
        hits = {n: c.get(f"lookup_hits_{n}", 0) for n in names}
        yield _counter("tiercache_lookup_calls", "Lookup calls", c.get("lookups", 0))
        yield _counter("tiercache_lookups", "Keys looked up (hits + misses)",
                       c.get("lookup_blocks_hit", 0) + c.get("lookup_blocks_missed", 0))
        yield _by_tier(CounterMetricFamily("tiercache_lookup_hits", "Looked-up keys in the present prefix, "
                                           "by the tier that answered", labels=["tier"]), hits)
        yield _counter("tiercache_lookup_misses", "Looked-up keys not in the present prefix",
                       c.get("lookup_blocks_missed", 0))
        yield _by_tier(CounterMetricFamily("tiercache_fetch_hits", "Blocks read for Fetch/Prefetch, by tier",
                                           labels=["tier"]), {n: c.get(f"hits_{n}", 0) for n in names})
        yield _counter("tiercache_fetch_misses", "Fetched keys that were absent or expired", c.get("misses", 0))
        yield _counter("tiercache_puts", "Blocks stored (present keys not counted)", c.get("puts", 0))
        yield _by_tier(CounterMetricFamily("tiercache_evictions", "Blocks evicted from a tier to make room",
                                           labels=["tier"]), {n: c.get(f"evictions_{n}", 0) for n in names})
        yield _by_tier(CounterMetricFamily("tiercache_promotions", "Blocks copied up into a tier",
                                           labels=["tier"]), {n: c.get(f"promotions_to_{n}", 0) for n in names})
        demotions = CounterMetricFamily("tiercache_demotions", "Blocks moved down on eviction",
                                        labels=["from_tier", "to_tier"])
        for a in TIER_ORDER:
            for b in TIER_ORDER:
                if f"demotions_{a}_to_{b}" in c:
                    demotions.add_metric([a, b], c[f"demotions_{a}_to_{b}"])
        yield demotions
        yield _counter("tiercache_expired", "Blocks dropped when their TTL passed", c.get("expired", 0))
        yield _counter("tiercache_verification_failures", "Blocks dropped after failing a checksum",
                       c.get("verification_failures", 0))
        yield _counter("tiercache_disk_write_skipped", "write_through copies skipped: disk tier full",
                       c.get("disk_write_skipped", 0))
        yield _by_tier(GaugeMetricFamily("tiercache_tier_capacity_bytes", "Tier capacity", labels=["tier"]),
                       {t.name: t.capacity_bytes for t in tiers})
        yield _by_tier(GaugeMetricFamily("tiercache_tier_used_bytes", "Tier capacity in use (whole pages; "
                                         "disk: stored record bytes)", labels=["tier"]),
                       {t.name: t.used_bytes for t in tiers})
        yield _by_tier(GaugeMetricFamily("tiercache_tier_blocks", "Blocks in a tier", labels=["tier"]),
                       {t.name: t.num_blocks for t in tiers})
        by_tenant = dict(self._store.index.bytes_by_tenant)  # a dict copy is atomic
        yield GaugeMetricFamily("tiercache_kv_payload_bytes", "KV payload bytes of the distinct cached blocks",
                                value=sum(by_tenant.values()))
        if self._tenant_labels:
            tenant_bytes = GaugeMetricFamily("tiercache_tenant_payload_bytes", "KV payload bytes per tenant",
                                             labels=["tenant"])
            for tenant, nbytes in sorted(by_tenant.items()):
                tenant_bytes.add_metric([tenant], nbytes)
            yield tenant_bytes
        yield from _scrub_metrics(self._store)
        info = GaugeMetricFamily("tiercache_build_info", "Daemon version", labels=["version"])
        info.add_metric([__version__], 1)
        yield info


def _scrub_metrics(store: TieredStore) -> Iterator[Metric]:
    """The disk scrub's figures (none unless it runs)."""
    scrub = store.scrub_progress()
    if scrub is None:
        return
    yield _counter("tiercache_scrub_bytes", "Disk tier bytes read and verified by the background scrub",
                   scrub.bytes_scrubbed)
    yield _counter("tiercache_scrub_blocks", "Disk tier blocks read and verified by the background scrub",
                   scrub.blocks_scrubbed)
    yield _counter("tiercache_scrub_damaged_blocks", "Damaged disk tier blocks the scrub found and dropped "
                   "(also in tiercache_verification_failures_total)", scrub.damaged_blocks)
    yield _counter("tiercache_scrub_passes", "Full scrub passes over the disk tier", scrub.passes)
    yield _counter("tiercache_scrub_paused_seconds", "Seconds the scrub waited for calls to stop", scrub.paused_s)
    yield GaugeMetricFamily("tiercache_scrub_pass_fraction", "Share of the key space the current scrub pass has "
                            "covered (0 between passes)", value=scrub.pass_fraction)
    yield GaugeMetricFamily("tiercache_scrub_last_pass_timestamp_seconds", "When the last full scrub pass ended "
                            "(unix seconds; 0: never)", value=scrub.last_pass_unix_s)
    yield GaugeMetricFamily("tiercache_scrub_paused", "1 while the scrub waits for calls to stop",
                            value=float(scrub.paused))


class RpcMetrics(grpc.ServerInterceptor):
    """Times every TierCache call (streams until their last message) and counts failures by code;
    logs each call at DEBUG."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._duration = Histogram("tiercache_rpc_duration_seconds", "Call duration by method",
                                   ["method"], buckets=RPC_BUCKETS_S, registry=registry)
        self._errors = Counter("tiercache_rpc_errors", "Failed calls by method and status code",
                               ["method", "code"], registry=registry)

    def _done(self, method: str, start: float, context: Any, failed: bool) -> None:
        seconds = time.perf_counter() - start
        self._duration.labels(method).observe(seconds)
        code = "OK"
        if failed:
            status = context.code()
            if isinstance(status, grpc.StatusCode):
                code = status.name
            else:  # no status set: the caller went away mid-call
                code = "CANCELLED" if not context.is_active() else "UNKNOWN"
            self._errors.labels(method, code).inc()
        logger.debug("rpc %s tenant=%s ms=%.2f code=%s", method, getattr(context, "tenant", "?"), seconds * 1e3, code)

    def intercept_service(self, continuation: Callable[[Any], Any], details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        if handler is None or not details.method.startswith("/tiercache."):
            return handler
        method = details.method.rsplit("/", 1)[-1]
        attribute, factory = HANDLER_KINDS[(handler.request_streaming, handler.response_streaming)]
        behavior = getattr(handler, attribute)

        def unary(request: Any, context: Any) -> Any:
            start, failed = time.perf_counter(), True
            try:
                reply = behavior(request, context)
                failed = False
                return reply
            finally:
                self._done(method, start, context, failed)

        def streaming(request: Any, context: Any) -> Iterator[Any]:
            start, failed = time.perf_counter(), True
            try:
                yield from behavior(request, context)
                failed = False
            finally:
                self._done(method, start, context, failed)

        return factory(streaming if handler.response_streaming else unary,
                       request_deserializer=handler.request_deserializer,
                       response_serializer=handler.response_serializer)


class DaemonMetrics:
    """Everything the daemon exposes on its metrics port, in one registry of its own."""

    def __init__(self, store: TieredStore, *, tenant_labels: bool = False) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(StoreCollector(store, tenant_labels=tenant_labels))
        self.rpc = RpcMetrics(self.registry)
        self.reports = RequestMetrics(self.registry, "tiercache_")


def status_board(store: TieredStore, namespaces: NamespaceRegistry, reports: RequestMetrics) -> StatusBoard:
    """The status page's figures of this daemon: its store's tiers and counters, the requests its workers
    reported, the namespaces of its blocks as their workers described them."""

    def read() -> Reading:
        c = store.snapshot_counters()
        tiers = [TierReading(t.name, t.capacity_bytes, t.used_bytes, t.num_blocks, c.get(f"lookup_hits_{t.name}", 0))
                 for t in store.tier_stats()]
        return Reading(tiers, c.get("lookup_blocks_missed", 0), int(reports.total("tokens_reused")),
                       int(reports.total("tokens_computed")))

    def blocks(tenant: str | None) -> tuple[list[BlockRow], dict[bytes, tuple[str, bool]]]:
        entries = store.entries(tenant=tenant)
        rows = [BlockRow(e.meta.namespace, e.meta.parent, e.meta.num_tokens, e.tiers, e.hits, e.last_access, e.pinned,
                         e.meta.preview) for e in entries]
        models: dict[bytes, tuple[str, bool]] = {}
        for owner in {e.meta.tenant for e in entries}:
            digests = {e.meta.namespace for e in entries if e.meta.tenant == owner}
            for digest, fields in namespaces.describe(owner, digests).items():
                models[digest] = (str(fields.get("model", "")), bool(fields.get("salt_digest")))
        return rows, models

    return StatusBoard("daemon", read, blocks, reports.recent, version=__version__)
