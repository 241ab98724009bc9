"""The TierCache servicer: translates messages to TieredStore calls for the caller's tenant, nothing more."""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Iterable, Iterator, Sequence

from server.auth import TenantContext
from server.errors import translated
from server.fetching import Fetcher
from server.namespaces import NamespaceRegistry
from server.puts import PutHandling, ttl_field
from server.records import lookup_reply
from server.staging import StagedPayloads
from tiercache import __version__
from tiercache.config import Config
from tiercache.errors import InvalidArgument, NotFound, PermissionDenied
from tiercache.keys import KEY_BYTES
from tiercache.metrics import RequestMetrics
from tiercache.store import TieredStore
from tiercache.tenancy import LOCAL_TENANT, ScopedKeys, scope_keys
from tiercache.v1 import tiercache_pb2 as pb
from tiercache.v1 import tiercache_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

TIER_TO_PB = {"gpu": pb.TIER_GPU, "host": pb.TIER_HOST, "disk": pb.TIER_DISK, "remote": pb.TIER_REMOTE}
PB_TO_TIER = {v: k for k, v in TIER_TO_PB.items()}
LOOKUP_CODES = {**TIER_TO_PB, "": pb.TIER_UNSPECIFIED}  # "": a hole (LookupRequest.holes)
# Lookup requests remembered by their wire bytes (see _chain), bounded by what they hold: the wire
# bytes and a tuple of store keys (objects mostly shared with the per-tenant memo; counted at 100
# bytes a key). A 128-key chain costs ~17 KiB; a request over 1/64 of the bound is not remembered.
CHAIN_MEMO_BYTES = 16 << 20


def _namespace(value: bytes) -> bytes | None:
    if value and len(value) != KEY_BYTES:
        raise InvalidArgument(f"namespace digest must be {KEY_BYTES} bytes, got {len(value)}")
    return value or None


