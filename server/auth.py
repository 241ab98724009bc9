"""Authentication and tenancy: bearer token -> tenant (store keys: tiercache/tenancy.py), in-flight call tracking."""

from __future__ import annotations

import hashlib
import hmac
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import grpc

from server.errors import abort
from server.peers import PeerTable
from tiercache.config import ServerConfig
from tiercache.errors import InvalidArgument, Unauthenticated
from tiercache.tenancy import LOCAL_TENANT
from tiercache.wire import has_more_fields

logger = logging.getLogger(__name__)

_OPEN_METHODS = ("/grpc.health.v1.Health/",)  # probes need no token and reveal nothing
# (request streaming, response streaming) -> the handler's behavior attribute and its factory.
# tiercache.v1 has no bidirectional rpcs.
HANDLER_KINDS = {
    (False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
    (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
    (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
}


def _digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()


class Activity:
    """Counts calls in flight, so the daemon can run maintenance between calls."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._in_flight = 0
        self._last_exit = time.monotonic()  # the daemon's start counts as a call

    def enter(self) -> None:
        with self._lock:
            self._in_flight += 1

    def exit(self) -> None:
        with self._lock:
            self._in_flight -= 1
            self._last_exit = time.monotonic()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def quiet_s(self) -> float:
        """Seconds since the last call ended; 0 while one is in flight."""
        with self._lock:
            return 0.0 if self._in_flight else time.monotonic() - self._last_exit


class TenantContext:
    """The servicer context of an authenticated call: the gRPC context plus the caller's tenant.

    `unix` says whether the caller may use the same-host paths (shared-memory descriptors, staged
    Puts): it came over the daemon's Unix socket, which only its user and server.local_group reach;
    False over TCP and on the public socket (server/peers.py).
    """

    __slots__ = ("_context", "tenant", "unix")

    def __init__(self, context: grpc.ServicerContext, tenant: str, unix: bool) -> None:
        self._context = context
        self.tenant = tenant
        self.unix = unix

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


class Malformed:
    """A request message that did not parse; stands in for it until the handler can refuse it."""

    __slots__ = ("error",)

    def __init__(self, error: InvalidArgument) -> None:
        self.error = error


def _tolerant(deserializer: Callable[[bytes], Any] | None, max_fields: int) -> Callable[[bytes], Any] | None:
    """A deserializer that returns Malformed instead of raising: gRPC would answer INTERNAL for a
    message that does not parse, and a malformed request is the caller's INVALID_ARGUMENT. A message
    of more than `max_fields` top-level fields is refused unparsed: gRPC parses a unary request
    before any handler (or this interceptor's token check) runs."""
    if deserializer is None:
        return None

    def parse(data: bytes) -> Any:
        if has_more_fields(data, max_fields):
            return Malformed(InvalidArgument(f"request message has more than {max_fields} fields "
                                             "(server.max_keys_per_call bounds every list in a request)"))
        try:
            return deserializer(data)
        except Exception as e:  # noqa: BLE001 - DecodeError and friends
            return Malformed(InvalidArgument(f"request message does not parse ({type(e).__name__}: {e})"))
    return parse


def _passthrough(serializer: Callable[[Any], bytes] | None) -> Callable[[Any], bytes] | None:
    """A serializer that lets a handler yield messages it serialized itself (Fetch frames its
    records by hand so that a block's bytes are copied once, not three times)."""
    if serializer is None:
        return None

    def serialize(message: Any) -> bytes:
        return message if isinstance(message, bytes) else serializer(message)
    return serialize


def _checked(requests: Iterator[Any]) -> Iterator[Any]:
    """A request stream that raises InvalidArgument (inside the servicer, which maps it) at a bad message."""
    for request in requests:
        if isinstance(request, Malformed):
            raise request.error
        yield request


class AuthInterceptor(grpc.ServerInterceptor):
    """Resolves every call's tenant before the servicer sees it, counts calls in flight, and turns
    request messages that do not parse into INVALID_ARGUMENT.

    "authorization: Bearer <token>" metadata names the tenant (compared in constant time against
    every configured token, so timing reveals neither which token matched nor how much of one).
    Without a token, Unix-socket callers are tenant "local" and TCP callers are refused.

    With `peers` it guards the listener behind the public socket instead: a call's tenant is the one
    its connection's uid maps to (or its token's), never with the same-host paths, and a connection
    the public socket did not relay is refused.
    """

    def __init__(self, tokens: Mapping[str, str], activity: Activity,
                 max_keys_per_call: int = ServerConfig.max_keys_per_call, *, peers: PeerTable | None = None) -> None:
        # Digests, so that compare_digest always sees equal lengths and leaks not even the length.
        self._tokens = [(_digest(token.encode()), tenant) for token, tenant in tokens.items()]
        self._activity = activity
        # Every list in a request (keys, store_keys, a PutBatch's requests) is bounded by
        # max_keys_per_call, and no request has two lists of one field plus more than a few others.
        self._max_fields = 2 * max_keys_per_call + 16
        self._wrapped: dict[str, Any] = {}
        self._peers = peers

    def authenticate(self, context: grpc.ServicerContext) -> TenantContext:
        presented = [v for k, v in context.invocation_metadata() if k == "authorization"]
        if self._peers is not None:
            return self._authenticate_peer(context, presented)
        # A Unix-socket caller bound to an abstract address is named "unix-abstract:..."
        unix = context.peer().startswith(("unix:", "unix-abstract:"))
        if not presented:
            if unix:
                return TenantContext(context, LOCAL_TENANT, unix)
            raise Unauthenticated("TCP callers must send 'authorization: Bearer <token>' metadata")
        return TenantContext(context, self._token_tenant(presented, context), unix)

    def _authenticate_peer(self, context: grpc.ServicerContext, presented: list[Any]) -> TenantContext:
        assert self._peers is not None
        peer = self._peers.get(context.peer())
        if peer is None:
            raise Unauthenticated("this listener serves the daemon's public socket only (server.public_socket)")
        if presented:
            return TenantContext(context, self._token_tenant(presented, context), False)
        if peer.tenant is None:
            raise Unauthenticated(f"uid {peer.uid} has no tenant on this daemon's public socket: the operator lists "
                                  "its users in server.public_tenants (or send 'authorization: Bearer <token>')")
        return TenantContext(context, peer.tenant, False)

    def _token_tenant(self, presented: list[Any], context: grpc.ServicerContext) -> str:
        """The tenant of the one bearer token presented; Unauthenticated otherwise."""
        value = presented[0]
        if len(presented) > 1 or not isinstance(value, str) or not value.startswith("Bearer "):
            raise Unauthenticated("authorization metadata must be exactly one 'Bearer <token>'")
        offered = _digest(value[len("Bearer "):].encode())
        tenant = None
        for token, name in self._tokens:  # no early exit: every token is compared
            if hmac.compare_digest(offered, token):
                tenant = name
        if tenant is None:
            logger.info("rejected a call with an unknown token from %s", context.peer())
            raise Unauthenticated("unknown token")
        return tenant

    def intercept_service(self, continuation: Callable[[Any], Any], details: grpc.HandlerCallDetails) -> Any:
        # Handlers are per method, not per call: wrap each once (this runs on every call's hot path).
        cached = self._wrapped.get(details.method)
        if cached is not None:
            return cached
        handler = continuation(details)
        if handler is None or details.method.startswith(_OPEN_METHODS):
            return handler
        self._wrapped[details.method] = wrapped = self._wrap(handler)
        return wrapped

    def _wrap(self, handler: Any) -> Any:
        attribute, factory = HANDLER_KINDS[(handler.request_streaming, handler.response_streaming)]
        behavior = getattr(handler, attribute)
        if handler.response_streaming:
            wrapped = self._wrap_streaming(behavior)
        else:
            wrapped = self._wrap_unary(behavior, handler.request_streaming)
        return factory(wrapped, request_deserializer=_tolerant(handler.request_deserializer, self._max_fields),
                       response_serializer=_passthrough(handler.response_serializer))

    def _enter(self, context: grpc.ServicerContext) -> TenantContext:
        try:
            return self.authenticate(context)
        except Unauthenticated as exc:
            abort(context, exc)

    def _wrap_unary(self, behavior: Callable[..., Any], request_streaming: bool) -> Callable[..., Any]:
        def call(request: Any, context: grpc.ServicerContext) -> Any:
            scoped = self._enter(context)
            if isinstance(request, Malformed):
                abort(context, request.error)
            self._activity.enter()
            try:
                return behavior(_checked(request) if request_streaming else request, scoped)
            finally:
                self._activity.exit()
        return call

    def _wrap_streaming(self, behavior: Callable[..., Any]) -> Callable[..., Any]:
        def call(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            scoped = self._enter(context)
            if isinstance(request, Malformed):
                abort(context, request.error)
            self._activity.enter()
            try:
                yield from behavior(request, scoped)
            finally:
                self._activity.exit()
        return call
