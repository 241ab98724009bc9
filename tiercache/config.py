"""Configuration: one frozen dataclass tree, loaded from TOML, then TIERCACHE_* variables, then flags."""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import os
import re
import tomllib
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tiercache.tenancy import LOCAL_TENANT

MAX_SOCKET_PATH_BYTES = 107  # sockaddr_un.sun_path is 108 bytes on Linux, the last one a NUL

MiB = 1 << 20
GiB = 1 << 30
WRITE_POLICIES = ("write_through", "write_back", "selective")
COMPRESSIONS = ("none", "zstd")
REMOTE_WRITE_POLICIES = ("all", "hits")


def default_data_dir() -> str:
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return os.path.join(base, "tiercache")


def default_socket() -> str:
    base = os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
    return os.path.join(base, f"tiercache-{os.getuid()}.sock")


@dataclass(frozen=True)
class HostConfig:
    """The shared-memory CPU pool."""

    capacity_bytes: int = 256 * MiB  # size of the slab, allocated once at start
    # Bytes per page; a block takes whole pages (the worker logs how its model's blocks fit)
    page_bytes: int = 64 * 1024
    shm_dir: str = "/dev/shm"  # where the slab, its index and clients' staging files live (tmpfs)
    high_watermark: float = 0.95  # fraction of capacity past which least recently used blocks leave
    low_watermark: float = 0.85  # ... down to this fraction


@dataclass(frozen=True)
class GpuConfig:
    """The device pool; disabled when capacity_bytes is 0 or CUDA is absent."""

    capacity_bytes: int = 0  # size of the device pool; 0: no gpu tier
    page_bytes: int = 64 * 1024  # bytes per page of the pool
    device: str = "cuda:0"  # the CUDA device that holds the pool
    promote_after_hits: int = 2  # a host block hit this often is copied into the gpu tier
    high_watermark: float = 0.95  # fraction of capacity past which least recently used blocks leave
    low_watermark: float = 0.85  # ... down to this fraction


@dataclass(frozen=True)
class DiskConfig:
    """The LMDB store; capacity_bytes is our own bound, map_size_bytes LMDB's fixed map."""

    enabled: bool = True  # false: no disk tier (nothing survives a restart)
    capacity_bytes: int = 2 * GiB  # bytes of LMDB map pages the blocks may take
    map_size_bytes: int = 0  # 0: capacity_bytes * 1.5 + 64 MiB; at least capacity_bytes * 1.25 + 64 MiB
    compression: str = "none"  # "none" or "zstd" (a block stays uncompressed unless it gains min_compress_ratio)
    zstd_level: int = 3  # 1-22
    shuffle: bool = True  # group each element's bytes by significance before zstd (helps fp16/fp32 KV)
    min_compress_ratio: float = 1.1  # raw / compressed size below which a block is stored uncompressed
    # write_through: every put; write_back: on eviction from host, and at a clean shutdown; selective:
    # after selective_hits hits (and pinned blocks at a clean shutdown)
    write_policy: str = "write_through"
    selective_hits: int = 2  # hits that send a block to disk under write_policy "selective"
    high_watermark: float = 0.95  # fraction of capacity past which least recently used blocks are deleted
    low_watermark: float = 0.85  # ... down to this fraction
    reader_check_interval_s: float = 60.0  # how often LMDB's reader slots of dead processes are cleared
    # the background scrub re-reads and verifies every block at up to this rate (bytes read from disk
    # per second), between calls; damaged blocks are dropped and counted (docs/reliability.md). 0: off
    scrub_bytes_per_s: int = 8 * MiB
    scrub_idle_s: float = 1.0  # the scrub reads only once no call has been in flight for this long
    scrub_interval_s: float = 86400.0  # the least time from the start of one full pass to the start of the next


