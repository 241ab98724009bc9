"""Client of the tiercache daemon: typed calls, status codes back to tiercache.errors, shared-memory fetch."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar, cast

import grpc
import numpy as np
import torch

# grpcio-health-checking ships no type information, and its stubs (types-grpcio-health-checking
# 1.0.0) declare no HealthStub.Check, which mypy then refuses: left untyped.
from grpc_health.v1 import health_pb2, health_pb2_grpc  # type: ignore[import-untyped]  # see above

from tiercache import status
from tiercache.block import Block, BlockMeta
from tiercache.client.fetch import FetchedBlocks, SlabCopier, parse_fetch_response  # parse_...: re-exported
from tiercache.client.manage import TIER_NAMES, ManageCalls
from tiercache.client.put import PUT_BATCH_METHOD, PutCalls
from tiercache.client.reserve import SlabWriters
from tiercache.client.stage import StagedPuts
from tiercache.client.touch import Toucher
from tiercache.codec import decode_block
from tiercache.errors import InvalidArgument, TierCacheError, Unavailable
from tiercache.keys import KEY_BYTES
from tiercache.malloc import tune_malloc
from tiercache.tenancy import LOCAL_TENANT, ScopedKeys
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
                   ("grpc.max_reconnect_backoff_ms", 500),
                   # Subchannels of its own: gRPC shares them between channels to the same target by
                   # default, so a client made after a daemon restart would inherit the dead
                   # connection's failure and backoff, and fail its first calls at once.
                   ("grpc.use_local_subchannel_pool", 1)]
LOCAL_MAX_KEYS = 4096  # longer key lists go to the daemon (whose limit is server.max_keys_per_call)
LEARN_SLAB_S = 5.0  # a client without the daemon's index asks for it at most this often (_learn_slab)
FETCH_METHOD = f"/{pb.DESCRIPTOR.services_by_name['TierCache'].full_name}/Fetch"
FETCH_SHARED_METHOD = f"/{pb.DESCRIPTOR.services_by_name['TierCache'].full_name}/FetchShared"
T = TypeVar("T")


def error_from_rpc(e: grpc.RpcError) -> TierCacheError:
    """The tiercache exception for a failed call (the table in tiercache/status.py, inverted)."""
    code = e.code() if hasattr(e, "code") else None
    # grpc's stubs type each item as an object with .key and .value; they are (key, value) tuples,
    # the value a str for a text key such as ours (bytes for a -bin one).
    items = cast("Iterable[tuple[str, str | bytes]]", e.trailing_metadata() or ()) \
        if hasattr(e, "trailing_metadata") else ()
    class_name = dict(items).get(status.ERROR_CLASS_KEY)
    cls = status.from_code(code.name if code else "UNKNOWN", class_name if isinstance(class_name, str) else None)
    details = e.details() if hasattr(e, "details") else str(e)
    return cls(details or (code.name if code else "rpc failed"))


def _no_stream() -> None:
    """The cancel() of a unary call: there is no stream to cancel."""


def _key_list(keys: Sequence[bytes]) -> list[bytes]:
    """`keys` as a list; one bytes object (a single key where a list belongs) is refused, as
    list() would make it a list of ints."""
    if isinstance(keys, (bytes, bytearray, memoryview)):
        raise InvalidArgument("keys must be a list of 32-byte block keys, not one bytes object")
    return list(keys)


class Client(PutCalls, ManageCalls):
    """A connection to the daemon. `target` is "unix:/path" or "host:port"; every call passes a timeout.

    Failed calls raise the tiercache.errors class the daemon raised (Unavailable when it cannot be
    reached, DeadlineExceeded on timeout). Thread-safe; close() (or a with-block) releases it.
    tune_allocator=True applies tune_malloc() to this process (blocks decode up to 4x faster); off by
    default, as it changes glibc's malloc settings for everything else the process runs.
    """

    def __init__(self, target: str, *, token: str | None = None, timeout_s: float = 5.0,
                 tls_root_cert: str | bytes | None = None, tune_allocator: bool = False,
                 shared_memory: bool = True, put_in_place: bool = True) -> None:
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
        self._fetch_raw: grpc.UnaryStreamMultiCallable[pb.FetchRequest, bytes] = self._channel.unary_stream(
            FETCH_METHOD, request_serializer=pb.FetchRequest.SerializeToString)
        self._fetch_shared_raw: grpc.UnaryUnaryMultiCallable[pb.FetchRequest, bytes] = self._channel.unary_unary(
            FETCH_SHARED_METHOD, request_serializer=pb.FetchRequest.SerializeToString)
        # PutBatch requests are framed by hand too: each payload is copied once, into the message.
        self._put_batch_raw = self._channel.unary_unary(PUT_BATCH_METHOD,
                                                        response_deserializer=pb.PutResponse.FromString)
        # time.monotonic() until which puts go over the stream: a daemon older than PutBatch said UNIMPLEMENTED
        self._put_batch_after = 0.0
        self._writers = SlabWriters()
        # put_in_place=False: same-host puts go through the staging file (as a caller that cannot map
        # the slab for writing does); tests and benchmarks compare the two.
        self._writers.usable = put_in_place
        self._in_place_after = 0.0
        self.num_in_place_puts = 0
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {token}"),) if token else ()
        self._slab = SlabCopier()
        # Without a token a Unix-socket caller is tenant "local", whose store keys it can compute:
        # it may then find blocks in the daemon's shared index without a call (see fetch_views).
        self._local = self.shared_memory and token is None
        self._scoped = ScopedKeys(LOCAL_TENANT)  # store keys, remembered like the daemon does
        self._toucher = Toucher(lambda request, timeout_s: self._call(self._stub.Touch, request, timeout_s),
                                lambda request, timeout_s: self._call(self._stub.Report, request, timeout_s))
        # Same-host Puts: payloads through a staging file (stage.py), readable by the index's group.
        self._staged = StagedPuts(lambda: index.path if (index := self._slab.index) is not None else None)
        self._learn_after = 0.0  # see _learn_slab
        self.num_refetched = 0  # shared-memory blocks that had to be fetched again as bytes
        self.num_local = 0  # fetches answered from the shared index, without a call

    @property
    def num_disk_blocks(self) -> int:
        """Blocks this client read from the daemon's disk tier itself (tiercache/client/disk_reader.py)."""
        return self._slab.num_disk_blocks

    def close(self) -> None:
        self._toucher.close()
        self._staged.close()
        self._writers.close()
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

    def lookup(self, keys: Sequence[bytes], *, probe: bool = False, holes: bool = False) -> list[str]:
        """Tier ("gpu", "host", "disk", "remote") of each block of the longest cached prefix of
        `keys` (answered from the shared index, without a call, when it holds all of them in host).

        `probe`: a check (is this block stored already?), not a request's lookup: the daemon leaves
        it out of its lookup statistics. `holes`: every key's tier up to the last cached one, ""
        for a block no tier holds (LookupRequest.holes); answered from the shared index (the present
        prefix only) when the daemon has no remote tier."""
        keys = _key_list(keys)
        if self._may_answer_locally(keys):
            scoped = self._scoped(keys)
            found = self._slab.local_prefix(scoped)
            if holes and found < len(keys) and self._slab.remote:
                pass  # a remote tier may hold keys past the local prefix: the daemon asks it
            # Known without a call: all in host, or the next key is in no tier (presence filter).
            elif found == len(keys) or not self._slab.maybe_present(scoped[found]):
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
        reply = self._call(self._stub.Lookup, pb.LookupRequest(keys=keys, probe=probe, holes=holes))
        return [TIER_NAMES.get(t, "") for t in reply.tiers]

    def _may_answer_locally(self, keys: list[bytes]) -> bool:
        """Whether the shared index may answer for `keys`: a tokenless same-host client, an index,
        and keys the daemon itself would accept (else the call gives the precise error). A client
        that has not mapped the index yet maps it now (_learn_slab)."""
        if not (self._local and 0 < len(keys) <= LOCAL_MAX_KEYS and set(map(len, keys)) == {KEY_BYTES}):
            return False
        return self._slab.index is not None or self._learn_slab()

    def _learn_slab(self) -> bool:
        """Map the daemon's slab, its index and its disk tier with one empty FetchShared, so that
        even a client's first lookup and fetch (a worker just started, a daemon just restarted) are
        answered here; at most once every LEARN_SLAB_S. Whether the index is mapped now."""
        if time.monotonic() < self._learn_after or not self._slab.usable:
            return False
        self._learn_after = time.monotonic() + LEARN_SLAB_S
        try:
            slab, _ = parse_fetch_response(self._call(self._fetch_shared_raw, pb.FetchRequest(shared_memory=True)))
        except (TierCacheError, ValueError) as e:  # the call that follows gets the daemon's own answer
            logger.debug("could not map the daemon's slab: %s", e)
            # Refused, keys aside: no shared memory for this caller (the public socket): bytes from now on.
            self._slab.usable = self._slab.usable and not isinstance(e, InvalidArgument)
            return False
        if slab is not None:
            try:
                self._slab.reader(slab)
            except TierCacheError as e:  # a slab unlike what the daemon announced: calls, as before
                logger.warning("cannot use the daemon's slab: %s", e)
                return False
        return self._slab.index is not None

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
        if use_shm and self._slab.index is None:  # first learn whether the daemon hands this caller any
            self._learn_slab()
            use_shm = self._slab.usable
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
            cancel: Callable[[], object] = _no_stream
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
                        raise TierCacheError(f"daemon described block {body.meta.key.hex()} for key "
                                             f"{keys[index].hex()}")
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

    def fetch_into(self, keys: Sequence[bytes],
                   outs: Sequence[torch.Tensor | np.ndarray | Sequence[torch.Tensor] | Sequence[np.ndarray]]
                   ) -> list[BlockMeta]:
        """Copy the blocks of the longest cached prefix of `keys` (at most len(outs)) into `outs` and
        return their metas. Each out is the caller's memory for one block: a contiguous CPU tensor of
        the block's nbytes (any dtype and shape: a staging buffer, a block of a contiguous pool), or
        a list of CPU tensors of any dtypes, shapes and strides that take the block's bytes in order
        (its canonical layout's pieces: per layer K then V, each [num_kv_heads, tokens, head_dim],
        as views into a paged pool of another layout; numpy arrays too, which cost less to make per
        piece than tensors). outs past the prefix may hold bytes of blocks
        that could not be had intact: only the returned prefix counts. Found through the shared
        index, each block is copied straight from the daemon's slab and hashed piece by piece in the
        same pass (the slab is read once, no second copy); otherwise it comes from the daemon,
        verified, and is copied in. InvalidArgument when an out cannot hold its block."""
        keys = _key_list(keys)[: len(outs)]
        dests: list[np.ndarray | list[np.ndarray]] = []
        for i, out in enumerate(outs[: len(keys)]):
            if isinstance(out, np.ndarray):
                if not out.flags.c_contiguous:
                    raise InvalidArgument(f"outs[{i}] must be a contiguous array (or a list of arrays)")
                dests.append(out.reshape(-1).view(np.uint8))
            elif isinstance(out, torch.Tensor):
                if out.device.type != "cpu" or not out.is_contiguous():
                    raise InvalidArgument(f"outs[{i}] must be a contiguous CPU tensor (or a list of CPU tensors), "
                                          f"got {out.device} {tuple(out.shape)} {out.dtype}")
                dests.append(out.view(-1).view(torch.uint8).numpy())
            else:
                if any(isinstance(p, torch.Tensor) and p.device.type != "cpu" for p in out):
                    raise InvalidArgument(f"outs[{i}] must hold CPU tensors")
                dests.append([p if isinstance(p, np.ndarray) else _bits(p) for p in out])
        metas: list[BlockMeta] = []
        if self._local and self._slab.index is not None and keys:
            found = self._slab.local_into(keys, self._scoped(keys), dests)
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
                copy_into(dests[i], block.payload.numpy(), f"outs[{i}]")
            if blocks.still_valid():
                break
            self.num_refetched += len(blocks)
        return metas + [b.meta for b in blocks]

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

    def send_touches(self, timeout_s: float = 5.0) -> None:
        """Tell the daemon now, not a moment later, what this client read and looked up through the
        shared index and the reports it holds (see touch.Toucher): when this returns, the daemon's
        LRU order, hit counts and promotions reflect every read made before the call."""
        self._toucher.flush(timeout_s)

    def report(self, *, prompt_tokens: int, cached_tokens: int, ttft_s: float, prefill_s: float) -> None:
        """Tell the daemon's metrics what one request did. It goes with the next Touch, a moment later
        and together with the reports that come meanwhile (close() sends what is pending); bad figures
        raise InvalidArgument here, as the daemon would. With a daemon too old to take reports with
        Touch it is a Report call, made now (see touch.Toucher)."""
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


_SAME_SIZE_INTS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor's memory, its strides kept; dtypes numpy lacks (bfloat16, float8)
    as integers of their size: only bytes are copied into it."""
    try:
        return tensor.numpy()
    except TypeError:
        return tensor.view(_SAME_SIZE_INTS[tensor.element_size()]).numpy()


def copy_into(dest: np.ndarray | list[np.ndarray], payload: np.ndarray, where: str) -> None:
    """A block's bytes into a destination of fetch_into; InvalidArgument when the sizes differ."""
    given = dest.size if isinstance(dest, np.ndarray) else sum(piece.nbytes for piece in dest)
    if given != payload.size:
        raise InvalidArgument(f"{where} has {given} bytes, its block {payload.size}")
    if isinstance(dest, np.ndarray):
        dest[:] = payload
        return
    at = 0
    for piece in dest:
        np.copyto(piece, payload[at : at + piece.nbytes].view(piece.dtype).reshape(piece.shape))
        at += piece.nbytes
