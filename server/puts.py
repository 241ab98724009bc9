"""The servicer's Put handling: decode and check a whole call, salted previews dropped, tenant quotas, then store."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator

from server.auth import TenantContext
from server.fetching import Fetcher, check_deadline
from server.namespaces import NamespaceRegistry
from server.records import MAX_PREVIEW_CHARS, chunks, decode_put, described
from server.staging import StagedPayloads
from tiercache.block import Block, BlockMeta, PutResult
from tiercache.config import Config
from tiercache.errors import DeadlineExceeded, InvalidArgument, QuotaExceeded, Unavailable
from tiercache.store import TieredStore
from tiercache.tenancy import scope_key
from tiercache.tiers.host import HostTier
from tiercache.v1 import tiercache_pb2 as pb

PUT_RESULT_TO_PB = {PutResult.STORED: pb.PUT_RESULT_STORED, PutResult.ALREADY_PRESENT: pb.PUT_RESULT_ALREADY_PRESENT}


def ttl_field(value: float, field: str) -> float | None:
    if not math.isfinite(value) or value < 0:
        raise InvalidArgument(f"{field} must be a finite number of seconds >= 0, got {value}")
    return value or None


class PutHandling:
    """TierCacheServicer's Put and PutBatch body; the state it uses is set up by TierCacheServicer.__init__."""

    _store: TieredStore
    _cfg: Config
    _namespaces: NamespaceRegistry
    _max_keys: int
    _staging: StagedPayloads | None
    _put_chunk_bytes: int
    _quota_locks: dict[str, threading.Lock]
    _quota_guard: threading.Lock
    _owned: Callable[[str], set[bytes]]
    _host: HostTier | None
    _fetcher: Fetcher

    def _put(self, request_iterator: Iterable[pb.PutRequest], context: TenantContext) -> pb.PutResponse:
        """Put and PutBatch: the messages of one call, checked as a whole, then stored."""
        budget = self._cfg.server.max_message_bytes
        items: list[tuple[Block, float | None, bool]] = []
        descriptions: dict[tuple[str, bytes], dict[str, str | int]] = {}
        total = 0
        # Everything is decoded and checked before anything is stored: a bad record changes nothing.
        last = durable = False
        # The deadline is read once: asking gRPC for the time left costs more per message than the rest
        # of the checks together.
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        for n, req in enumerate(request_iterator):
            if last:
                raise InvalidArgument(f"records[{n}] follows the message marked last")
            last, durable = req.last, req.durable
            if n >= self._max_keys:
                raise InvalidArgument(f"more than {self._max_keys} records in one Put (server.max_keys_per_call)")
            if deadline is not None and time.monotonic() >= deadline:
                raise DeadlineExceeded(f"deadline passed after {n} of {n} items")
            block = decode_put(req, n, context.tenant, self._cfg.store.max_block_bytes,
                               self._staging if context.unix else None)
            if req.HasField("namespace"):
                descriptions[(block.meta.tenant, block.meta.namespace)] = described(req.namespace, block.meta, n)
            total += block.meta.nbytes
            if total > budget:
                raise InvalidArgument(f"one Put carries more than {budget} payload bytes "
                                      "(server.max_message_bytes); split it into several calls")
            items.append((block, ttl_field(req.ttl_s, f"records[{n}].ttl_s"), req.pin))
        items = self._without_salted_previews(items, descriptions)
        # gRPC ends the request stream quietly when the caller cancels or its deadline passes: a
        # truncated stream must not be stored as if it were complete.
        check_deadline(context, len(items), len(items))
        if not context.is_active():
            raise Unavailable(f"the Put was cancelled after {len(items)} records; nothing stored")
        if items and not last:
            raise InvalidArgument(f"the Put stream ended after {len(items)} records without one marked "
                                  "last: it was cut short, nothing stored")
        if durable and getattr(self._store, "disk", None) is None:
            raise InvalidArgument("durable=true needs a disk tier and this daemon has none; nothing stored")
        results: list[PutResult] = [PutResult.ALREADY_PRESENT] * len(items)
        with self._quota_held({block.meta.tenant for block, _, _ in items}):
            self._check_quota([block for block, _, _ in items])
            # Chunks go in reverse so the head of a chain lands last and is the most recently used.
            for start, end in reversed(chunks(items, self._put_chunk_bytes)):
                _, ttl, pin = items[start]
                # decode_put checked each payload against its checksum, in the (immutable) request bytes.
                results[start:end] = self._store.put_many([b for b, _, _ in items[start:end]], ttl_s=ttl,
                                                          pin=pin, verified=True)
        for (tenant, digest), fields in descriptions.items():
            self._namespaces.register(tenant, digest, fields, live=self._live_namespaces)
        if durable and items:
            self._store.persist([block.meta.key for block, _, _ in items], timeout_s=context.time_remaining())
        return pb.PutResponse(results=[PUT_RESULT_TO_PB[r] for r in results])

    def _without_salted_previews(self, items: list[tuple[Block, float | None, bool]],
                                 descriptions: dict[tuple[str, bytes], dict[str, str | int]]
                                 ) -> list[tuple[Block, float | None, bool]]:
        """The items with no preview in a salted namespace (described so in this Put or before): a
        salted namespace is one user's, and a preview is their prompt's text, shown by `admin ls`."""
        metas = self._previews_allowed([b.meta for b, _, _ in items], descriptions)
        return [(b if meta is b.meta else Block(meta, b.payload), ttl, pin)
                for (b, ttl, pin), meta in zip(items, metas)]

    def _previews_allowed(self, metas: list[BlockMeta], descriptions: dict[tuple[str, bytes], dict[str, str | int]]
                          ) -> list[BlockMeta]:
        """`metas`, those with a preview in a salted namespace (described so now or before) without it."""
        previewed = {(m.tenant, m.namespace) for m in metas if m.preview}
        if not previewed:
            return metas
        salted = {key for key in previewed if descriptions.get(key, {}).get("salt_digest")}
        for tenant in {tenant for tenant, _ in previewed}:
            known = self._namespaces.describe(tenant, {digest for t, digest in previewed if t == tenant})
            salted |= {(tenant, digest) for digest, fields in known.items() if fields.get("salt_digest")}
        return [dataclasses.replace(m, preview="") if (m.tenant, m.namespace) in salted and m.preview else m
                for m in metas]

    def _live_namespaces(self) -> set[tuple[str, bytes]]:
        return {(e.meta.tenant, e.meta.namespace) for e in self._store.entries()}

    @contextlib.contextmanager
    def _quota_held(self, tenants: set[str]) -> Iterator[None]:
        """With a quota, one Put at a time per tenant between its quota check and its store: two at
        once could each pass the check and together go over. Locks are taken in name order."""
        if not self._cfg.server.tenant_quota_bytes:
            yield
            return
        with self._quota_guard:
            locks = [self._quota_locks.setdefault(tenant, threading.Lock()) for tenant in sorted(tenants)]
        with contextlib.ExitStack() as stack:
            for lock in locks:
                stack.enter_context(lock)
            yield

    def _check_quota(self, blocks: list[Block]) -> None:
        for tenant in {b.meta.tenant for b in blocks}:
            self._check_quota_bytes(tenant, {b.meta.key: b.meta.nbytes for b in blocks if b.meta.tenant == tenant})

    def _check_quota_bytes(self, tenant: str, nbytes_by_key: dict[bytes, int]) -> None:
        """QuotaExceeded when the tenant's blocks plus these (keys it does not hold yet) pass its quota."""
        quota = self._cfg.server.tenant_quota_bytes
        if not quota:
            return
        owned = self._owned(tenant)
        new = sum(n for key, n in nbytes_by_key.items() if key not in owned)
        used = self._store.tenant_bytes(tenant)
        if used + new > quota:
            raise QuotaExceeded(f"tenant {tenant!r} would hold {used + new} bytes; its quota is {quota} "
                                "(server.tenant_quota_bytes)")

    # ---- puts in place (Reserve, Commit, Release) ----------------------------------------------------

    def _reserve(self, request: pb.ReserveRequest, context: TenantContext) -> pb.ReserveResponse:
        """Room in the slab for the caller's new blocks (store.reserve), its pages in the reply."""
        if not context.unix or self._host is None:
            raise InvalidArgument("Reserve needs a caller that may map the daemon's slab (its Unix socket, its "
                                  "user or server.local_group) and a host tier; send the blocks with Put")
        if not request.blocks:
            raise InvalidArgument("Reserve names no blocks")
        if len(request.blocks) > self._max_keys:
            raise InvalidArgument(f"{len(request.blocks)} blocks in one Reserve; the limit is {self._max_keys} "
                                  "(server.max_keys_per_call)")
        if not math.isfinite(request.lease_s) or request.lease_s < 0:
            raise InvalidArgument(f"lease_s must be a finite number of seconds >= 0, got {request.lease_s}")
        tenant = context.tenant
        metas: list[BlockMeta] = []
        for i, wire in enumerate(request.blocks):
            try:
                meta = BlockMeta.from_wire(wire)
            except InvalidArgument as e:
                raise InvalidArgument(f"blocks[{i}]: {e}") from None
            if len(meta.preview) > MAX_PREVIEW_CHARS:
                raise InvalidArgument(f"blocks[{i}] preview has {len(meta.preview)} characters; the limit is "
                                      f"{MAX_PREVIEW_CHARS}")
            parent = scope_key(tenant, meta.parent) if meta.parent else b""
            metas.append(meta.scoped(scope_key(tenant, meta.key), parent, tenant))
        descriptions: dict[tuple[str, bytes], dict[str, str | int]] = {}
        if request.HasField("namespace"):
            for i, meta in enumerate(metas):
                descriptions[(tenant, meta.namespace)] = described(request.namespace, meta, i)
        metas = self._previews_allowed(metas, descriptions)
        with self._quota_held({tenant}):  # reserved room counts once committed: checked for both here
            self._check_quota_bytes(tenant, {m.key: m.nbytes for m in metas})
            reservation = self._store.reserve(metas, tenant=tenant, lease_s=request.lease_s or None)
        for (owner, digest), fields in descriptions.items():
            self._namespaces.register(owner, digest, fields, live=self._live_namespaces)
        reply = pb.ReserveResponse(slab=self._fetcher.slab_info, reservation=reservation.id,
                                   lease_s=max(0.0, reservation.deadline - time.monotonic()))
        reply.blocks.extend(pb.ReservedPages(pages=pages or ()) for pages in reservation.pages)
        return reply

    def _commit(self, request: pb.CommitRequest, context: TenantContext) -> pb.PutResponse:
        """The reserved blocks stored from what the caller wrote (store.commit); durable as a Put."""
        ttl = ttl_field(request.ttl_s, "ttl_s")
        if request.durable and getattr(self._store, "disk", None) is None:
            raise InvalidArgument("durable=true needs a disk tier and this daemon has none; nothing stored")
        results = self._store.commit(request.reservation, tenant=context.tenant, ttl_s=ttl, pin=request.pin,
                                     durable=request.durable, timeout_s=context.time_remaining())
        return pb.PutResponse(results=[PUT_RESULT_TO_PB[r] for r in results])

    def _release(self, request: pb.ReleaseRequest, context: TenantContext) -> pb.ReleaseResponse:
        return pb.ReleaseResponse(num_pages=self._store.release(request.reservation, tenant=context.tenant))