@dataclass(frozen=True)
class RemoteConfig:
    """A Redis or Valkey Cluster (or one node) shared by daemons on several machines; off by default."""

    enabled: bool = False  # true: blocks missed locally are looked up in the cluster, new blocks written there
    # Comma-separated seed nodes, redis://HOST:PORT (rediss:// for TLS); the cluster tells the rest
    urls: str = ""
    cluster: bool = True  # false: a single Redis/Valkey node, not a cluster
    username: str = ""  # ACL user; empty: the default user
    password_file: str = ""  # file holding the ACL user's password; empty: no password
    # File holding the secret this daemon signs its values with (AES-GMAC under a key derived per value);
    # a value that fails the check is a miss. Required; never logged
    secret_file: str = ""
    # Comma-separated files of more secrets: values signed with one of them verify too, this daemon never signs
    # with them; a value whose secret is not listed here or in secret_file is a miss. For rotating the
    # secret without a flag day (docs/scale-out.md)
    verify_secret_files: str = ""
    tls_ca_file: str = ""  # PEM CA bundle to verify the nodes (rediss://); empty: the system's
    tls_cert_file: str = ""  # PEM client certificate, when the nodes ask for one
    tls_key_file: str = ""  # its PEM private key
    # Keys are KEY_PREFIX:TENANT:STORE_KEY_HEX (the tenant percent-encoded); a cluster ACL can confine a
    # daemon to its prefix, or to some tenants' keys under it (docs/scale-out.md)
    key_prefix: str = "tiercache"
    timeout_ms: int = 200  # deadline of each connect to and read from a shard; past it, that shard's keys are misses
    retry_after_s: float = 2.0  # a shard (or the cluster) that failed is not asked again for this long
    batch_blocks: int = 16  # blocks per batched read or write
    # all: every block put here goes to the cluster; hits: a block once it was hit write_after_hits times
    write_policy: str = "all"
    write_after_hits: int = 2  # hits that send a block to the cluster under write_policy "hits"
    queue_blocks: int = 256  # writes waiting for the writer; past this, new ones are dropped (counted)
    ttl_s: float = 0.0  # expiry of a block in the cluster; 0: none (the cluster evicts, allkeys-lru)


@dataclass(frozen=True)
class StoreConfig:
    """Policy shared by all tiers."""

    default_ttl_s: float = 0.0  # 0: blocks do not expire unless a put asks for a TTL
    max_block_bytes: int = 64 * MiB  # the largest block a Put may carry


@dataclass(frozen=True)
class ServerConfig:
    """The daemon's endpoints, auth and limits."""

    socket: str = field(default_factory=default_socket)  # the Unix socket ($XDG_RUNTIME_DIR/tiercache-UID.sock)
    listen: str = ""  # HOST:PORT for TCP; empty: Unix socket only
    tokens: Mapping[str, str] = field(default_factory=dict)  # token -> tenant, required with TCP
    tls_cert: str = ""  # PEM certificate chain for the TCP listener; empty: plaintext
    tls_key: str = ""  # its PEM private key
    max_message_bytes: int = 128 * MiB  # the largest gRPC message, and the payload of one Put
    max_concurrent_streams: int = 64  # per connection
    max_keys_per_call: int = 65536  # keys (or records) in one call
    tenant_quota_bytes: int = 0  # 0: no quota
    max_workers: int = 16  # threads serving calls
    idle_check_s: float = 5.0  # maintenance (TTL expiry) every this many seconds, between calls
    integrity_check_s: float = 600.0  # a full consistency check at most this often (0: never); O(blocks)
    metrics_port: int = 0  # 0: no metrics endpoint
    # Where the metrics endpoint binds: loopback unless the operator opens it ("0.0.0.0", a LAN address);
    # not server.listen's host, as the figures need no token to read.
    metrics_host: str = "127.0.0.1"
    # Label per-tenant metrics (tiercache_tenant_payload_bytes{tenant}) with tenant names; off: the
    # endpoint shows only figures summed over tenants, so a scrape names nobody.
    metrics_tenant_labels: bool = False
    drain_timeout_s: float = 30.0  # on SIGTERM: how long in-flight calls may finish, then queued disk writes
    # How long a same-host caller's room in the slab (Reserve, before its Commit) is held at most: a
    # caller that died or forgot it loses it then, and its pages are free again.
    reserve_lease_s: float = 30.0
    # Group (name or number) of trusted local workers: its members reach the Unix socket and the
    # same-host paths (the slab, its index, the disk tier's files, staged Puts) through group
    # permissions, as the daemon's user does; the daemon's user must belong to it. Empty: the daemon's
    # user alone (docs/local-users.md)
    local_group: str = ""
    # A second Unix socket (mode 0666) for local users outside local_group: the kernel names each
    # connection's uid (SO_PEERCRED), public_tenants its tenant; bytes over the stream only. Empty: none
    public_socket: str = ""
    # uid or user name -> tenant of callers on public_socket ("1001" = "vllm"); a user not listed is
    # refused unless its call carries a token of server.tokens
    public_tenants: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class WorkerConfig:
    """What `tiercache worker` stores beside the KV blocks it writes back."""

    # Store the prompt's first 64 characters with each chain's first block, for `tiercache admin ls`
    # and `explain`. Never for a salted namespace (its prompts are one user's: the salt is their
    # secret), whatever this says; false: no namespace gets one.
    previews: bool = True


