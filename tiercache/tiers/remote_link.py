"""The remote tier's link to a Redis/Valkey Cluster (or one node): batched per-shard pipelines that fail per shard."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, overload
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import AskError
from redis.retry import Retry

from tiercache.config import RemoteConfig
from tiercache.errors import InvalidArgument

logger = logging.getLogger(__name__)

Op = Callable[[Any, bytes], None]  # adds one command for a key to a pipeline
ArgOp = Callable[[Any, bytes, Any], None]  # the same, with the key's own argument (a value to set)
FAILED = object()  # the result of a command whose shard did not answer in time
REFRESH_WHILE_DOWN_S = 0.5  # while a shard is left alone, the slot map is asked for again this often


def read_secret(path: str, field: str) -> bytes:
    try:
        with open(path, "rb") as f:
            value = f.read().strip()
    except OSError as e:
        raise InvalidArgument(f"{field} {path!r}: cannot read it: {e.strerror}") from None
    if not value:
        raise InvalidArgument(f"{field} {path!r} is empty")
    return value


def read_secrets(cfg: RemoteConfig) -> list[bytes]:
    """The cluster's secrets, the one that signs first: remote.secret_file, then each of
    remote.verify_secret_files (comma-separated, `~` expanded); raises InvalidArgument naming the
    field of a file that is missing, unreadable or empty."""
    secrets = [read_secret(cfg.secret_file, "remote.secret_file")]
    for path in (p.strip() for p in cfg.verify_secret_files.split(",")):
        if path:
            secrets.append(read_secret(os.path.expanduser(path), "remote.verify_secret_files"))
    return secrets


def _seeds(urls: str) -> tuple[list[tuple[str, int]], bool]:
    seeds, tls = [], set()
    for url in (u.strip() for u in urls.split(",") if u.strip()):
        parts = urlsplit(url)
        if parts.scheme not in ("redis", "rediss", "valkey", "valkeys") or not parts.hostname:
            raise InvalidArgument(f"remote.urls {url!r}: expected redis://HOST:PORT or rediss://HOST:PORT")
        seeds.append((parts.hostname, parts.port or 6379))
        tls.add(parts.scheme in ("rediss", "valkeys"))
    if len(tls) > 1:
        raise InvalidArgument("remote.urls mixes TLS (rediss://) and plaintext (redis://) nodes")
    return seeds, tls.pop()


class ClusterLink:
    """Commands on many keys at once, one pipeline per shard, the shards in parallel: one round trip.

    A shard that refuses, times out (remote.timeout_ms) or is unreachable yields FAILED for its
    keys and is left alone for remote.retry_after_s; the other shards' answers stand. A MOVED or
    ASK reply (resharding) is retried through redis-py's cluster client, which follows it and
    refreshes its slot map. Thread-safe.
    """

    def __init__(self, cfg: RemoteConfig) -> None:
        self.cfg = cfg
        self._seeds, tls = _seeds(cfg.urls)
        kwargs: dict[str, Any] = dict(
            username=cfg.username or None,
            password=read_secret(cfg.password_file, "remote.password_file").decode() if cfg.password_file else None,
            socket_timeout=cfg.timeout_ms / 1000, socket_connect_timeout=cfg.timeout_ms / 1000,
            retry=Retry(NoBackoff(), 0))  # a failure is a miss now, not a retry that holds the request
        if tls:
            kwargs.update(ssl=True, ssl_ca_certs=cfg.tls_ca_file or None, ssl_certfile=cfg.tls_cert_file or None,
                          ssl_keyfile=cfg.tls_key_file or None)
        self._kwargs = kwargs
        self._lock = threading.Lock()
        self._client: RedisCluster | redis.Redis | None = None
        self._client_retry_at = 0.0
        self._down_until: dict[str, float] = {}  # "host:port" -> monotonic time to try it again
        self._refresh_due = False  # a shard failed since the slot map was last asked for
        self._refreshed_at = 0.0  # monotonic time the slot map was last asked for
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="remote")
        self.errors = 0  # shard failures (each leaves that shard's keys missed)

    def _connect(self) -> RedisCluster | redis.Redis | None:
        with self._lock:
            if self._client is not None or time.monotonic() < self._client_retry_at:
                return self._client
            try:
                if self.cfg.cluster:
                    # Retries of the cluster client's own commands (each node's connections keep none): its
                    # constructor sends COMMAND to one primary, and with a primary down and no retry to
                    # move on to another, a daemon could not connect at all while a shard was down.
                    kwargs = {**self._kwargs, "retry": Retry(NoBackoff(), max(2, len(self._seeds)))}
                    self._client = RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in self._seeds],
                                                require_full_coverage=False, **kwargs)
                else:
                    host, port = self._seeds[0]
                    self._client = redis.Redis(host=host, port=port, **self._kwargs)
                logger.info("remote tier connected: nodes=%d", len(self._seeds))
            except (redis.RedisError, redis.exceptions.RedisClusterException, OSError) as e:
                self.errors += 1
                self._client_retry_at = time.monotonic() + self.cfg.retry_after_s
                logger.warning("remote tier unreachable (retry in %.1f s): %s", self.cfg.retry_after_s, e)
            return self._client

    def _by_shard(self, client: RedisCluster | redis.Redis, keys: Sequence[bytes]) -> dict[str, tuple[Any, list[int]]]:
        """Shard name -> (its client, indices of its keys); keys of a shard known to be down are left out."""
        now = time.monotonic()
        if isinstance(client, redis.Redis):
            return {} if self._down_until.get("node", 0.0) > now else {"node": (client, list(range(len(keys))))}
        shards: dict[str, tuple[Any, list[int]]] = {}
        for i, key in enumerate(keys):
            try:
                node = client.nodes_manager.get_node_from_slot(client.keyslot(key))
            except Exception:  # noqa: BLE001 - a slot no node covers (a shard lost for good): a miss
                continue
            name = node.name
            if self._down_until.get(name, 0.0) > now:
                continue
            if name not in shards:
                shards[name] = (client.get_redis_connection(node), [])
            shards[name][1].append(i)
        return shards

    @overload
    def run(self, op: Op, keys: Sequence[bytes], args: None = None,
            then: Callable[[int, Any], Any] | None = None) -> list[Any]: ...

    @overload
    def run(self, op: ArgOp, keys: Sequence[bytes], args: Sequence[Any],
            then: Callable[[int, Any], Any] | None = None) -> list[Any]: ...

    def run(self, op: Callable[..., None], keys: Sequence[bytes], args: Sequence[Any] | None = None,
            then: Callable[[int, Any], Any] | None = None) -> list[Any]:
        """op(pipeline, key[, arg]) for each key; each result, or FAILED where its shard failed.
        `then(i, reply)`, when given, turns the reply to keys[i] into the result on the shard's own
        thread, as soon as that shard answered: work on one shard's replies (hashing releases the
        GIL) overlaps with the other shards' transfers."""
        results: list[Any] = [FAILED] * len(keys)
        client = self._connect()
        if client is None or not keys:
            return results
        self._refresh_slots(client)
        shards = self._by_shard(client, keys)

        def one(name: str, conn: Any, indices: list[int]) -> None:
            try:
                pipe = conn.pipeline(transaction=False)
                for i in indices:
                    op(pipe, keys[i]) if args is None else op(pipe, keys[i], args[i])
                replies = pipe.execute(raise_on_error=False)
            except Exception as e:  # noqa: BLE001 - whatever a shard does, its keys are misses, never an error
                self._shard_failed(name, e)
                return
            for i, reply in zip(indices, replies):
                if isinstance(reply, AskError):  # MovedError is one too
                    reply = self._redirected(client, op, keys[i], None if args is None else args[i])
                if isinstance(reply, Exception) or reply is FAILED:
                    continue
                try:
                    results[i] = reply if then is None else then(i, reply)
                except Exception:  # noqa: BLE001 - a reply we cannot use is a miss
                    logger.exception("remote tier: reply for key %r unusable", keys[i])

        if len(shards) == 1:
            name, (conn, indices) = next(iter(shards.items()))
            one(name, conn, indices)
        else:
            for future in [self._pool.submit(one, name, conn, idx) for name, (conn, idx) in shards.items()]:
                future.result()
        return results

    def _redirected(self, client: Any, op: Callable[..., None], key: bytes, arg: Any) -> Any:
        """One command through the cluster client, which follows MOVED/ASK and updates its slot map."""
        try:
            pipe = client.pipeline()
            op(pipe, key) if arg is None else op(pipe, key, arg)
            return pipe.execute(raise_on_error=False)[0]
        except Exception as e:  # noqa: BLE001 - a miss, like any failure of the cluster
            with self._lock:
                self.errors += 1
            logger.debug("remote tier: redirected command failed: %s", e)
            return FAILED

    def _refresh_slots(self, client: RedisCluster | redis.Redis) -> None:
        """After a shard failed, and every REFRESH_WHILE_DOWN_S while one is left alone, ask the
        cluster for its slot map again: a replica may have taken over the failed primary's slots,
        which our per-shard pipelines, unlike redis-py's own commands, would not learn from a MOVED
        reply. The promoted replica is another node, not left alone: its keys are hits again within
        REFRESH_WHILE_DOWN_S of the failover, not retry_after_s after the primary's last failure."""
        now = time.monotonic()
        with self._lock:
            down = any(until > now for until in self._down_until.values())
            due = self._refresh_due or (down and now - self._refreshed_at >= REFRESH_WHILE_DOWN_S)
            self._refresh_due = False
            if due:
                self._refreshed_at = now
        if due and isinstance(client, RedisCluster):
            try:
                client.nodes_manager.initialize()
            except Exception as e:  # noqa: BLE001 - the old map stays; the next failure asks again
                logger.debug("remote tier: slot map refresh failed: %s", e)

    def _shard_failed(self, name: str, error: BaseException) -> None:
        with self._lock:
            self._refresh_due = True
            self.errors += 1
            first = self._down_until.get(name, 0.0) <= time.monotonic()
            self._down_until[name] = time.monotonic() + self.cfg.retry_after_s
        if first:
            logger.warning("remote shard %s failed (its keys are misses for %.1f s): %s", name,
                           self.cfg.retry_after_s, error)

    def primaries(self) -> list[Any]:
        """A client per primary node (for SCAN); empty when the cluster is unreachable."""
        client = self._connect()
        if client is None:
            return []
        if isinstance(client, redis.Redis):
            return [client]
        return [client.get_redis_connection(n) for n in client.get_primaries()]

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None
