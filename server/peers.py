"""The public socket: local users outside server.local_group reach the daemon as the tenant the kernel's
account of their uid (SO_PEERCRED) names, over the byte path only.

gRPC does not tell a servicer who is at the other end of a Unix socket (its peer() is "unix:"), so the
daemon accepts on server.public_socket itself: it reads each connection's credentials, then relays the
connection's bytes unchanged to a gRPC listener of its own (in a directory only the daemon's user can
enter), from an abstract socket address it names at random and records with the caller (PeerTable). gRPC
reports that address as the call's peer, and the interceptor (server/auth.py) looks the caller up by it.
No credential travels: every connection is vouched for by the kernel, and any gRPC client works as is.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pwd
import secrets
import shutil
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import grpc

from tiercache.errors import InvalidArgument

logger = logging.getLogger(__name__)

PEER_PREFIX = "unix-abstract:"  # how gRPC names a peer bound to an abstract address
MAX_CONNECTIONS = 256  # relayed connections at once (two threads each); a gRPC channel holds one
MAX_CONNECTIONS_PER_UID = 64  # so that one local user cannot take them all
RELAY_CHUNK_BYTES = 256 << 10
_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid


@dataclass(frozen=True)
class Peer:
    """A caller on the public socket, as the kernel named it when it connected."""

    pid: int  # in the daemon's pid namespace (0 when the caller's is not visible from it)
    uid: int
    gid: int
    tenant: str | None  # from server.public_tenants; None: not listed


def tenants_by_uid(public_tenants: Mapping[str, str]) -> dict[int, str]:
    """server.public_tenants with user names resolved to uids; InvalidArgument for a name this host
    does not know or a uid listed twice."""
    out: dict[int, str] = {}
    for user, tenant in public_tenants.items():
        try:
            uid = int(user) if user.isdigit() else pwd.getpwnam(user).pw_uid
        except KeyError:
            raise InvalidArgument(f"server.public_tenants: no user {user!r} on this host (a uid works for a "
                                  "user that exists only in a container)") from None
        if out.get(uid, tenant) != tenant:
            raise InvalidArgument(f"server.public_tenants: uid {uid} is listed twice, as {out[uid]!r} and {tenant!r}")
        out[uid] = tenant
    return out


class PeerTable:
    """The relayed connections open now: their address on the internal listener -> their caller.
    An address is added before its connection reaches gRPC and removed before its socket closes, so
    an address freed for reuse never names anyone."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._peers: dict[str, Peer] = {}

    def add(self, address: str, peer: Peer) -> None:
        with self._lock:
            self._peers[address] = peer

    def remove(self, address: str) -> None:
        with self._lock:
            self._peers.pop(address, None)

    def get(self, grpc_peer: str) -> Peer | None:
        """The caller of a call whose context.peer() is `grpc_peer`; None when not a relayed connection."""
        return self._peers.get(grpc_peer)

    def __len__(self) -> int:
        return len(self._peers)


class _Relay:
    """One caller's connection and its twin to the internal listener, bytes pumped both ways."""

    def __init__(self, caller: socket.socket, upstream: socket.socket, address: str, peer: Peer,
                 on_closed: Callable[[_Relay], None]) -> None:
        self.caller, self.upstream, self.address, self.peer = caller, upstream, address, peer
        self._on_closed = on_closed
        self._lock = threading.Lock()
        self._running = 2

    def start(self) -> None:
        for src, dst, name in ((self.caller, self.upstream, "in"), (self.upstream, self.caller, "out")):
            threading.Thread(target=self._pump, args=(src, dst), name=f"peer-{name}-{self.peer.uid}",
                             daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        buf = bytearray(RELAY_CHUNK_BYTES)
        view = memoryview(buf)
        try:
            while True:
                n = src.recv_into(buf)
                if not n:
                    break
                dst.sendall(view[:n])
        except OSError:
            pass  # the other end went away: so does this direction
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)
            with self._lock:
                self._running -= 1
                last = self._running == 0
            if last:
                self._on_closed(self)

    def shutdown(self) -> None:
        """End both directions now (the pumps then close the relay)."""
        for sock in (self.caller, self.upstream):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