@dataclass(frozen=True)
class Config:
    """The whole configuration: the daemon's sections and the worker's."""

    # the disk tier and namespace registry ($XDG_DATA_HOME/tiercache)
    data_dir: str = field(default_factory=default_data_dir)
    host: HostConfig = field(default_factory=HostConfig)
    gpu: GpuConfig = field(default_factory=GpuConfig)
    disk: DiskConfig = field(default_factory=DiskConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    remote: RemoteConfig = field(default_factory=RemoteConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)

    def __post_init__(self) -> None:
        validate(self)


def _fail(path: str, value: object, why: str) -> typing.NoReturn:
    raise ValueError(f"config field {path}={value!r}: {why}")


def validate(cfg: Config) -> None:
    """Raise ValueError naming the field for any bad value."""
    for section in ("host", "gpu", "disk"):
        sub = getattr(cfg, section)
        if sub.capacity_bytes < 0:
            _fail(f"{section}.capacity_bytes", sub.capacity_bytes, "must be >= 0")
        if not 0 < sub.low_watermark <= sub.high_watermark <= 1:
            _fail(f"{section}.low_watermark", sub.low_watermark, "need 0 < low_watermark <= high_watermark <= 1")
        if section != "disk" and not 4096 <= sub.page_bytes <= 64 * MiB:
            _fail(f"{section}.page_bytes", sub.page_bytes, "must be between 4096 and 64 MiB")
    if cfg.host.capacity_bytes < cfg.host.page_bytes:
        _fail("host.capacity_bytes", cfg.host.capacity_bytes, "must hold at least one page")
    if cfg.disk.write_policy not in WRITE_POLICIES:
        _fail("disk.write_policy", cfg.disk.write_policy, f"expected one of {', '.join(WRITE_POLICIES)}")
    if cfg.disk.compression not in COMPRESSIONS:
        _fail("disk.compression", cfg.disk.compression, f"expected one of {', '.join(COMPRESSIONS)}")
    if not 1 <= cfg.disk.zstd_level <= 22:
        _fail("disk.zstd_level", cfg.disk.zstd_level, "must be between 1 and 22")
    if cfg.disk.selective_hits < 1:
        _fail("disk.selective_hits", cfg.disk.selective_hits, "must be >= 1")
    least_map = int(cfg.disk.capacity_bytes * 1.25) + 64 * MiB
    if cfg.disk.map_size_bytes and cfg.disk.map_size_bytes < least_map:
        # With less, LMDB's map fills up before the tier reaches its capacity, and writes are dropped.
        _fail("disk.map_size_bytes", cfg.disk.map_size_bytes,
              f"must be >= disk.capacity_bytes * 1.25 + 64 MiB = {least_map}: LMDB needs room beyond the "
              "blocks' pages (their meta records, a commit's new pages, pages freed but not yet reusable)")
    if (cfg.disk.enabled and cfg.disk.write_policy == "write_through"
            and cfg.disk.capacity_bytes < cfg.host.capacity_bytes):
        _fail("disk.capacity_bytes", cfg.disk.capacity_bytes,
              "write_through needs the disk tier at least as large as host.capacity_bytes")
    if cfg.gpu.capacity_bytes and cfg.gpu.capacity_bytes > cfg.host.capacity_bytes:
        _fail("gpu.capacity_bytes", cfg.gpu.capacity_bytes, "must not exceed host.capacity_bytes")
    if cfg.store.max_block_bytes < 1:
        _fail("store.max_block_bytes", cfg.store.max_block_bytes, "must be >= 1")
    if not (math.isfinite(cfg.store.default_ttl_s) and cfg.store.default_ttl_s >= 0):
        _fail("store.default_ttl_s", cfg.store.default_ttl_s, "must be a finite number of seconds >= 0 (0: none)")
    if cfg.gpu.promote_after_hits < 1:
        _fail("gpu.promote_after_hits", cfg.gpu.promote_after_hits, "must be >= 1")
    if not (math.isfinite(cfg.disk.min_compress_ratio) and cfg.disk.min_compress_ratio >= 1):
        _fail("disk.min_compress_ratio", cfg.disk.min_compress_ratio, "must be a finite ratio >= 1")
    if not (math.isfinite(cfg.disk.reader_check_interval_s) and cfg.disk.reader_check_interval_s > 0):
        _fail("disk.reader_check_interval_s", cfg.disk.reader_check_interval_s,
              "must be a finite number of seconds > 0")
    if cfg.disk.scrub_bytes_per_s < 0:
        _fail("disk.scrub_bytes_per_s", cfg.disk.scrub_bytes_per_s, "must be >= 0 (0: no scrub)")
    for name in ("scrub_idle_s", "scrub_interval_s"):
        if not (math.isfinite(getattr(cfg.disk, name)) and getattr(cfg.disk, name) >= 0):
            _fail(f"disk.{name}", getattr(cfg.disk, name), "must be a finite number of seconds >= 0")
    _validate_remote(cfg.remote)
    srv = cfg.server
    if srv.listen:
        host, sep, port = srv.listen.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
            _fail("server.listen", srv.listen, "expected HOST:PORT")
        if not srv.tokens:
            _fail("server.tokens", {}, "TCP listening requires at least one token (token -> tenant)")
    for token, tenant in srv.tokens.items():
        if not token or not tenant:
            _fail("server.tokens", f"{token}={tenant}", "a token and its tenant must both be non-empty")
        if tenant == LOCAL_TENANT:
            _fail("server.tokens", f"{token}={tenant}", f"tenant {LOCAL_TENANT!r} is the operator on the Unix "
                  "socket (no token); a token, which any network caller can present, cannot stand for it")
    if bool(srv.tls_cert) != bool(srv.tls_key):
        _fail("server.tls_cert", srv.tls_cert, "tls_cert and tls_key go together")
    if srv.tls_cert and not srv.listen:
        _fail("server.tls_cert", srv.tls_cert, "TLS is for the TCP listener: set server.listen too")
    if srv.socket and len(os.fsencode(srv.socket)) > MAX_SOCKET_PATH_BYTES:
        _fail("server.socket", srv.socket, f"longer than the {MAX_SOCKET_PATH_BYTES} bytes a Unix socket path may have")
    if srv.tenant_quota_bytes < 0:
        _fail("server.tenant_quota_bytes", srv.tenant_quota_bytes, "must be >= 0 (0: no quota)")
    if not (math.isfinite(srv.drain_timeout_s) and srv.drain_timeout_s >= 0):
        _fail("server.drain_timeout_s", srv.drain_timeout_s, "must be a finite number of seconds >= 0")
    for name in ("max_message_bytes", "max_concurrent_streams", "max_keys_per_call", "max_workers"):
        if getattr(srv, name) < 1:
            _fail(f"server.{name}", getattr(srv, name), "must be >= 1")
    if not (math.isfinite(srv.reserve_lease_s) and srv.reserve_lease_s > 0):
        _fail("server.reserve_lease_s", srv.reserve_lease_s, "must be a finite number of seconds > 0")
    _validate_local_access(srv)
    if not (math.isfinite(srv.idle_check_s) and srv.idle_check_s > 0):
        _fail("server.idle_check_s", srv.idle_check_s, "must be a finite number of seconds > 0")
    if not (math.isfinite(srv.integrity_check_s) and srv.integrity_check_s >= 0):
        _fail("server.integrity_check_s", srv.integrity_check_s, "must be a finite number of seconds >= 0 (0: never)")
    if not 0 <= srv.metrics_port < 65536:
        _fail("server.metrics_port", srv.metrics_port, "must be a port number or 0")
    if not _is_host(srv.metrics_host):
        _fail("server.metrics_host", srv.metrics_host, "expected an IP address or a host name, without a port")
    for path, value in (("server.metrics_tenant_labels", srv.metrics_tenant_labels),
                        ("worker.previews", cfg.worker.previews)):
        if not isinstance(value, bool):
            _fail(path, value, "expected true or false")


_ACCOUNT = re.compile(r"[0-9]+|[A-Za-z_][A-Za-z0-9_.-]{0,31}\$?")  # a uid/gid, or a user/group name


def _validate_local_access(srv: ServerConfig) -> None:
    """server.local_group, public_socket, public_tenants (names are resolved when the daemon starts)."""
    if srv.local_group and not _ACCOUNT.fullmatch(srv.local_group):
        _fail("server.local_group", srv.local_group, "expected a group name or a gid")
    if srv.public_socket:
        if len(os.fsencode(srv.public_socket)) > MAX_SOCKET_PATH_BYTES:
            _fail("server.public_socket", srv.public_socket,
                  f"longer than the {MAX_SOCKET_PATH_BYTES} bytes a Unix socket path may have")
        if srv.socket and os.path.abspath(srv.public_socket) == os.path.abspath(srv.socket):
            _fail("server.public_socket", srv.public_socket, "must differ from server.socket")
    elif srv.public_tenants:
        _fail("server.public_tenants", dict(srv.public_tenants), "they are the callers of server.public_socket: set it")
    for user, tenant in srv.public_tenants.items():
        if not _ACCOUNT.fullmatch(user):
            _fail("server.public_tenants", f"{user}={tenant}", "expected a uid or a user name")
        if not tenant or tenant == LOCAL_TENANT:
            _fail("server.public_tenants", f"{user}={tenant}", f"the tenant must be non-empty and not "
                  f"{LOCAL_TENANT!r} (the operator, on server.socket)")


def _validate_remote(rem: RemoteConfig) -> None:
    if not isinstance(rem.enabled, bool) or not isinstance(rem.cluster, bool):
        _fail("remote.enabled", rem.enabled, "expected true or false")
    if rem.enabled:
        urls = [u.strip() for u in rem.urls.split(",") if u.strip()]
        if not urls:
            _fail("remote.urls", rem.urls, "the remote tier needs at least one redis://HOST:PORT")
        for url in urls:
            if not re.fullmatch(r"(redis|rediss|valkey|valkeys)://[^/\s:]+(:\d{1,5})?/?", url):
                _fail("remote.urls", url, "expected redis://HOST:PORT or rediss://HOST:PORT (no user or "
                      "password in the URL: remote.username and remote.password_file)")
        if not rem.secret_file:
            _fail("remote.secret_file", rem.secret_file, "the remote tier needs the cluster-wide secret's file")
        if rem.verify_secret_files.strip() and not all(p.strip() for p in rem.verify_secret_files.split(",")):
            _fail("remote.verify_secret_files", rem.verify_secret_files, "expected FILE[,FILE...], no entry empty")
        if not rem.cluster and len(urls) != 1:
            _fail("remote.urls", rem.urls, "remote.cluster = false takes exactly one node")
    if bool(rem.tls_cert_file) != bool(rem.tls_key_file):
        _fail("remote.tls_cert_file", rem.tls_cert_file, "tls_cert_file and tls_key_file go together")
    if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", rem.key_prefix):
        _fail("remote.key_prefix", rem.key_prefix, "expected 1-64 letters, digits, '_', '.' or '-'")
    if not 1 <= rem.timeout_ms <= 60_000:
        _fail("remote.timeout_ms", rem.timeout_ms, "must be between 1 and 60000")
    if not (math.isfinite(rem.retry_after_s) and rem.retry_after_s >= 0):
        _fail("remote.retry_after_s", rem.retry_after_s, "must be a finite number of seconds >= 0")
    if not 1 <= rem.batch_blocks <= 1024:
        _fail("remote.batch_blocks", rem.batch_blocks, "must be between 1 and 1024")
    if rem.write_policy not in REMOTE_WRITE_POLICIES:
        _fail("remote.write_policy", rem.write_policy, f"expected one of {', '.join(REMOTE_WRITE_POLICIES)}")
    if rem.write_after_hits < 1:
        _fail("remote.write_after_hits", rem.write_after_hits, "must be >= 1")
    if rem.queue_blocks < 1:
        _fail("remote.queue_blocks", rem.queue_blocks, "must be >= 1")
    if not (math.isfinite(rem.ttl_s) and rem.ttl_s >= 0):
        _fail("remote.ttl_s", rem.ttl_s, "must be a finite number of seconds >= 0 (0: none)")


_HOST_NAME = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9-]{1,63}(?<!-))*\.?")


