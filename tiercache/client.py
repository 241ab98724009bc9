"""Client of the tiercache daemon: typed calls, status codes back to tiercache.errors, shared-memory fetch."""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tiercache import status
from tiercache.codec import decode_block, encode_block
from tiercache.client_types import (ListedBlock, Listing, NamespaceDescription, ServiceStats, TenantUsage,
                                    TierUsage, VerifyResult)
from tiercache.errors import NotFound, TierCacheError
from tiercache.keys import Namespace
from tiercache.layout import checksum
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
TIER_NAMES = {pb.TIER_GPU: "gpu", pb.TIER_HOST: "host", pb.TIER_DISK: "disk"}
TIER_VALUES = {v: k for k, v in TIER_NAMES.items()}
PUT_RESULTS = {pb.PUT_RESULT_STORED: PutResult.STORED, pb.PUT_RESULT_ALREADY_PRESENT: PutResult.ALREADY_PRESENT}
FETCH_METHOD = f"/{pb.DESCRIPTOR.services_by_name['TierCache'].full_name}/Fetch"
T = TypeVar("T")


_malloc_tuned = False


def tune_malloc() -> None:
    """Keep block-sized buffers on the heap in this process (glibc only; idempotent).

    glibc gives every buffer of 128 KiB or more its own mmap and trims freed heap eagerly, so each
    received block costs fresh page faults: measured 4x slower decoding of 1 MiB blocks, 1.6x of
    64 KiB ones, in a VM. This keeps buffers up to 32 MiB on the heap and up to 256 MiB of freed
    heap for reuse, as the daemon does for itself (server/main.py).
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


def _varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("truncated or overlong varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def _fields(buf: memoryview) -> Iterator[tuple[int, int | memoryview]]:
    """(field number, value) of each field of a serialized message; length-delimited values are
    zero-copy views, fixed-width ones are skipped (FetchResponse has none)."""
    pos = 0
    while pos < len(buf):
        tag, pos = _varint(buf, pos)
        wire = tag & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
            yield tag >> 3, value
        elif wire == 2:
            size, pos = _varint(buf, pos)
            if pos + size > len(buf):
                raise ValueError(f"field {tag >> 3} runs past the end of the message")
            yield tag >> 3, buf[pos : pos + size]
            pos += size
        elif wire in (1, 5):
            pos += 8 if wire == 1 else 4
        else:
            raise ValueError(f"unsupported wire type {wire}")


def _is_descriptor_message(data: bytes) -> bool:
    """Whether a serialized FetchResponse carries slab descriptors, not a record: it opens with the
    slab info (field 1) or its first block's body is a SlabBlock (field 3). Records come one per
    message, so the first tags decide the whole message without walking a multi-MiB record."""
    view = memoryview(data)
    if not len(view) or view[0] != 0x12:  # 0x12: field 2 (blocks), length-delimited
        return bool(len(view)) and view[0] == 0x0A  # 0x0A: field 1 (slab)
    try:
        _, pos = _varint(view, 1)  # the block's length
        if pos < len(view) and view[pos] == 0x08:  # its index (absent when 0)
            _, pos = _varint(view, pos + 1)
    except ValueError:
        return False
    return pos < len(view) and view[pos] == 0x1A  # 0x1A: field 3 (slab_block)


def parse_fetch_response(data: bytes) -> tuple[pb.SlabInfo | None, list[tuple[int, memoryview | pb.SlabBlock]]]:
    """A serialized FetchResponse as (slab, [(index, record view or SlabBlock)]); ValueError if malformed."""
    if _is_descriptor_message(data):
        # Descriptors are small: the C parser reads a batch of them far faster than a walk in Python.
        try:
            message = pb.FetchResponse.FromString(data)
        except Exception as e:  # noqa: BLE001 - protobuf's DecodeError differs by implementation
            raise ValueError(str(e)) from None
        slab = message.slab if message.HasField("slab") else None
        parsed: list[tuple[int, memoryview | pb.SlabBlock]] = []
        for fb in message.blocks:
            body = fb.WhichOneof("body")
            if body is None:
                raise ValueError(f"block {fb.index} has neither a record nor a slab descriptor")
            parsed.append((fb.index, fb.slab_block if body == "slab_block" else memoryview(fb.record)))
        return slab, parsed
    slab = None
    items: list[tuple[int, memoryview | pb.SlabBlock]] = []
    for number, value in _fields(memoryview(data)):
        if number == 1 and isinstance(value, memoryview):
            slab = pb.SlabInfo.FromString(bytes(value))
        elif number == 2 and isinstance(value, memoryview):
            index, body = 0, None
            for inner, item in _fields(value):
                if inner == 1 and isinstance(item, int):
                    index = item
                elif inner == 2 and isinstance(item, memoryview):
                    body = item
                elif inner == 3 and isinstance(item, memoryview):
                    body = pb.SlabBlock.FromString(bytes(item))
            if body is None:
                raise ValueError(f"block {index} has neither a record nor a slab descriptor")
            items.append((index, body))
    return slab, items


def meta_from_pb(m: pb.BlockMeta) -> BlockMeta:
    return BlockMeta(key=m.key, namespace=m.namespace, num_tokens=m.num_tokens, dtype=m.dtype, shape=tuple(m.shape),
                     nbytes=m.nbytes, checksum=m.checksum, parent=m.parent, preview=m.preview)


class Client:
    """A connection to the daemon. `target` is "unix:/path" or "host:port"; every call passes a timeout.

    Failed calls raise the tiercache.errors class the daemon raised (Unavailable when it cannot be
    reached, DeadlineExceeded on timeout). Thread-safe; close() (or a with-block) releases it.
    tune_allocator (default) applies tune_malloc() to this process: blocks decode up to 4x faster.
    """

    def __init__(self, target: str, *, token: str | None = None, timeout_s: float = 5.0,
                 tls_root_cert: str | bytes | None = None, tune_allocator: bool = True) -> None:
        if tune_allocator:  # see tune_malloc: a process-wide setting, hence the opt-out
            tune_malloc()
        self.target = target
        self.timeout_s = timeout_s
        self.is_unix = target.startswith("unix:")
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
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {token}"),) if token else ()
        self._readers: dict[str, Any] = {}  # slab path -> SlabReader
        self._shared_memory_ok = True
        self.num_refetched = 0  # shared-memory blocks that had to be fetched again as bytes

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()
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
            raise error_from_rpc(e) from None

    def _stream(self, responses: Iterator[T]) -> Iterator[T]:
        try:
            yield from responses
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None

    # ---- rpcs -----------------------------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> list[str]:
        """Tier ("gpu", "host", "disk") of each block of the longest cached prefix of `keys`."""
        reply = self._call(self._stub.Lookup, pb.LookupRequest(keys=list(keys)))
        return [TIER_NAMES[t] for t in reply.tiers]

    def fetch(self, keys: Sequence[bytes], shared_memory: bool | None = None) -> list[Block]:
        """The blocks of the longest cached prefix of `keys`, each verified against its checksum.

        shared_memory (default: whether the target is a Unix socket) copies blocks out of the
        daemon's host slab; a block recycled during the copy is fetched again as bytes, and a
        block that cannot be had intact ends the prefix. Never returns damaged bytes.
        """
        keys = list(keys)
        use_shm = (self.is_unix if shared_memory is None else shared_memory) and self._shared_memory_ok
        blocks = self._fetch_once(keys, use_shm)
        for i, block in enumerate(blocks):
            if block is None and use_shm:  # recycled while we copied, or the slab was unusable
                self.num_refetched += 1
                again = self._fetch_once([keys[i]], False)
                block = blocks[i] = again[0] if again else None
            if block is None:
                logger.debug("fetch: block %d of %d could not be had intact; the prefix ends there", i, len(keys))
                del blocks[i:]
                break
        return blocks  # type: ignore[return-value]  # no None is left

    def _fetch_once(self, keys: list[bytes], shared_memory: bool) -> list[Block | None]:
        """One Fetch call: a block per key of the cached prefix, None where it must be fetched again."""
        blocks: list[Block | None] = []
        described: list[tuple[int, pb.SlabBlock]] = []  # copied out together once the call ends
        reader = None
        responses = self._fetch_raw(pb.FetchRequest(keys=keys, shared_memory=shared_memory),
                                    timeout=self.timeout_s, metadata=self._metadata)
        for data in self._stream(responses):
            try:
                slab, items = parse_fetch_response(data)
            except ValueError as e:
                responses.cancel()
                raise TierCacheError(f"malformed Fetch response from the daemon: {e}") from None
            if slab is not None:
                reader = self._reader(slab)
            for index, body in items:
                if index != len(blocks) or index >= len(keys):
                    responses.cancel()
                    raise TierCacheError(f"daemon sent block index {index}, expected {len(blocks)}")
                if isinstance(body, pb.SlabBlock):
                    if body.meta.key != keys[index]:
                        responses.cancel()
                        raise TierCacheError(f"daemon described block {body.meta.key.hex()} for key {keys[index].hex()}")
                    described.append((index, body))
                    blocks.append(None)
                else:
                    blocks.append(self._decode(body, keys[index]))
        if described and reader is not None:
            self._copy_out(reader, described, blocks)
        return blocks

    def _decode(self, record: bytes | memoryview, key: bytes) -> Block | None:
        try:
            return decode_block(record, max_payload_bytes=MAX_MESSAGE_BYTES, expected_key=key)
        except TierCacheError as e:  # CorruptBlock: never hand damaged bytes to the model
            logger.warning("discarding a damaged block from the daemon: %s", e)
            return None

    def _reader(self, slab: pb.SlabInfo) -> Any:
        from tiercache.tiers.host import SlabReader  # only same-host callers need it

        reader = self._readers.get(slab.path)
        if reader is None:
            for old in self._readers.values():  # a restarted daemon has a new slab
                old.close()
            self._readers.clear()
            try:
                reader = SlabReader(slab.path)
            except (TierCacheError, OSError) as e:
                # Same socket, different filesystem view (e.g. a container): stream bytes from now on.
                logger.warning("cannot map the daemon's slab %s (%s); fetching bytes instead", slab.path, e)
                self._shared_memory_ok = False
                return None
            if (reader.page_bytes, reader.header_bytes, reader.num_pages) != (
                    slab.page_bytes, slab.header_bytes, slab.num_pages):
                reader.close()
                raise TierCacheError(f"slab {slab.path} geometry differs from what the daemon announced")
            self._readers[slab.path] = reader
        return reader

    def _copy_out(self, reader: Any, described: list[tuple[int, pb.SlabBlock]], blocks: list[Block | None]) -> None:
        """Copy the described blocks out of the slab and set blocks[index] to each one that is intact
        (its pages unchanged and its checksum right); the others stay None."""
        try:
            payloads = reader.read_many([(d.pages, d.generations, d.meta.nbytes) for _, d in described],
                                        checksums=[d.meta.checksum for _, d in described])
        except TierCacheError as e:
            raise TierCacheError(f"daemon sent an unusable slab descriptor: {e}") from None
        for (index, item), payload in zip(described, payloads):
            if payload is not None:  # pages unchanged and checksum right
                blocks[index] = Block(meta_from_pb(item.meta), payload)

    def put(self, blocks: Iterable[Block], ttl_s: float | None = None, pin: bool = False, *,
            namespace: Namespace | NamespaceDescription | None = None, import_tenant: str = "") -> list[PutResult]:
        """Store blocks (client keys in their metas); a present key is a no-op. One result per block.

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
            if batch and (size + block.meta.nbytes > PUT_BATCH_BYTES or len(batch) >= PUT_BATCH_RECORDS):
                results += self._put_batch(batch, ttl_s, pin, info, import_tenant)
                batch, size = [], 0
            batch.append(block)
            size += block.meta.nbytes
        if batch:
            results += self._put_batch(batch, ttl_s, pin, info, import_tenant)
        return results

    def _put_batch(self, blocks: list[Block], ttl_s: float | None, pin: bool, info: pb.NamespaceInfo | None,
                   import_tenant: str) -> list[PutResult]:
        def requests() -> Iterator[pb.PutRequest]:
            described = False
            for i, b in enumerate(blocks):
                req = pb.PutRequest(record=encode_block(b), ttl_s=ttl_s or 0.0, pin=pin, last=i == len(blocks) - 1,
                                    import_tenant=import_tenant)
                if info is not None and not described and b.meta.namespace == info.digest:
                    req.namespace.CopyFrom(info)  # once per call: the daemon keeps it per namespace
                    described = True
                yield req

        reply = self._call(self._stub.Put, requests())
        return [PUT_RESULTS[r] for r in reply.results]

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
                               e.pinned, e.expires_unix_s, e.preview) for e in r.entries]
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
        """Tell the daemon's metrics what one request did (a worker calls it off the critical path)."""
        self._call(self._stub.Report, pb.ReportRequest(
            prompt_tokens=prompt_tokens, cached_tokens=cached_tokens, computed_tokens=prompt_tokens - cached_tokens,
            ttft_s=ttft_s, prefill_s=prefill_s))

    def health(self, service: str = "") -> str:
        """"SERVING", "NOT_SERVING", ... of the daemon (or of one service name)."""
        reply = self._call(self._health.Check, health_pb2.HealthCheckRequest(service=service))
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
