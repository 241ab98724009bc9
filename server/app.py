"""create_server: the gRPC server for a TieredStore, on a Unix socket and optionally TCP (token auth, TLS)."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from concurrent import futures

import grpc

# No stubs for grpcio-health-checking in the dev extra yet (see tiercache/client/core.py).
from grpc_health.v1 import health, health_pb2, health_pb2_grpc  # type: ignore[import-untyped]  # see above

from server.access import PUBLIC_SOCKET_MODE, resolve_group, share_socket, share_store, warn_unless_reachable
from server.auth import Activity, AuthInterceptor
from server.instance import DataDirLock, SocketClaim
from server.metrics import DaemonMetrics, status_board
from server.namespaces import NamespaceRegistry
from server.peers import PublicSocket, WithPublicSocket, tenants_by_uid
from server.servicer import TierCacheServicer
from tiercache.config import Config, ServerConfig
from tiercache.errors import InvalidArgument
from tiercache.metrics import serve_metrics
from tiercache.store import TieredStore
from tiercache.v1 import tiercache_pb2, tiercache_pb2_grpc
from tiercache.web.pages import StatusPages

logger = logging.getLogger(__name__)

SERVICE_NAME = tiercache_pb2.DESCRIPTOR.services_by_name["TierCache"].full_name


def server_options(cfg: ServerConfig) -> list[tuple[str, int]]:
    """The one set of channel options of the daemon."""
    return [
        ("grpc.max_receive_message_length", cfg.max_message_bytes),
        ("grpc.max_send_message_length", cfg.max_message_bytes),
        ("grpc.max_concurrent_streams", cfg.max_concurrent_streams),
        # gRPC sets SO_REUSEPORT by default, which would let a second daemon share our TCP port.
        ("grpc.so_reuseport", 0),
    ]


def _bind(field: str, where: str, add_port: Callable[[], int]) -> int:
    """gRPC's add_*_port, whose failure (a port in use, an address not on this host, a socket path
    too long or in a missing directory) is a RuntimeError without the field: this names it."""
    try:
        return add_port()
    except RuntimeError as e:
        raise InvalidArgument(f"{field} {where!r}: cannot listen there ({e})") from None


def _tls_credentials(cfg: ServerConfig) -> grpc.ServerCredentials:
    try:
        with open(cfg.tls_key, "rb") as f:
            key = f.read()
        with open(cfg.tls_cert, "rb") as f:
            cert = f.read()
    except OSError as e:
        field = "server.tls_key" if e.filename == cfg.tls_key else "server.tls_cert"
        raise InvalidArgument(f"{field} {e.filename!r}: cannot read it: {e.strerror}") from None
    return grpc.ssl_server_credentials([(key, cert)])


def create_server(config: Config, store: TieredStore | None = None, *, claim: SocketClaim | None = None,
                  activity: Activity | None = None) -> tuple[grpc.Server, str]:
    """Build and bind (not start) the daemon's server; return it and the address clients should use.

    The address is `host:port` of the TCP listener when server.listen is set (the real port when
    it asked for port 0), else `unix:<socket>`. Without a `store`, the store is opened from the
    config under the data-directory lock; without a `claim`, the socket path is claimed here. What
    was opened or claimed here is released when the server terminates. Raises AlreadyRunning when
    another daemon owns the socket or data directory. The store's disk scrub is started (it reads
    only when no call has been in flight for disk.scrub_idle_s) and stopped when the server
    terminates. With server.metrics_port, Prometheus metrics
    are served at http://HOST:PORT/metrics (HOST: server.metrics_host, 127.0.0.1 unless configured
    otherwise, whatever server.listen says) until the server terminates.

    With server.local_group, the socket, the slab, its index and the disk tier's files are shared with
    that group (server/access.py). With server.public_socket, a second server answers the callers it
    relays (server/peers.py); the returned server then starts and stops both.
    """
    cfg = config.server
    if not cfg.socket and not cfg.listen:
        raise InvalidArgument("server.socket and server.listen are both empty: nothing to listen on")
    gid = resolve_group(cfg.local_group)
    public_tenants = tenants_by_uid(cfg.public_tenants)
    owned: list[object] = []
    try:
        if store is None:
            owned.append(DataDirLock(config.data_dir))
            store = TieredStore.open(config)
            owned.append(store)
        if gid is not None:
            share_store(store, config.data_dir, gid)
        if claim is None and cfg.socket:
            claim = SocketClaim(cfg.socket)
            owned.append(claim)
        activity = activity or Activity()
        metrics = DaemonMetrics(store, tenant_labels=cfg.metrics_tenant_labels)
        if store.remote is not None:
            from tiercache.tiers.remote_metrics import RemoteCollector

            metrics.registry.register(RemoteCollector(store.remote))
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=cfg.max_workers, thread_name_prefix="rpc"),
                             interceptors=[AuthInterceptor(cfg.tokens, activity, cfg.max_keys_per_call), metrics.rpc],
                             options=server_options(cfg))
        namespaces = NamespaceRegistry(config.data_dir)
        servicer = TierCacheServicer(store, config, namespaces, metrics.reports)
        health_servicer = health.HealthServicer()
        health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        tiercache_pb2_grpc.add_TierCacheServicer_to_server(servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        address = ""
        if cfg.socket:
            _bind("server.socket", cfg.socket, lambda: server.add_insecure_port(f"unix:{cfg.socket}"))
            assert claim is not None
            claim.bound()
            if gid is not None:
                share_socket(cfg.socket, gid)
            address = f"unix:{cfg.socket}"
        if cfg.public_socket:
            server = _with_public_socket(server, cfg, public_tenants, owned, servicer, health_servicer, activity,
                                         metrics)
        if cfg.listen:
            host = cfg.listen.rpartition(":")[0]
            if cfg.tls_cert:
                credentials = _tls_credentials(cfg)
                bound = _bind("server.listen", cfg.listen, lambda: server.add_secure_port(cfg.listen, credentials))
            else:
                logger.warning("TCP listener %s without TLS: tokens and blocks cross the network in clear",
                               cfg.listen)
                bound = _bind("server.listen", cfg.listen, lambda: server.add_insecure_port(cfg.listen))
            if not bound:
                raise InvalidArgument(f"cannot listen on {cfg.listen}")
            address = f"{host}:{bound}"
        # The disk tier's background scrub reads only between calls (a daemon holding a store owns its scrub).
        idle_s = config.disk.scrub_idle_s
        store.start_scrub(lambda: activity.in_flight > 0 or activity.quiet_s() < idle_s)
        owned.append(_Stopper(store.stop_scrub))
        if cfg.metrics_port:
            board = status_board(store, namespaces, metrics.reports)
            stop_metrics = serve_metrics(metrics.registry, cfg.metrics_port, cfg.metrics_host,
                                         StatusPages(board, cfg.tokens))
            board.start()
            owned.append(_Stopper(stop_metrics))
            owned.append(_Stopper(board.stop))
    except BaseException:
        for resource in reversed(owned):
            resource.close() if isinstance(resource, TieredStore) else resource.release()  # type: ignore[attr-defined]
        raise
    if owned:
        threading.Thread(target=_release_after, args=(server, owned), name="release", daemon=True).start()
    logger.debug("bound %s", address)
    return server, address


def _with_public_socket(server: grpc.Server, cfg: ServerConfig, tenants: dict[int, str], owned: list[object],
                        servicer: TierCacheServicer, health_servicer: health.HealthServicer, activity: Activity,
                        metrics: DaemonMetrics) -> grpc.Server:
    """`server` and, behind server.public_socket, a second one with the same servicer, health, call
    counts and metrics, whose interceptor names tenants by uid (server/peers.py); what it claims
    and opens joins `owned`."""
    claim = SocketClaim(cfg.public_socket)
    owned.append(claim)
    public = PublicSocket(cfg.public_socket, tenants)
    owned.append(public)
    interceptor = AuthInterceptor(cfg.tokens, activity, cfg.max_keys_per_call, peers=public.peers)
    inner = grpc.server(futures.ThreadPoolExecutor(max_workers=cfg.max_workers, thread_name_prefix="rpc-public"),
                        interceptors=[interceptor, metrics.rpc], options=server_options(cfg))
    tiercache_pb2_grpc.add_TierCacheServicer_to_server(servicer, inner)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, inner)
    _bind("server.public_socket", public.internal_address,
          lambda: inner.add_insecure_port(f"unix:{public.internal_address}"))
    public.bind(PUBLIC_SOCKET_MODE)
    claim.bound()
    warn_unless_reachable(os.path.dirname(os.path.abspath(cfg.public_socket)), None, "server.public_socket")
    logger.info("public socket %s for local users outside server.local_group: users with a tenant=%d",
                cfg.public_socket, len(tenants))
    return WithPublicSocket(server, inner, public)


class _Stopper:
    """A stop function as a resource create_server releases when the server terminates."""

    def __init__(self, stop: Callable[[], None]) -> None:
        self.release = stop


def _release_after(server: grpc.Server, owned: list[object]) -> None:
    """Release what create_server opened once the server has stopped (stores: drain writes first)."""
    server.wait_for_termination()
    for resource in reversed(owned):
        try:
            if isinstance(resource, TieredStore):
                resource.flush_writes()
                resource.close()
            else:
                resource.release()  # type: ignore[attr-defined]
        except Exception:
            logger.exception("releasing %r after shutdown failed", resource)
