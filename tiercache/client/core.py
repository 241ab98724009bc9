"""Client of the tiercache daemon: typed calls, status codes back to tiercache.errors, shared-memory fetch."""

from __future__ import annotations

import ctypes
import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tiercache import status
from tiercache.client.fetch import FetchedBlocks, SlabCopier, parse_fetch_response  # parse_...: re-exported
from tiercache.client.stage import StagedPuts
from tiercache.client.touch import Toucher
from tiercache import wire
from tiercache.codec import decode_block, encode_block, plain_record_parts
from tiercache.client.types import (ListedBlock, Listing, NamespaceDescription, ServiceStats, TenantUsage,
                                    TierUsage, VerifyResult)
from tiercache.errors import InvalidArgument, NotFound, TierCacheError, Unavailable
from tiercache.keys import KEY_BYTES, Namespace
from tiercache.tenancy import LOCAL_TENANT, ScopedKeys
from tiercache.store import PutResult
from tiercache.tiers.base import Block, BlockMeta
from tiercache.v1 import tiercache_pb2 as pb
from tiercache.v1 import tiercache_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 256 << 20  # receive bound; the daemon's own limit (default 128 MiB) is lower
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   # A restarted daemon is usually back within seconds: retry the connection every
                   # 100-500 ms instead of gRPC's default backoff (1 s, growing to 120 s).
                   ("grpc.initial_reconnect_backoff_ms", 100),
                   ("grpc.min_reconnect_backoff_ms", 100),
                   ("grpc.max_reconnect_backoff_ms", 500)]
PUT_BATCH_BYTES = 32 << 20  # payload bytes per Put call: well under the daemon's message budget
PUT_BATCH_RECORDS = 4096
PUT_ONE_MESSAGE_BYTES = 4 << 20  # a Put of at most this many payload bytes goes as one PutBatch message
# After a daemon answered that it has no PutBatch (an older version), the stream is used this long
# before PutBatch is tried again: the daemon may be upgraded under a long-running worker.
PUT_BATCH_RETRY_S = 300.0
LOCAL_MAX_KEYS = 4096  # longer key lists go to the daemon (whose limit is server.max_keys_per_call)
TIER_NAMES = {pb.TIER_GPU: "gpu", pb.TIER_HOST: "host", pb.TIER_DISK: "disk"}
TIER_VALUES = {v: k for k, v in TIER_NAMES.items()}
PUT_RESULTS = {pb.PUT_RESULT_STORED: PutResult.STORED, pb.PUT_RESULT_ALREADY_PRESENT: PutResult.ALREADY_PRESENT}
FETCH_METHOD = f"/{pb.DESCRIPTOR.services_by_name['TierCache'].full_name}/Fetch"
FETCH_SHARED_METHOD = f"/{pb.DESCRIPTOR.services_by_name['TierCache'].full_name}/FetchShared"
PUT_BATCH_METHOD = f"/{pb.DESCRIPTOR.services_by_name['TierCache'].full_name}/PutBatch"
T = TypeVar("T")


_malloc_tuned = False


def tune_malloc() -> None:
    """Keep block-sized buffers on the heap in this process (glibc only; idempotent).

    glibc gives every buffer of 128 KiB or more its own mmap and trims freed heap eagerly, so each
    received block costs fresh page faults: measured 4x slower decoding of 1 MiB blocks, 1.6x of
    64 KiB ones, in a VM. This keeps buffers up to 32 MiB on the heap and up to 256 MiB of freed
    heap for reuse, as the daemon does for itself (server/main.py). It changes the allocator of the
    whole process, for every library in it, and cannot be undone: only a caller that owns the
    process should ask for it (Client(tune_allocator=True), `tiercache worker`).
    """
    global _malloc_tuned
    if _malloc_tuned:
        return
    _malloc_tuned = True
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        libc.mallopt(m_mmap_threshold, 32 << 20)  # glibc's maximum for this knob
        libc.mallopt(m_trim_threshold, 256 << 20)
    except (OSError, AttributeError):
        logger.debug("not glibc: allocator left as it is")


def error_from_rpc(e: grpc.RpcError) -> TierCacheError:
    """The tiercache exception for a failed call (the table in tiercache/status.py, inverted)."""
    code = e.code() if hasattr(e, "code") else None
    trailing = dict(e.trailing_metadata() or ()) if hasattr(e, "trailing_metadata") else {}
    cls = status.from_code(code.name if code else "UNKNOWN", trailing.get(status.ERROR_CLASS_KEY))
    details = e.details() if hasattr(e, "details") else str(e)
    return cls(details or (code.name if code else "rpc failed"))