class PublicSocket:
    """server.public_socket: accepts, asks the kernel who connected, relays to `internal_address`.

    bind() creates the socket (mode 0666: who may use it is decided per connection); start() accepts
    in a thread; stop_accepting() closes the listener; release() also ends every relayed connection
    and removes the internal listener's directory. A caller over the connection limits is
    disconnected at once (logged)."""

    def __init__(self, path: str, tenants: Mapping[int, str]) -> None:
        self.path = path
        self.peers = PeerTable()
        self._tenants = dict(tenants)
        # The internal listener's directory: 0700, so no process of another user can connect to it
        # (and pick an address of its own); the table is the second lock on that door.
        self._dir = tempfile.mkdtemp(prefix="tiercache-peers-")
        self.internal_address = os.path.join(self._dir, "grpc.sock")
        self._listener: socket.socket | None = None
        self._lock = threading.Lock()
        self._relays: set[_Relay] = set()
        self._stopping = False

    def bind(self, mode: int) -> None:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            listener.bind(self.path)
            os.chmod(self.path, mode)
            listener.listen(128)
        except OSError as e:
            listener.close()
            raise InvalidArgument(f"server.public_socket {self.path!r}: cannot listen there ({e.strerror})") from None
        self._listener = listener

    def start(self) -> None:
        assert self._listener is not None, "bind() first"
        threading.Thread(target=self._accept, args=(self._listener,), name="public-accept", daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                caller, _ = listener.accept()
            except OSError as e:
                if self._stopping:
                    return
                logger.warning("public socket %s: accept failed: %s", self.path, e)
                time.sleep(0.1)  # out of descriptors, say: give calls in flight a moment to end
                continue
            try:
                self._admit(caller)
            except Exception:  # noqa: BLE001 - one caller's failure must never stop the listener
                logger.exception("public socket %s: could not relay a connection", self.path)
                caller.close()

    def _admit(self, caller: socket.socket) -> None:
        pid, uid, gid = _CREDENTIALS.unpack(caller.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                              _CREDENTIALS.size))
        peer = Peer(pid=pid, uid=uid, gid=gid, tenant=self._tenants.get(uid))
        with self._lock:
            mine = sum(1 for r in self._relays if r.peer.uid == uid)
            full = self._stopping or len(self._relays) >= MAX_CONNECTIONS or mine >= MAX_CONNECTIONS_PER_UID
        if full:
            logger.warning("public socket %s: refused a connection of uid %d (pid %d): connections=%d, of this "
                           "uid=%d (limits %d, %d per uid)", self.path, uid, pid, len(self._relays), mine,
                           MAX_CONNECTIONS, MAX_CONNECTIONS_PER_UID)
            caller.close()
            return
        name = f"tiercache-peer-{secrets.token_hex(16)}"
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        address = PEER_PREFIX + name
        try:
            upstream.bind("\0" + name)
            self.peers.add(address, peer)
            upstream.connect(self.internal_address)
        except OSError as e:
            self.peers.remove(address)
            upstream.close()
            caller.close()
            logger.warning("public socket %s: cannot relay uid %d to %s: %s", self.path, uid, self.internal_address, e)
            return
        relay = _Relay(caller, upstream, address, peer, self._closed)
        with self._lock:
            self._relays.add(relay)
        logger.debug("public socket %s: uid=%d pid=%d tenant=%s connected", self.path, uid, pid, peer.tenant)
        relay.start()

    def _closed(self, relay: _Relay) -> None:
        self.peers.remove(relay.address)  # first: see PeerTable
        for sock in (relay.caller, relay.upstream):
            sock.close()
        with self._lock:
            self._relays.discard(relay)

    def stop_accepting(self) -> None:
        self._stopping = True
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() in progress
            listener.close()

    def release(self) -> None:
        """Stop accepting, end every relayed connection, remove the internal listener's directory. Idempotent."""
        self.stop_accepting()
        with self._lock:
            relays = list(self._relays)
        for relay in relays:
            relay.shutdown()
        shutil.rmtree(self._dir, ignore_errors=True)


class WithPublicSocket(grpc.Server):
    """The daemon's server and the one behind its public socket, started and stopped as one."""

    def __init__(self, main: grpc.Server, inner: grpc.Server, public: PublicSocket) -> None:
        self._main, self._inner, self._public = main, inner, public

    @property
    def public(self) -> PublicSocket:
        return self._public

    def add_generic_rpc_handlers(self, generic_rpc_handlers: Iterable[grpc.GenericRpcHandler]) -> None:
        self._main.add_generic_rpc_handlers(generic_rpc_handlers)

    def add_insecure_port(self, address: str) -> int:
        return self._main.add_insecure_port(address)

    def add_secure_port(self, address: str, server_credentials: grpc.ServerCredentials) -> int:
        return self._main.add_secure_port(address, server_credentials)

    def start(self) -> None:
        self._main.start()
        self._inner.start()
        self._public.start()

    def stop(self, grace: float | None) -> threading.Event:
        """Stop accepting on every socket; calls in flight get `grace` seconds (relayed ones too),
        then relayed connections are ended."""
        self._public.stop_accepting()
        stopping = [self._main.stop(grace), self._inner.stop(grace)]
        done = threading.Event()

        def finish() -> None:
            for event in stopping:
                event.wait()
            self._public.release()
            done.set()

        threading.Thread(target=finish, name="public-stop", daemon=True).start()
        return done

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._main.wait_for_termination(timeout):
            return True
        return self._inner.wait_for_termination(None if deadline is None else max(0.0, deadline - time.monotonic()))
