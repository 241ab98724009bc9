"""The client's operator calls: stats, list, flush, evict, pin, unpin and verify."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tiercache.client.types import (
    ListedBlock,
    Listing,
    NamespaceDescription,
    RemoteUsage,
    ScrubUsage,
    ServiceStats,
    TenantUsage,
    TierUsage,
    VerifyResult,
)
from tiercache.errors import NotFound
from tiercache.v1 import tiercache_pb2 as pb
from tiercache.v1 import tiercache_pb2_grpc as pb_grpc

TIER_NAMES = {pb.TIER_GPU: "gpu", pb.TIER_HOST: "host", pb.TIER_DISK: "disk", pb.TIER_REMOTE: "remote"}
TIER_VALUES = {v: k for k, v in TIER_NAMES.items()}


class ManageCalls:
    """Client's operator calls; the connection state they use is set up by Client.__init__."""

    timeout_s: float
    _stub: pb_grpc.TierCacheStub
    _call: Callable[..., Any]

    def stats(self) -> ServiceStats:
        r = self._call(self._stub.Stats, pb.StatsRequest())
        tiers = [TierUsage(TIER_NAMES[t.tier], t.capacity_bytes, t.tenant_blocks, t.tenant_bytes, t.used_bytes,
                           t.num_blocks, t.hits, t.misses, t.puts, t.evictions, t.verification_failures,
                           t.promotions, t.lookup_hits)
                 for t in r.tiers]
        m = r.remote
        remote = RemoteUsage(m.bytes_read, m.bytes_written, m.blocks_pulled, m.errors, m.write_errors,
                             m.writes_dropped, m.queue_blocks, m.cluster_blocks, m.cluster_bytes, m.census_samples,
                             m.census_failed_primaries) if r.HasField("remote") else None
        c = r.scrub
        scrub = ScrubUsage(c.bytes_per_s, c.bytes_scrubbed, c.blocks_scrubbed, c.damaged_blocks, c.passes,
                           c.pass_fraction, c.last_pass_unix_s, c.next_pass_unix_s, c.paused,
                           c.paused_s) if r.HasField("scrub") else None
        return ServiceStats(r.tenant, tiers, r.tenant_bytes, r.tenant_quota_bytes, r.version,
                            [TenantUsage(t.tenant, t.num_blocks, t.bytes) for t in r.tenants], r.lookups,
                            r.lookup_misses, r.verification_failures, r.tokens_reused, r.tokens_computed,
                            r.requests_reported, remote, scrub)

    def list(self, namespace: bytes | None = None, limit: int = 0) -> list[ListedBlock]:
        """The caller's blocks, most recently used first (NotFound for a namespace with none)."""
        return self.listing(namespace, limit).entries

    def listing(self, namespace: bytes | None = None, limit: int = 0) -> Listing:
        """list() plus the total before the limit and the namespaces' descriptions."""
        r = self._call(self._stub.List, pb.ListRequest(namespace=namespace or b"", limit=limit))
        entries = [ListedBlock(e.store_key, e.parent_store_key, e.namespace, e.num_tokens, e.dtype, tuple(e.shape),
                               e.nbytes, tuple(TIER_NAMES[t] for t in e.tiers), e.hits, e.last_access_unix_s,
                               e.pinned, e.expires_unix_s, e.preview, e.pin_expires_unix_s) for e in r.entries]
        return Listing(entries, r.num_total, [NamespaceDescription.from_pb(n) for n in r.namespaces])

    def flush(self, tier: str | None = None, namespace: bytes | None = None, tenant: str = "") -> int:
        """Delete the caller's blocks (of one tier and/or namespace), or another tenant's (operator
        only); returns how many. Tier "remote": the tenant's keys in the cluster shared with other
        daemons, whoever wrote them; no tier: every tier but that one."""
        if tier is not None and tier not in TIER_VALUES:
            raise NotFound(f"unknown tier {tier!r}; expected one of {', '.join(TIER_VALUES)}")
        request = pb.FlushRequest(tier=TIER_VALUES.get(tier or "", pb.TIER_UNSPECIFIED), namespace=namespace or b"",
                                  tenant=tenant)
        return self._call(self._stub.Flush, request).num_removed

    def evict(self, keys: Sequence[bytes] = (), store_keys: Sequence[bytes] = ()) -> int:
        request = pb.EvictRequest(keys=list(keys), store_keys=list(store_keys))
        return self._call(self._stub.Evict, request).num_evicted

    def pin(self, keys: Sequence[bytes] = (), ttl_s: float | None = None, store_keys: Sequence[bytes] = ()) -> int:
        request = pb.PinRequest(keys=list(keys), store_keys=list(store_keys), ttl_s=ttl_s or 0.0)
        return self._call(self._stub.Pin, request).num_pinned

    def unpin(self, keys: Sequence[bytes] = (), store_keys: Sequence[bytes] = ()) -> int:
        request = pb.UnpinRequest(keys=list(keys), store_keys=list(store_keys))
        return self._call(self._stub.Unpin, request).num_unpinned

    def verify(self, store_keys: Sequence[bytes] = ()) -> VerifyResult:
        """Check the checksums of the caller's blocks (all, or those named by store keys)."""
        r = self._call(self._stub.Verify, pb.VerifyRequest(store_keys=list(store_keys)),
                       timeout_s=max(self.timeout_s, 60.0))
        return VerifyResult(r.num_checked, r.num_failed, list(r.dropped_store_keys), r.integrity_ok, r.integrity_error)