def _key_list(keys: Sequence[bytes]) -> list[bytes]:
    """`keys` as a list; one bytes object (a single key where a list belongs) is refused, as
    list() would make it a list of ints."""
    if isinstance(keys, (bytes, bytearray, memoryview)):
        raise InvalidArgument("keys must be a list of 32-byte block keys, not one bytes object")
    return list(keys)


class Client:
    """A connection to the daemon. `target` is "unix:/path" or "host:port"; every call passes a timeout.

    Failed calls raise the tiercache.errors class the daemon raised (Unavailable when it cannot be
    reached, DeadlineExceeded on timeout). Thread-safe; close() (or a with-block) releases it.
    tune_allocator=True applies tune_malloc() to this process (blocks decode up to 4x faster); off by
    default, as it changes glibc's malloc settings for everything else the process runs.
    """

    def __init__(self, target: str, *, token: str | None = None, timeout_s: float = 5.0,
                 tls_root_cert: str | bytes | None = None, tune_allocator: bool = False,
                 shared_memory: bool = True) -> None:
        if tune_allocator:  # see tune_malloc: a process-wide setting, hence an opt-in
            tune_malloc()
        if target.startswith("/"):
            raise InvalidArgument(f"target {target!r} looks like a socket path: write 'unix:{target}'")
        self.target = target
        self.timeout_s = timeout_s
        self.is_unix = target.startswith("unix:")
        # shared_memory=False: behave as a client on another machine would (bytes over the stream,
        # every lookup a call), even on the daemon's Unix socket; benchmarks compare the two.
        self.shared_memory = shared_memory and self.is_unix
        self._tls = tls_root_cert is not None
        if tls_root_cert is not None:
            if isinstance(tls_root_cert, str):
                with open(tls_root_cert, "rb") as f:
                    tls_root_cert = f.read()
            self._channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(tls_root_cert), CHANNEL_OPTIONS)
        else:
            self._channel = grpc.insecure_channel(target, CHANNEL_OPTIONS)
        self._stub = pb_grpc.TierCacheStub(self._channel)
        # Fetch responses arrive as bytes and are walked by hand: records stay views into the
        # received message until decode_block copies them once into the block's tensor.
        self._fetch_raw = self._channel.unary_stream(FETCH_METHOD, request_serializer=pb.FetchRequest.SerializeToString)
        self._fetch_shared_raw = self._channel.unary_unary(FETCH_SHARED_METHOD,
                                                           request_serializer=pb.FetchRequest.SerializeToString)
        # PutBatch requests are framed by hand too: each payload is copied once, into the message.
        self._put_batch_raw = self._channel.unary_unary(PUT_BATCH_METHOD, response_deserializer=pb.PutResponse.FromString)
        # time.monotonic() until which puts go over the stream: a daemon older than PutBatch said UNIMPLEMENTED
        self._put_batch_after = 0.0
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {token}"),) if token else ()
        self._slab = SlabCopier()
        # Without a token a Unix-socket caller is tenant "local", whose store keys it can compute:
        # it may then find blocks in the daemon's shared index without a call (see fetch_views).
        self._local = self.shared_memory and token is None
        self._scoped = ScopedKeys(LOCAL_TENANT)  # store keys, remembered like the daemon does
        self._toucher = Toucher(lambda request, timeout_s: self._call(self._stub.Touch, request, timeout_s),
                                lambda request, timeout_s: self._call(self._stub.Report, request, timeout_s))
        self._staged = StagedPuts()  # same-host Puts: payloads through a staging file (client_stage.py)
        self.num_refetched = 0  # shared-memory blocks that had to be fetched again as bytes
        self.num_local = 0  # fetches answered from the shared index, without a call

    @property
    def num_disk_blocks(self) -> int:
        """Blocks this client read from the daemon's disk tier itself (tiercache/client/disk_reader.py)."""
        return self._slab.num_disk_blocks

    @property
    def num_staged_puts(self) -> int:
        """Blocks put through the staging file (no payload bytes over gRPC)."""
        return self._staged.num_staged

    @property
    def num_put_fallbacks(self) -> int:
        """Staged Puts the daemon refused, or staging that could not be set up: sent as bytes instead."""
        return self._staged.num_fallbacks

    def close(self) -> None:
        self._toucher.close()
        self._staged.close()
        self._slab.close()
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- plumbing -------------------------------------------------------------------------------

    def _call(self, method: Callable[..., T], request: Any, timeout_s: float | None = None) -> T:
        try:
            return method(request, timeout=timeout_s or self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as e:
            raise self._error(e) from None

    def _stream(self, responses: Iterator[T]) -> Iterator[T]:
        try:
            yield from responses
        except grpc.RpcError as e:
            raise self._error(e) from None

    def _error(self, e: grpc.RpcError) -> TierCacheError:
        """error_from_rpc, with a hint where a plaintext caller met a TLS listener: the handshake
        fails and gRPC reports only that the socket closed."""
        error = error_from_rpc(e)
        if isinstance(error, Unavailable) and not self.is_unix and not self._tls and "Socket closed" in str(error):
            return Unavailable(f"{error}; if the daemon listens with TLS, give its CA certificate "
                               "(Client(tls_root_cert=...), --tls-root-cert)")
        return error

    # ---- rpcs -----------------------------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes], *, probe: bool = False) -> list[str]:
        """Tier ("gpu", "host", "disk") of each block of the longest cached prefix of `keys`
        (answered from the shared index, without a call, when it holds all of them in host).

        `probe`: a check (is this block stored already?), not a request's lookup: the daemon leaves
        it out of its lookup statistics."""
        keys = _key_list(keys)
        if self._may_answer_locally(keys):
            scoped = self._scoped(keys)
            found = self._slab.local_prefix(scoped)
            # Known without a call: all in host, or the next key is in no tier (presence filter).
            if found == len(keys) or not self._slab.maybe_present(scoped[found]):
                if not probe:
                    self._toucher.looked_up(found, len(keys) - found)  # counted by the daemon with the next Touch
                return ["host"] * found
            # Or the rest of the prefix is in the disk tier, which this process can read too.
            on_disk = self._slab.disk_prefix(scoped[found:])
            end = found + on_disk
            if on_disk and (end == len(keys) or not self._slab.maybe_present(scoped[end])):
                if not probe:
                    self._toucher.looked_up(end, len(keys) - end, on_disk)
                return ["host"] * found + ["disk"] * on_disk
        reply = self._call(self._stub.Lookup, pb.LookupRequest(keys=keys, probe=probe))
        return [TIER_NAMES[t] for t in reply.tiers]

    def _may_answer_locally(self, keys: list[bytes]) -> bool:
        """Whether the shared index may answer for `keys`: a tokenless same-host client, an index,
        and keys the daemon itself would accept (else the call gives the precise error)."""
        return (self._local and self._slab.index is not None and 0 < len(keys) <= LOCAL_MAX_KEYS
                and set(map(len, keys)) == {KEY_BYTES})

    def fetch(self, keys: Sequence[bytes], shared_memory: bool | None = None) -> list[Block]:
        """The blocks of the longest cached prefix of `keys`, each verified against its checksum.

        shared_memory (default True; moot over TCP) copies blocks out of the daemon's host slab; a
        block recycled during the copy is fetched again as bytes, and a block that cannot be had
        intact ends the prefix. Never returns damaged bytes. Treat the payloads as read-only: those
        that came over the stream are views of the received messages, not copies.
        """
        keys = _key_list(keys)
        shared_memory = self.shared_memory and shared_memory is not False
        local = self._fetch_local(keys, views=False) if shared_memory else None
        return list(local if local is not None else self._fetch(keys, shared_memory, views=False))

    def fetch_views(self, keys: Sequence[bytes]) -> FetchedBlocks:
        """fetch() without the copy out of the slab: on the Unix socket, blocks come as read-only
        views into the daemon's host slab, verified against their checksums when they are returned.

        The daemon may recycle those pages at any moment after. Read the views (copy them where they
        are needed), then call still_valid() on the result: False means a page changed meanwhile,
        so what was read may be another block's bytes: discard it and fetch() again. Over TCP (or with
        shared_memory=False, or when the slab cannot be mapped) the blocks are copies and still_valid()
        is always True; so are blocks this client read from the daemon's disk tier itself.
        """
        keys = _key_list(keys)
        local = self._fetch_local(keys, views=True)
        return local if local is not None else self._fetch(keys, self.shared_memory, views=True)

    def _fetch_local(self, keys: list[bytes], *, views: bool) -> FetchedBlocks | None:
        """The blocks without a call: from the shared index, then the daemon's disk tier read here,
        when that is the whole cached prefix (else None: the daemon is asked)."""
        if not self._may_answer_locally(keys):
            return None
        scoped = self._scoped(keys)
        local = self._slab.fetch_here(keys, scoped, views=views)
        if local is not None:
            self.num_local += 1
            self._toucher.later(keys[: len(local)])  # the daemon's LRU, hit counts, promotions, a moment later
        return local

    def _fetch(self, keys: list[bytes], shared_memory: bool, *, views: bool) -> FetchedBlocks:
        # Only a caller on the Unix socket can map the slab; over TCP the flag is moot.
        use_shm = shared_memory and self.is_unix and self._slab.usable
        blocks = self._fetch_once(keys, use_shm, views)
        for i, block in enumerate(blocks):
            if block is None and use_shm:  # recycled while we copied, or the slab was unusable
                self.num_refetched += 1
                again = self._fetch_once([keys[i]], False, False)
                block = blocks[i] = again[0] if again else None
            if block is None:
                logger.debug("fetch: block %d of %d could not be had intact; the prefix ends there", i, len(keys))
                del blocks[i:]
                break
        return blocks

    def _fetch_once(self, keys: list[bytes], shared_memory: bool, views: bool) -> FetchedBlocks:
        """One call: a block per key of the cached prefix, None where it must be fetched again.
        Same-host callers make one unary FetchShared call; bytes come over the Fetch stream."""
        request = pb.FetchRequest(keys=keys, shared_memory=shared_memory)
        if shared_memory:
            messages: Iterable[bytes] = [self._call(self._fetch_shared_raw, request)]
            cancel: Callable[[], object] = lambda: None
        else:
            responses = self._fetch_raw(request, timeout=self.timeout_s, metadata=self._metadata)
            messages, cancel = self._stream(responses), responses.cancel
        blocks = FetchedBlocks()
        described: list[tuple[int, pb.SlabBlock]] = []  # copied out together once the call ends
        reader = None
        for data in messages:
            try:
                slab, items = parse_fetch_response(data)
            except ValueError as e:
                cancel()
                raise TierCacheError(f"malformed Fetch response from the daemon: {e}") from None
            if slab is not None:
                reader = self._slab.reader(slab)
            for index, body in items:
                if index != len(blocks) or index >= len(keys):
                    cancel()
                    raise TierCacheError(f"daemon sent block index {index}, expected {len(blocks)}")
                if isinstance(body, pb.SlabBlock):
                    if body.meta.key != keys[index]:
                        cancel()
                        raise TierCacheError(f"daemon described block {body.meta.key.hex()} for key {keys[index].hex()}")
                    described.append((index, body))
                    blocks.append(None)
                else:
                    blocks.append(self._decode(body, keys[index]))
        if described and reader is not None:
            self._slab.copy_out(reader, described, blocks, views=views)
        return blocks

    def _decode(self, record: bytes | memoryview, key: bytes) -> Block | None:
        try:
            # The payload stays where it arrived (the daemon aligns it in the message): no copy.
            return decode_block(record, max_payload_bytes=MAX_MESSAGE_BYTES, expected_key=key, copy=False)
        except TierCacheError as e:  # CorruptBlock: never hand damaged bytes to the model
            logger.warning("discarding a damaged block from the daemon: %s", e)
            return None

    def fetch_into(self, keys: Sequence[bytes], outs: Sequence[torch.Tensor]) -> list[BlockMeta]:
        """Copy the blocks of the longest cached prefix of `keys` (at most len(outs)) into `outs`, one
        caller-owned contiguous CPU tensor per key (any dtype and shape of the block's nbytes: a
        block of a paged KV pool, a pinned staging tensor), and return their metas. outs past the
        prefix are left as they were. Each block is copied once and verified in `outs`: found
        through the shared index, straight from the daemon's slab (one read of it); otherwise from
        what the daemon sends. InvalidArgument when an out cannot hold its block."""
        keys = _key_list(keys)[: len(outs)]
        arrays = []
        for i, out in enumerate(outs[: len(keys)]):
            if out.device.type != "cpu" or not out.is_contiguous():
                raise InvalidArgument(f"outs[{i}] must be a contiguous CPU tensor, got {out.device} "
                                      f"{tuple(out.shape)} {out.dtype}")
            arrays.append(out.view(-1).view(torch.uint8).numpy())
        metas: list[BlockMeta] = []
        if self._local and self._slab.index is not None and keys:
            found = self._slab.local_into(keys, self._scoped(keys), arrays)
            if found is not None:
                self.num_local += 1
                self._toucher.later(keys[: len(found)])
                metas = found
                if len(metas) == len(keys):
                    return metas
        rest = keys[len(metas):]
        for attempt in range(2):  # views first; a page recycled during the copy: bytes
            blocks = self.fetch_views(rest) if attempt == 0 else self._fetch(rest, False, views=False)
            for i, block in enumerate(blocks, len(metas)):
                if arrays[i].size != block.meta.nbytes:
                    raise InvalidArgument(f"outs[{i}] has {arrays[i].size} bytes, block {i} has {block.meta.nbytes}")
                arrays[i][:] = block.payload.numpy()
            if getattr(blocks, "still_valid", lambda: True)():
                break
            self.num_refetched += len(blocks)
        return metas + [b.meta for b in blocks]

    def put(self, blocks: Iterable[Block], ttl_s: float | None = None, pin: bool = False, *,
            namespace: Namespace | NamespaceDescription | None = None, import_tenant: str = "",
            durable: bool = False) -> list[PutResult]:
        """Store blocks (client keys in their metas); a present key is a no-op. One result per block.

        `durable` returns only once the blocks are committed to the daemon's disk tier (see
        PutRequest.durable); workers leave it off, as the cache is best effort.

        `namespace` describes the blocks' namespace to the daemon (the admin CLI shows it; the salt is
        sent only as a digest). `import_tenant` (operator only) stores blocks whose metas carry store
        keys of that tenant, as fetch_store_keys returned them.
        """
        if isinstance(namespace, Namespace):
            namespace = NamespaceDescription.of(namespace)
        info = namespace.to_pb() if namespace is not None else None
        results: list[PutResult] = []
        batch: list[Block] = []
        size = 0
        for block in blocks:
            if not isinstance(block, Block):
                raise InvalidArgument(f"put takes Blocks (a BlockMeta and a payload tensor), got {type(block).__name__}")
            if batch and (size + block.meta.nbytes > PUT_BATCH_BYTES or len(batch) >= PUT_BATCH_RECORDS):
                results += self._put_batch(batch, ttl_s, pin, info, import_tenant, durable)
                batch, size = [], 0
            batch.append(block)
            size += block.meta.nbytes
        if batch:
            results += self._put_batch(batch, ttl_s, pin, info, import_tenant, durable)
        return results

    def _put_batch(self, blocks: list[Block], ttl_s: float | None, pin: bool, info: pb.NamespaceInfo | None,
                   import_tenant: str, durable: bool) -> list[PutResult]:
        """One Put call: a unary PutBatch when the blocks fit in one modest message (a worker's
        write-back), else the Put stream, a record per message."""
        requests = []  # each block's PutRequest but its record
        described = False
        for i, b in enumerate(blocks):
            last = i == len(blocks) - 1
            req = pb.PutRequest(ttl_s=ttl_s or 0.0, pin=pin, last=last, import_tenant=import_tenant,
                                durable=durable and last)
            if info is not None and not described and b.meta.namespace == info.digest:
                req.namespace.CopyFrom(info)  # once per call: the daemon keeps it per namespace
                described = True
            requests.append(req)
        if self.shared_memory and self._slab.usable:
            try:
                staged = self._staged.put(self._staging_dir(), blocks, requests,
                                          lambda m: self._put_batch_raw(m, timeout=self.timeout_s, metadata=self._metadata))
            except grpc.RpcError as e:
                raise self._error(e) from None
            if staged is not None:
                return [PUT_RESULTS[r] for r in staged.results]
        if sum(b.meta.nbytes for b in blocks) <= PUT_ONE_MESSAGE_BYTES and time.monotonic() >= self._put_batch_after:
            message = wire.put_batch([(plain_record_parts(b), r.SerializeToString()) for b, r in zip(blocks, requests)])
            try:
                reply = self._put_batch_raw(message, timeout=self.timeout_s, metadata=self._metadata)
                return [PUT_RESULTS[r] for r in reply.results]
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                    logger.info("the daemon has no PutBatch (older version): putting over the Put stream for "
                                "the next %.0f s", PUT_BATCH_RETRY_S)
                    self._put_batch_after = time.monotonic() + PUT_BATCH_RETRY_S
                elif not (e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in (e.details() or "")):
                    raise self._error(e) from None
                # else the message, headers and all, is over the daemon's server.max_message_bytes (which
                # bounds the payload of a whole Put): the stream sends it a record per message.

        def stream() -> Iterator[pb.PutRequest]:
            for b, req in zip(blocks, requests):
                req.record = encode_block(b)
                yield req

        reply = self._call(self._stub.Put, stream())
        return [PUT_RESULTS[r] for r in reply.results]

    def _staging_dir(self) -> str:
        """The daemon's staging directory, learnt with the slab (an empty FetchShared when this
        client has fetched nothing yet); empty from a daemon without staged Puts."""
        if not self._slab.staging_dir and self._slab.index is None:
            slab, _ = parse_fetch_response(self._call(self._fetch_shared_raw, pb.FetchRequest(shared_memory=True)))
            if slab is not None:
                self._slab.reader(slab)
        return self._slab.staging_dir

    def fetch_store_keys(self, store_keys: Sequence[bytes]) -> list[Block]:
        """The caller's blocks named by store keys (as List returns them), absent ones skipped; their
        metas carry store keys (key and parent). Each is verified against its checksum."""
        blocks: list[Block] = []
        responses = self._fetch_raw(pb.FetchRequest(store_keys=list(store_keys)), timeout=self.timeout_s,
                                    metadata=self._metadata)
        for data in self._stream(responses):
            try:
                _, items = parse_fetch_response(data)
            except ValueError as e:
                responses.cancel()
                raise TierCacheError(f"malformed Fetch response from the daemon: {e}") from None
            for index, body in items:
                if index >= len(store_keys) or isinstance(body, pb.SlabBlock):
                    responses.cancel()
                    raise TierCacheError(f"daemon sent an unexpected block (index {index})")
                block = self._decode(body, store_keys[index])
                if block is not None:
                    blocks.append(block)
        return blocks

    def prefetch(self, keys: Sequence[bytes]) -> int:
        """Promote the cached prefix of `keys` from disk into host; returns blocks promoted."""
        return self._call(self._stub.Prefetch, pb.PrefetchRequest(keys=list(keys))).num_promoted

    def stats(self) -> ServiceStats:
        r = self._call(self._stub.Stats, pb.StatsRequest())
        tiers = [TierUsage(TIER_NAMES[t.tier], t.capacity_bytes, t.tenant_blocks, t.tenant_bytes, t.used_bytes,
                           t.num_blocks, t.hits, t.misses, t.puts, t.evictions, t.verification_failures,
                           t.promotions, t.lookup_hits)
                 for t in r.tiers]
        return ServiceStats(r.tenant, tiers, r.tenant_bytes, r.tenant_quota_bytes, r.version,
                            [TenantUsage(t.tenant, t.num_blocks, t.bytes) for t in r.tenants], r.lookups,
                            r.lookup_misses, r.verification_failures, r.tokens_reused, r.tokens_computed,
                            r.requests_reported)

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
        only); returns how many."""
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

    def report(self, *, prompt_tokens: int, cached_tokens: int, ttft_s: float, prefill_s: float) -> None:
        """Tell the daemon's metrics what one request did. It goes with the next Touch, a moment later
        and together with the reports that come meanwhile (close() sends what is pending); bad figures
        raise InvalidArgument here, as the daemon would. With a daemon too old to take reports with
        Touch it is a Report call, made now (see client_touch.Toucher)."""
        if not 0 <= cached_tokens <= prompt_tokens:
            raise InvalidArgument(f"cached_tokens {cached_tokens} must be within [0, prompt_tokens {prompt_tokens}]")
        for name, value in (("ttft_s", ttft_s), ("prefill_s", prefill_s)):
            if not math.isfinite(value) or value < 0:
                raise InvalidArgument(f"{name} must be a finite number of seconds >= 0, got {value}")
        self._toucher.reported(pb.ReportRequest(prompt_tokens=prompt_tokens, cached_tokens=cached_tokens,
                                                computed_tokens=prompt_tokens - cached_tokens, ttft_s=ttft_s,
                                                prefill_s=prefill_s))

    def health(self, service: str = "") -> str:
        """"SERVING", "NOT_SERVING", ... of the daemon (or of one service name)."""
        reply = self._call(self._health.Check, health_pb2.HealthCheckRequest(service=service))
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
