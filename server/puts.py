"""The servicer's Put handling: decode and check a whole call, salted previews dropped, tenant quotas, then store."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator

from server.auth import TenantContext
from server.fetching import check_deadline
from server.namespaces import NamespaceRegistry
from server.records import chunks, decode_put, described
from server.staging import StagedPayloads
from tiercache.block import Block, PutResult
from tiercache.config import Config
from tiercache.errors import DeadlineExceeded, InvalidArgument, QuotaExceeded, Unavailable
from tiercache.store import TieredStore
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
        previewed = {(b.meta.tenant, b.meta.namespace) for b, _, _ in items if b.meta.preview}
        if not previewed:
            return items
        salted = {key for key in previewed if descriptions.get(key, {}).get("salt_digest")}
        for tenant in {tenant for tenant, _ in previewed}:
            known = self._namespaces.describe(tenant, {digest for t, digest in previewed if t == tenant})
            salted |= {(tenant, digest) for digest, fields in known.items() if fields.get("salt_digest")}
        return [(Block(dataclasses.replace(b.meta, preview=""), b.payload), ttl, pin)
                if (b.meta.tenant, b.meta.namespace) in salted and b.meta.preview else (b, ttl, pin)
                for b, ttl, pin in items]

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
        quota = self._cfg.server.tenant_quota_bytes
        if not quota:
            return
        for tenant in {b.meta.tenant for b in blocks}:
            owned = self._owned(tenant)
            new = {b.meta.key: b.meta.nbytes for b in blocks if b.meta.tenant == tenant and b.meta.key not in owned}
            used = self._store.tenant_bytes(tenant)
            if used + sum(new.values()) > quota:
                raise QuotaExceeded(f"tenant {tenant!r} would hold {used + sum(new.values())} bytes; "
                                    f"its quota is {quota} (server.tenant_quota_bytes)")
