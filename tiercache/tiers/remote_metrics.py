"""The remote tier's Prometheus figures, read from its counters at every scrape."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tiercache.tiers.remote import RemoteTier

# counter -> (metric name without _total, help)
COUNTERS = {
    "hits": ("tiercache_remote_hits", "Blocks read from the remote tier and verified"),
    "misses": ("tiercache_remote_misses", "Remote reads that ended a prefix: absent, failed shard, forged or damaged"),
    "verification_failures": ("tiercache_remote_verification_failures",
                              "Remote values that failed their MAC or checksum (never served)"),
    "bytes_read": ("tiercache_remote_read_bytes", "Bytes of values read from the remote tier"),
    "bytes_written": ("tiercache_remote_written_bytes", "Bytes of values written to the remote tier"),
    "puts": ("tiercache_remote_puts", "Blocks written to the remote tier"),
    "write_errors": ("tiercache_remote_write_errors", "Blocks whose write failed (shard down, refused)"),
    "writes_dropped": ("tiercache_remote_writes_dropped", "Blocks not written: the write queue was full"),
    "legacy_reads": ("tiercache_remote_legacy_reads",
                     "Values in the old signed format (TCR1) read and verified: the format transition's progress"),
    "errors": ("tiercache_remote_errors", "Failures of a shard or of the whole cluster (each a miss, never an error)"),
}


class RemoteCollector(Collector):
    """tiercache_remote_* counters and the writer's queue depth (tiercache_remote_queue_blocks)."""

    def __init__(self, tier: RemoteTier) -> None:
        self._tier = tier

    def collect(self) -> Iterator[Metric]:
        c = self._tier.remote_counters()
        for key, (name, doc) in COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=c[key])
        yield GaugeMetricFamily("tiercache_remote_queue_blocks", "Blocks waiting for the remote writer",
                                value=c["queue_blocks"])
        census = self._tier.census()
        yield GaugeMetricFamily("tiercache_remote_cluster_blocks",
                                "Blocks in the cluster under this daemon's key prefix (every daemon's), estimated "
                                "from random keys", value=census.blocks)
        yield GaugeMetricFamily("tiercache_remote_cluster_bytes",
                                "Bytes of those blocks' values, estimated from random keys", value=census.bytes)