def _is_host(host: object) -> bool:
    """An address a socket can bind: an IPv4/IPv6 literal or a DNS name (not "HOST:PORT", not empty)."""
    if not isinstance(host, str) or not host or len(host) > 253:
        return False
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return _HOST_NAME.fullmatch(host) is not None


def _coerce(path: str, kind: object, value: object) -> object:
    """Convert a TOML/env/flag value to the field's declared type, or fail naming the field."""
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            return value.lower() in ("1", "true", "yes", "on")
        _fail(path, value, "expected a boolean")
    if kind is int:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            _fail(path, value, "expected an integer")  # not truncated: 4096.9 is a typo, not 4096
        try:
            return int(value)  # type: ignore[call-overload]  # any value: int()'s TypeError is reported below
        except (TypeError, ValueError, OverflowError):
            _fail(path, value, "expected an integer")
    if kind is float:
        try:
            return float(value)  # type: ignore[arg-type]  # any value: float()'s TypeError is reported below
        except (TypeError, ValueError):
            _fail(path, value, "expected a number")
    if kind is str:
        if not isinstance(value, str):
            _fail(path, value, "expected a string")
        return value
    # Mapping[str, str] (server.tokens): a TOML table, or "tok1=tenant1,tok2=tenant2" from env/flags.
    if isinstance(value, str):
        pairs = [p for p in value.split(",") if p]
        if not all("=" in p for p in pairs):
            _fail(path, value, "expected TOKEN=TENANT[,TOKEN=TENANT...]")
        value = dict(p.split("=", 1) for p in pairs)
    if not isinstance(value, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        _fail(path, value, "expected a table of strings")
    return dict(value)


PATH_FIELDS = frozenset({"data_dir", "host.shm_dir", "server.socket", "server.public_socket", "server.tls_cert",
                         "server.tls_key", "remote.password_file", "remote.secret_file", "remote.tls_ca_file",
                         "remote.tls_cert_file", "remote.tls_key_file"})


def _build(cls: type, values: Mapping[str, object], prefix: str = "") -> object:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ValueError(f"unknown config key(s): {', '.join(prefix + k for k in unknown)}")
    kwargs: dict[str, object] = {}
    for name, value in values.items():
        kind = hints[name]
        if isinstance(kind, type) and dataclasses.is_dataclass(kind):
            if not isinstance(value, Mapping):
                _fail(prefix + name, value, "expected a table")
            kwargs[name] = _build(kind, value, f"{prefix}{name}.")
        else:
            coerced = _coerce(prefix + name, kind, value)
            if prefix + name in PATH_FIELDS and isinstance(coerced, str):
                coerced = os.path.expanduser(coerced)  # "~/tiercache" as a shell would read it
            kwargs[name] = coerced
    return cls(**kwargs)


def _set(tree: dict, dotted: str, value: object) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ValueError(f"config key {dotted!r} conflicts with a non-table value")
    node[parts[-1]] = value


def load_config(path: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None,
                overrides: Sequence[tuple[str, object]] = ()) -> Config:
    """Defaults, then the TOML file, then TIERCACHE_SECTION__FIELD variables, then dotted overrides.

    Environment example: TIERCACHE_HOST__CAPACITY_BYTES=1073741824 sets host.capacity_bytes;
    TIERCACHE_DATA_DIR sets data_dir. Unknown keys and bad values raise ValueError naming the field.
    """
    tree: dict = {}
    if path is not None:
        try:
            with open(path, "rb") as f:
                tree = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"config file {path}: {e}") from None
        except OSError as e:
            raise ValueError(f"config file {path}: {e.strerror}") from None
    env = os.environ if env is None else env
    for name, value in env.items():
        if name.startswith("TIERCACHE_") and name not in ENV_NOT_CONFIG:
            _set(tree, name[len("TIERCACHE_"):].lower().replace("__", "."), value)
    for dotted, override in overrides:
        _set(tree, dotted, override)
    return typing.cast(Config, _build(Config, tree))


# TIERCACHE_* variables that are read elsewhere, not config fields.
ENV_NOT_CONFIG = frozenset({"TIERCACHE_LOG_LEVEL", "TIERCACHE_SOCKET_FOR_CLIENTS", "TIERCACHE_TOKEN"})


def data_path(cfg: Config, *parts: str) -> Path:
    return Path(cfg.data_dir).joinpath(*parts)