class TierCacheServicer(PutHandling, pb_grpc.TierCacheServicer):
    """Every method validates its message, scopes keys to the caller's tenant and calls the store."""

    def __init__(self, store: TieredStore, config: Config, namespaces: NamespaceRegistry,
                 reports: RequestMetrics) -> None:
        self._store = store
        self._cfg = config
        self._namespaces = namespaces
        self._reports = reports
        self._max_keys = config.server.max_keys_per_call
        self._host = getattr(store, "host", None)
        self._scoped: dict[str, ScopedKeys] = {}  # tenant -> its remembered store keys (see _scope)
        self._chains: dict[tuple[str, bytes], tuple[bytes, ...]] = {}  # (tenant, wire) -> store keys (see _chain)
        self._chains_bytes = 0
        self._fetcher = Fetcher(store, config)
        # Same-host callers stage Put payloads in files beside the slab (PutRequest.staged).
        self._staging = StagedPayloads(os.path.dirname(self._host.slab_path)) if self._host is not None else None
        # Put sends its blocks to the store in chunks that fit the host tier comfortably: the store
        # protects a whole put_many from eviction while it lands.
        self._put_chunk_bytes = max(1, self._host.capacity_bytes // 4) if self._host is not None else 1 << 62
        self._quota_locks: dict[str, threading.Lock] = {}  # tenant -> its Puts' quota check and store (see _put)
        self._quota_guard = threading.Lock()

    # ---- helpers ------------------------------------------------------------------------------

    def _keys(self, keys: Sequence[bytes], field: str = "keys") -> list[bytes]:
        if len(keys) > self._max_keys:
            raise InvalidArgument(f"{len(keys)} {field} in one call; the limit is {self._max_keys} "
                                  "(server.max_keys_per_call)")
        keys = list(keys)
        if keys and set(map(len, keys)) != {KEY_BYTES}:  # one C-level pass; the loop only to name the culprit
            for i, key in enumerate(keys):
                if len(key) != KEY_BYTES:
                    raise InvalidArgument(f"{field}[{i}] is {len(key)} bytes; keys are {KEY_BYTES} bytes")
        return keys

    def _scope(self, tenant: str, keys: list[bytes]) -> list[bytes]:
        """scope_keys, remembered per tenant (a worker's Lookup and Fetch name the same chain)."""
        memo = self._scoped.get(tenant)
        if memo is None:
            memo = self._scoped.setdefault(tenant, ScopedKeys(tenant))
        return memo(keys)

    def _chain(self, request: pb.LookupRequest, tenant: str) -> tuple[bytes, ...]:
        """The store keys of request.keys, validated, remembered by the request's wire bytes. Workers
        name the same chains again and again, and inside the daemon (caches cold, a client on the
        other core) turning 128 keys into objects, checking and scoping them took ~60 us of a
        Lookup handler's ~150; one hash of the wire bytes replaces that. Bounded: emptied when full."""
        wire = request.SerializeToString()  # the same bytes always parse to the same keys
        scoped = self._chains.get((tenant, wire))
        if scoped is None:
            scoped = tuple(self._scope(tenant, self._keys(request.keys)))
            cost = len(wire) + 100 * len(scoped)
            if cost <= CHAIN_MEMO_BYTES // 64:
                if self._chains_bytes + cost > CHAIN_MEMO_BYTES:
                    self._chains.clear()
                    self._chains_bytes = 0
                self._chains[tenant, wire] = scoped
                self._chains_bytes += cost  # racy across threads at worst by a few requests' worth
        return scoped

    def _owned(self, tenant: str) -> set[bytes]:
        return {e.meta.key for e in self._store.entries(tenant=tenant)}

    def _targets(self, request: pb.EvictRequest | pb.PinRequest | pb.UnpinRequest, tenant: str) -> list[bytes]:
        """Store keys named by a request's client keys and store keys; another tenant's store keys
        are treated as absent."""
        keys = self._keys(request.keys)
        store_keys = self._keys(request.store_keys, "store_keys")
        if len(keys) + len(store_keys) > self._max_keys:
            raise InvalidArgument(f"{len(keys) + len(store_keys)} keys in one call; the limit is {self._max_keys}")
        targets = scope_keys(tenant, keys)
        if store_keys:
            owned = self._owned(tenant)
            targets += [k for k in store_keys if k in owned]
        return targets

    # ---- rpcs ---------------------------------------------------------------------------------

    @translated
    def Lookup(self, request: pb.LookupRequest, context: TenantContext) -> bytes:
        tiers = self._store.lookup(self._chain(request, context.tenant), counted=not request.probe,
                                   tenant=context.tenant, holes=request.holes)
        return lookup_reply(bytes(map(LOOKUP_CODES.__getitem__, tiers)))  # sent as they are (auth._passthrough)

    @translated
    def Fetch(self, request: pb.FetchRequest, context: TenantContext) -> Iterator[pb.FetchResponse | bytes]:
        if request.store_keys:
            if request.keys:
                raise InvalidArgument("a Fetch names keys or store_keys, not both")
            yield from self._fetcher.store_keys(self._keys(request.store_keys, "store_keys"),
                                                self._owned(context.tenant), context)
            return
        keys = self._keys(request.keys)
        scoped = self._scope(context.tenant, keys)
        # Descriptors only for same-host callers: a TCP caller cannot map the slab anyway.
        if request.shared_memory and context.unix and self._host is not None:
            yield from self._fetcher.descriptors(keys, scoped, context)
        else:
            yield from self._fetcher.records(keys, scoped, context)

    @translated
    def FetchShared(self, request: pb.FetchRequest, context: TenantContext) -> bytes:
        if request.store_keys:
            raise InvalidArgument("FetchShared takes keys, not store_keys: fetch store keys with Fetch")
        if not context.unix or self._host is None:
            raise InvalidArgument("FetchShared needs a caller on the daemon's Unix socket and a host tier; use Fetch")
        keys = self._keys(request.keys)
        return self._fetcher.shared(keys, self._scope(context.tenant, keys), context)

    @translated
    def Touch(self, request: pb.TouchRequest, context: TenantContext) -> pb.TouchResponse:
        keys = self._keys(request.keys)
        looked_up = request.lookup_blocks + request.lookup_misses
        if looked_up > request.lookup_calls * self._max_keys:
            raise InvalidArgument(f"lookup_blocks + lookup_misses = {looked_up} is more than "
                                  f"lookup_calls={request.lookup_calls} lookups can name")
        if request.lookup_disk_blocks > request.lookup_blocks:
            raise InvalidArgument(f"lookup_disk_blocks = {request.lookup_disk_blocks} is more than "
                                  f"lookup_blocks = {request.lookup_blocks}")
        if len(request.reports) > self._max_keys:
            raise InvalidArgument(f"{len(request.reports)} reports in one Touch; the limit is {self._max_keys}")
        for i, report in enumerate(request.reports):
            _check_report(report, f"reports[{i}].")
        # A Touch with reports only (a client that read nothing through the index) leaves the store alone.
        touched = 0
        if keys:
            scoped = self._scope(context.tenant, keys)
            touched = self._store.touch(scoped)  # hits, TTLs and LRU order of what the caller read
            self._store.promote(scoped[:touched])  # and the promotions those reads earn (disk -> host, ...)
        if request.lookup_calls:
            self._store.count_lookups(request.lookup_calls, request.lookup_blocks, request.lookup_misses,
                                      request.lookup_disk_blocks)
        for report in request.reports:
            self._observe(report)
        return pb.TouchResponse(num_touched=touched, num_reported=len(request.reports))

    @translated
    def Reserve(self, request: pb.ReserveRequest, context: TenantContext) -> pb.ReserveResponse:
        return self._reserve(request, context)

    @translated
    def Commit(self, request: pb.CommitRequest, context: TenantContext) -> pb.PutResponse:
        return self._commit(request, context)

    @translated
    def Release(self, request: pb.ReleaseRequest, context: TenantContext) -> pb.ReleaseResponse:
        return self._release(request, context)

    @translated
    def Put(self, request_iterator: Iterable[pb.PutRequest], context: TenantContext) -> pb.PutResponse:
        return self._put(request_iterator, context)

    @translated
    def PutBatch(self, request: pb.PutBatchRequest, context: TenantContext) -> pb.PutResponse:
        return self._put(request.requests, context)

    @translated
    def Prefetch(self, request: pb.PrefetchRequest, context: TenantContext) -> pb.PrefetchResponse:
        keys = self._keys(request.keys)
        return pb.PrefetchResponse(num_promoted=self._store.prefetch(scope_keys(context.tenant, keys)))

    @translated
    def Stats(self, request: pb.StatsRequest, context: TenantContext) -> pb.StatsResponse:
        tenant = context.tenant
        entries = self._store.entries(tenant=tenant)
        reply = pb.StatsResponse(tenant=tenant, tenant_bytes=sum(e.meta.nbytes for e in entries),
                                 tenant_quota_bytes=self._cfg.server.tenant_quota_bytes, version=__version__)
        # Aggregate counters would tell a network tenant about the others: tenant "local" only.
        local = tenant == LOCAL_TENANT
        c = self._store.snapshot_counters() if local else {}
        for ts in self._store.tier_stats():
            mine = [e for e in entries if ts.name in e.tiers]
            tier = reply.tiers.add(tier=TIER_TO_PB[ts.name], capacity_bytes=ts.capacity_bytes,
                                   tenant_blocks=len(mine), tenant_bytes=sum(e.meta.nbytes for e in mine))
            if local:
                # hits: the store's count, which includes blocks handed out as shared-memory descriptors.
                tier.MergeFrom(pb.TierStats(used_bytes=ts.used_bytes, num_blocks=ts.num_blocks,
                                            hits=c.get(f"hits_{ts.name}", 0),
                                            misses=ts.misses, puts=ts.puts, evictions=ts.evictions,
                                            verification_failures=ts.verification_failures,
                                            promotions=c.get(f"promotions_to_{ts.name}", 0),
                                            lookup_hits=c.get(f"lookup_hits_{ts.name}", 0)))
        self._remote_stats(reply, c if local else None)
        if local:
            usage: dict[str, list[int]] = {}
            for e in self._store.entries():
                row = usage.setdefault(e.meta.tenant, [0, 0])
                row[0] += 1
                row[1] += e.meta.nbytes
            reply.tenants.extend(pb.TenantUsage(tenant=t, num_blocks=n, bytes=b) for t, (n, b) in sorted(usage.items()))
            missed = c.get("lookup_blocks_missed", 0)
            reply.MergeFrom(pb.StatsResponse(
                lookups=c.get("lookup_blocks_hit", 0) + missed, lookup_misses=missed,
                verification_failures=c.get("verification_failures", 0),
                tokens_reused=int(self._reports.total("tokens_reused")),
                tokens_computed=int(self._reports.total("tokens_computed")),
                requests_reported=int(self._reports.total("requests"))))
            scrub = self._store.scrub_progress()
            if scrub is not None:
                reply.scrub.CopyFrom(pb.ScrubStats(
                    bytes_per_s=scrub.bytes_per_s, bytes_scrubbed=scrub.bytes_scrubbed,
                    blocks_scrubbed=scrub.blocks_scrubbed, damaged_blocks=scrub.damaged_blocks, passes=scrub.passes,
                    pass_fraction=scrub.pass_fraction, last_pass_unix_s=scrub.last_pass_unix_s,
                    next_pass_unix_s=scrub.next_pass_unix_s, paused=scrub.paused, paused_s=scrub.paused_s))
        return reply

    def _remote_stats(self, reply: pb.StatsResponse, counters: dict[str, int] | None) -> None:
        """The remote tier's row (no capacity or block counts: the cluster is not listed) and, for
        tenant local (`counters`: the store's), its traffic."""
        remote = self._store.remote_counters()
        if not remote:
            return
        tier = reply.tiers.add(tier=pb.TIER_REMOTE)
        if counters is None:
            return
        tier.MergeFrom(pb.TierStats(hits=remote["hits"], misses=remote["misses"], puts=remote["puts"],
                                    evictions=remote["evictions"],
                                    verification_failures=remote["verification_failures"]))
        reply.remote.CopyFrom(pb.RemoteStats(
            bytes_read=remote["bytes_read"], bytes_written=remote["bytes_written"],
            blocks_pulled=counters.get("remote_blocks_pulled", 0), errors=remote["errors"],
            write_errors=remote["write_errors"], writes_dropped=remote["writes_dropped"],
            queue_blocks=remote["queue_blocks"]))
        census = self._store.remote_census()
        if census is not None:
            reply.remote.MergeFrom(pb.RemoteStats(cluster_blocks=census.blocks, cluster_bytes=census.bytes,
                                                  census_samples=census.sampled,
                                                  census_failed_primaries=census.failed))

    @translated
    def List(self, request: pb.ListRequest, context: TenantContext) -> pb.ListResponse:
        namespace = _namespace(request.namespace)
        entries = self._store.entries(namespace=namespace, tenant=context.tenant)
        if namespace is not None and not entries:
            raise NotFound(f"namespace {namespace.hex()} has no blocks for this tenant")
        entries.sort(key=lambda e: e.last_access, reverse=True)
        limit = min(request.limit or self._max_keys, self._max_keys)
        reply = pb.ListResponse(num_total=len(entries))
        known = self._namespaces.describe(context.tenant, {e.meta.namespace for e in entries})
        # The description's fields by name (checked when a Put brought them: records.described); a dict
        # of them types each value as str | int, not its field's own type.
        reply.namespaces.extend(pb.NamespaceInfo(digest=d, **f)  # type: ignore[arg-type]  # see above
                                for d, f in sorted(known.items()))
        for e in entries[:limit]:
            m = e.meta
            reply.entries.add(store_key=m.key, parent_store_key=m.parent, namespace=m.namespace,
                              num_tokens=m.num_tokens, dtype=m.dtype, shape=list(m.shape), nbytes=m.nbytes,
                              tiers=[TIER_TO_PB[t] for t in e.tiers], hits=e.hits, last_access_unix_s=e.last_access,
                              pinned=e.pinned, expires_unix_s=e.expires_at, preview=m.preview,
                              pin_expires_unix_s=e.pin_expires_at)
        return reply

    @translated
    def Flush(self, request: pb.FlushRequest, context: TenantContext) -> pb.FlushResponse:
        if request.tier and request.tier not in PB_TO_TIER:
            raise InvalidArgument(f"unknown tier value {request.tier}")
        namespace = _namespace(request.namespace)
        remote = request.tier == pb.TIER_REMOTE
        if remote and namespace is not None:
            raise InvalidArgument("the remote tier cannot be flushed by namespace (its keys name the tenant, not "
                                  "the namespace): flush the tenant's whole remote tier, or another tier")
        tenant = request.tenant or context.tenant
        if tenant != context.tenant:
            if context.tenant != LOCAL_TENANT:
                raise PermissionDenied("only tenant 'local' (the operator) may flush another tenant's blocks")
            # The remote tier may hold a tenant's blocks that other daemons wrote and this one never saw.
            if not remote and not self._store.entries(tenant=tenant):
                raise NotFound(f"tenant {tenant!r} holds no blocks")
        if namespace is not None and not self._store.entries(namespace=namespace, tenant=tenant):
            raise NotFound(f"namespace {namespace.hex()} has no blocks for this tenant")
        removed = self._store.flush(tier=PB_TO_TIER.get(request.tier), namespace=namespace, tenant=tenant)
        return pb.FlushResponse(num_removed=removed)

    @translated
    def Evict(self, request: pb.EvictRequest, context: TenantContext) -> pb.EvictResponse:
        return pb.EvictResponse(num_evicted=self._store.remove(self._targets(request, context.tenant)))

    @translated
    def Pin(self, request: pb.PinRequest, context: TenantContext) -> pb.PinResponse:
        targets = self._targets(request, context.tenant)
        ttl = ttl_field(request.ttl_s, "ttl_s")
        owned = self._owned(context.tenant)
        missing = sum(1 for k in targets if k not in owned)
        if missing or len(targets) < len(request.keys) + len(request.store_keys):
            absent = missing + len(request.keys) + len(request.store_keys) - len(targets)
            raise NotFound(f"{absent} of {len(request.keys) + len(request.store_keys)} keys are not cached; "
                           "nothing was pinned")
        return pb.PinResponse(num_pinned=self._store.pin(targets, ttl_s=ttl))

    @translated
    def Unpin(self, request: pb.UnpinRequest, context: TenantContext) -> pb.UnpinResponse:
        return pb.UnpinResponse(num_unpinned=self._store.unpin(self._targets(request, context.tenant)))

    @translated
    def Verify(self, request: pb.VerifyRequest, context: TenantContext) -> pb.VerifyResponse:
        keys = self._keys(request.store_keys, "store_keys") if request.store_keys else None
        report = self._store.verify(tenant=context.tenant, keys=keys)
        reply = pb.VerifyResponse(num_checked=report.checked, num_failed=report.failed,
                                  dropped_store_keys=list(report.dropped_keys), integrity_ok=True)
        try:
            self._store.check_integrity()
        except AssertionError as e:
            logger.error("integrity check failed: %s", e)
            reply.integrity_ok, reply.integrity_error = False, str(e) or "integrity check failed"
        return reply

    @translated
    def Report(self, request: pb.ReportRequest, context: TenantContext) -> pb.ReportResponse:
        _check_report(request)
        self._observe(request)
        return pb.ReportResponse()

    def _observe(self, report: pb.ReportRequest) -> None:
        self._reports.observe(cached_tokens=report.cached_tokens, computed_tokens=report.computed_tokens,
                              ttft_s=report.ttft_s, prefill_s=report.prefill_s)


def _check_report(report: pb.ReportRequest, where: str = "") -> None:
    """InvalidArgument unless a request's figures are consistent (`where` names it inside a Touch)."""
    for name in ("ttft_s", "prefill_s"):
        value = getattr(report, name)
        if not math.isfinite(value) or value < 0:
            raise InvalidArgument(f"{where}{name} must be a finite number of seconds >= 0, got {value}")
    if report.cached_tokens + report.computed_tokens != report.prompt_tokens:
        raise InvalidArgument(f"{where}cached_tokens {report.cached_tokens} + computed_tokens "
                              f"{report.computed_tokens} != prompt_tokens {report.prompt_tokens}")
