"""The client's Put path: batching, hand-framed PutBatch messages, staged puts, and the Put stream as fallback."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import grpc

from tiercache import wire
from tiercache.block import Block, BlockMeta, PutResult
from tiercache.client.fetch import SlabCopier
from tiercache.client.reserve import Reservation, SlabWriters
from tiercache.client.stage import StagedPuts
from tiercache.client.types import NamespaceDescription
from tiercache.codec import encode_block, plain_record_parts
from tiercache.errors import CapacityExceeded, InvalidArgument, QuotaExceeded, TierCacheError, Unimplemented
from tiercache.keys import Namespace
from tiercache.v1 import tiercache_pb2 as pb
from tiercache.v1 import tiercache_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

PUT_BATCH_BYTES = 32 << 20  # payload bytes per Put call: well under the daemon's message budget
PUT_BATCH_RECORDS = 4096
PUT_ONE_MESSAGE_BYTES = 4 << 20  # a Put of at most this many payload bytes goes as one PutBatch message
# After a daemon answered that it has no PutBatch (an older version), the stream is used this long
# before PutBatch is tried again: the daemon may be upgraded under a long-running worker.
PUT_BATCH_RETRY_S = 300.0
PUT_RESULTS = {pb.PUT_RESULT_STORED: PutResult.STORED, pb.PUT_RESULT_ALREADY_PRESENT: PutResult.ALREADY_PRESENT}
PUT_BATCH_METHOD = f"/{pb.DESCRIPTOR.services_by_name['TierCache'].full_name}/PutBatch"


class PutCalls:
    """Client's put(); the connection state it uses is set up by Client.__init__."""

    shared_memory: bool
    is_unix: bool
    timeout_s: float
    _stub: pb_grpc.TierCacheStub
    _slab: SlabCopier
    _staged: StagedPuts
    _writers: SlabWriters
    _in_place_after: float  # time.monotonic() until which puts are not made in place (see _put_in_place)
    num_in_place_puts: int  # blocks written straight into the daemon's slab (Reserve, Commit)
    _put_batch_raw: Callable[..., pb.PutResponse]
    _put_batch_after: float  # time.monotonic() until which puts go over the stream
    _learn_slab: Callable[[], bool]
    _metadata: tuple[tuple[str, str], ...]
    _call: Callable[..., Any]
    _error: Callable[[grpc.RpcError], TierCacheError]

    @property
    def num_staged_puts(self) -> int:
        """Blocks put through the staging file (no payload bytes over gRPC)."""
        return self._staged.num_staged

    @property
    def num_put_fallbacks(self) -> int:
        """Staged Puts the daemon refused, or staging that could not be set up: sent as bytes instead."""
        return self._staged.num_fallbacks

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
                raise InvalidArgument("put takes Blocks (a BlockMeta and a payload tensor), got "
                                      f"{type(block).__name__}")
            if batch and (size + block.meta.nbytes > PUT_BATCH_BYTES or len(batch) >= PUT_BATCH_RECORDS):
                results += self._put_batch(batch, ttl_s, pin, info, import_tenant, durable)
                batch, size = [], 0
            batch.append(block)
            size += block.meta.nbytes
        if batch:
            results += self._put_batch(batch, ttl_s, pin, info, import_tenant, durable)
        return results

    @property
    def puts_in_place(self) -> bool:
        """Whether puts go in place from here (reserve works): a same-host client that may write the
        daemon's slab, and a daemon that offers Reserve, as far as this client knows."""
        return (self.shared_memory and self._slab.usable and self._writers.usable
                and time.monotonic() >= self._in_place_after)

    def reserve(self, metas: Sequence[BlockMeta], *, namespace: Namespace | NamespaceDescription | None = None,
                lease_s: float = 0.0) -> Reservation:
        """Room in the daemon's slab for each block of `metas` not stored yet (client keys; checksums
        are ignored: the daemon computes them when the blocks are committed), for a caller on its Unix
        socket that may map the slab (the daemon's user, or server.local_group): write the payloads
        in place, then commit (see Reservation). The room is held lease_s seconds (0: the daemon's
        server.reserve_lease_s). InvalidArgument for a caller that may not map it (TCP, the public
        socket, another user), CapacityExceeded when the daemon cannot make room."""
        if not (self.is_unix and self.shared_memory):
            raise InvalidArgument("reserve needs a client on the daemon's Unix socket with shared_memory on")
        if isinstance(namespace, Namespace):
            namespace = NamespaceDescription.of(namespace)
        return self._reserve(metas, namespace.to_pb() if namespace is not None else None, lease_s)

    def _reserve(self, metas: Sequence[BlockMeta], info: pb.NamespaceInfo | None, lease_s: float = 0.0
                 ) -> Reservation:
        """reserve(); a daemon without Reserve, or one that will not share its slab with this caller,
        or a slab this process cannot map for writing, also turn puts_in_place off for a while."""
        request = pb.ReserveRequest(blocks=[m.to_wire(pb.BlockMeta) for m in metas], lease_s=lease_s)
        if info is not None:
            request.namespace.CopyFrom(info)
        try:
            reply = self._call(self._stub.Reserve, request)
        except (Unimplemented, InvalidArgument) as e:
            if isinstance(e, Unimplemented) or "may map" in str(e):
                self._in_place_after = time.monotonic() + PUT_BATCH_RETRY_S
            raise
        release = functools.partial(self._call, self._stub.Release)
        try:
            writer = self._writers.writer(reply.slab.path)
        except InvalidArgument:
            release(pb.ReleaseRequest(reservation=reply.reservation))
            self._in_place_after = time.monotonic() + PUT_BATCH_RETRY_S
            raise
        return Reservation(metas, reply, writer, functools.partial(self._call, self._stub.Commit), release)

    def _put_in_place(self, blocks: list[Block], ttl_s: float | None, pin: bool, info: pb.NamespaceInfo | None,
                      durable: bool) -> list[PutResult] | None:
        """The blocks copied straight into room reserved in the daemon's slab (one copy, hashed by the
        daemon where they lie): a same-host caller's put. None when that cannot be done from here (a
        daemon without Reserve, a slab this process may not write): the caller puts another way, and
        in place is tried again after PUT_BATCH_RETRY_S.

        A chain larger than the room the daemon can hold in flight at once (a small host tier, or
        one mostly pinned) goes in halves, each committed before the next is reserved, so that the
        committed half can make way; a single block that finds no room is put another way."""
        try:
            room = self._reserve([b.meta for b in blocks], info)
        except (Unimplemented, InvalidArgument) as e:
            if time.monotonic() >= self._in_place_after:
                raise  # the daemon refused these blocks themselves: the put would be refused too
            logger.info("puts in place are not available (%s): putting another way for %.0f s", e, PUT_BATCH_RETRY_S)
            return None
        except QuotaExceeded:
            raise  # the tenant's limit, not the room in flight: not split (the whole chain was checked against it)
        except CapacityExceeded:
            if len(blocks) == 1:
                return None
            half = len(blocks) // 2
            first = self._put_in_place(blocks[:half], ttl_s, pin, info, durable)
            if first is None:
                return None
            rest = self._put_in_place(blocks[half:], ttl_s, pin, info, durable)
            if rest is None:
                return first + self._put_batch(blocks[half:], ttl_s, pin, info, "", durable, in_place=False)
            return first + rest
        with room:
            for i, block in enumerate(blocks):
                room.fill(i, [block.payload])
            results = room.commit(ttl_s=ttl_s, pin=pin, durable=durable)
        self.num_in_place_puts += results.count(PutResult.STORED)
        return results

    def _put_batch(self, blocks: list[Block], ttl_s: float | None, pin: bool, info: pb.NamespaceInfo | None,
                   import_tenant: str, durable: bool, in_place: bool = True) -> list[PutResult]:
        """One Put call: in place on the same host (Reserve, Commit); else staged, or a unary PutBatch
        when the blocks fit in one modest message (a worker's write-back), else the Put stream, a
        record per message."""
        if in_place and not import_tenant and self.puts_in_place:
            put = self._put_in_place(blocks, ttl_s, pin, info, durable)
            if put is not None:
                return put
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
        directory = self._staging_dir() if self.shared_memory and self._slab.usable else ""
        # No directory while the slab is not mapped yet (another thread is learning it): bytes, this once.
        if directory or (self.shared_memory and self._slab.usable and self._slab.index is not None):
            try:
                staged = self._staged.put(directory, blocks, requests, lambda m: self._put_batch_raw(
                    m, timeout=self.timeout_s, metadata=self._metadata))
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
            self._learn_slab()
        return self._slab.staging_dir
