"""The remote tier: blocks on a Redis/Valkey Cluster that daemons on several machines share, signed (AES-GMAC)."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator, Sequence
from typing import Any
from urllib.parse import quote

from tiercache.block import Block, BlockMeta, TierStats
from tiercache.codec import decode_block, encode_block, record_size
from tiercache.config import RemoteConfig
from tiercache.errors import CorruptBlock, InvalidArgument, NotFound
from tiercache.tiers.base import Tier
from tiercache.tiers.remote_census import Census, RemoteCensus
from tiercache.tiers.remote_link import FAILED, ClusterLink, read_secrets
from tiercache.tiers.remote_signing import MAC_BYTES, MAGIC, Signer, Unverified

logger = logging.getLogger(__name__)

_STOP = object()


def _get(pipe: Any, key: bytes) -> None:
    pipe.get(key)


def _exists(pipe: Any, key: bytes) -> None:
    pipe.exists(key)


def _delete(pipe: Any, key: bytes) -> None:
    pipe.delete(key)


class RemoteTier(Tier):
    """Blocks in a cluster shared with other daemons, one key per block:
    `<key_prefix>:<tenant>:<store key hex>` (the tenant percent-encoded, see tenant_prefix).

    The store key is already a hash of the tenant, the namespace (model, weights, salt) and the
    tokens, so equal prefixes meet on one key and nothing else does; the tenant is spelled out as
    well so that a cluster ACL (`~<key_prefix>:<tenant>:*`) can confine a daemon to some tenants.
    There are no hash tags, so a chain spreads over the shards. A block's tenant is its
    meta.tenant. The value is the block's record (codec.py) signed (Signer) with the first of the
    cluster's secrets (remote.secret_file, then remote.verify_secret_files): a value that fails its
    MAC (written without a listed secret, or moved), its checksum (damaged) or names another tenant
    than its key is a miss, counted in verification_failures, never served.

    Unlike the local tiers this one is thread-safe and is called outside the store's lock (it
    waits on the network), and the store's index never lists it: other daemons add and the cluster
    evicts blocks without telling us, so presence is asked (present_prefix) and a block read is
    promoted into host. Writes are queued (put) and sent by a writer thread in batches; a full
    queue drops the block, counted. Every failure of a shard is a miss within remote.timeout_ms.
    lru_keys and metas are empty: the cluster keeps its own LRU (allkeys-lru).
    """

    def __init__(self, cfg: RemoteConfig, *, max_block_bytes: int) -> None:
        self.name = "remote"
        self.capacity_bytes = 0  # the cluster's maxmemory, unknown here
        self.cfg = cfg
        self.signer = Signer(read_secrets(cfg))
        logger.info("remote tier: signs with key id %s; verifies key ids %s", self.signer.key_ids[0],
                    " ".join(self.signer.key_ids))
        self._max_block_bytes = max_block_bytes
        self.link = ClusterLink(cfg)
        self._prefix = cfg.key_prefix.encode() + b":"
        self._stats_lock = threading.Lock()
        self.counters = {"hits": 0, "misses": 0, "puts": 0, "removals": 0, "evictions": 0, "verification_failures": 0,
                         "bytes_read": 0, "bytes_written": 0, "write_errors": 0, "writes_dropped": 0,
                         "legacy_reads": 0}  # TCR1 values read and verified (Signer): the transition's progress
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=cfg.queue_blocks)
        self._idle = threading.Condition()
        self._pending = 0  # queued or being sent
        self._closed = False
        self._writer = threading.Thread(target=self._write_loop, name="remote-writer", daemon=True)
        self._writer.start()

    def tenant_prefix(self, tenant: str) -> bytes:
        """`<key_prefix>:<tenant>:`, the tenant percent-encoded (letters, digits and `_.-~` as they
        are), so that no tenant name can reach into another's keys or be a glob pattern."""
        return self._prefix + quote(tenant, safe="").encode() + b":"

    def redis_key(self, key: bytes, tenant: str = "") -> bytes:
        """The cluster key of a store key of `tenant` ("" is BlockMeta.tenant's default)."""
        return self.tenant_prefix(tenant) + key.hex().encode()

    def _redis_keys(self, keys: Sequence[bytes], tenant: str) -> list[bytes]:
        prefix = self.tenant_prefix(tenant)
        return [prefix + key.hex().encode() for key in keys]

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for name, delta in deltas.items():
                self.counters[name] += delta

    def mac(self, rkey: bytes, record: bytes | memoryview) -> bytes:
        """The signature of a record under its Redis key (the value is MAGIC + signature + record)."""
        return self.signer.sign(rkey, record)

    # ---- batches (what the store calls) ----------------------------------------------------------

    def present(self, keys: Sequence[bytes], tenant: str = "") -> list[bool]:
        """Whether the cluster holds each of `tenant`'s `keys` now: one round trip over all shards.
        A key on a shard that failed is absent."""
        return [reply is not FAILED and bool(reply) for reply in self.link.run(_exists, self._redis_keys(keys, tenant))]

    def present_prefix(self, keys: Sequence[bytes], tenant: str = "") -> int:
        """How many of `tenant`'s `keys`, in a row from the first, the cluster holds now (see present)."""
        return next((i for i, held in enumerate(self.present(keys, tenant)) if not held), len(keys))

    def get_many(self, keys: Sequence[bytes], tenant: str = "") -> list[Block]:
        """The verified blocks of the longest prefix of `tenant`'s `keys` the cluster serves, read in
        one round trip. The first key absent, on a failed shard, forged or damaged ends it (one miss,
        counted; a forged or damaged value in verification_failures too); nothing after it is served
        or counted."""
        rkeys = self._redis_keys(keys, tenant)

        def check(i: int, value: bytes | None) -> tuple[Block | None, int] | None:
            return None if value is None else (self._verified(keys[i], rkeys[i], value, tenant), len(value))

        out: list[Block] = []
        failures = nbytes = 0
        for reply in self.link.run(_get, rkeys, then=check):
            if reply is FAILED or reply is None:
                break
            block, size = reply
            nbytes += size
            if block is None:
                failures += 1
                break
            out.append(block)
        self._count(hits=len(out), misses=int(len(out) < len(keys)), verification_failures=failures,
                    bytes_read=nbytes)
        return out

    def _verified(self, key: bytes, rkey: bytes, value: bytes, tenant: str) -> Block | None:
        try:
            record, legacy = self.signer.record(rkey, value)
        except Unverified as e:
            logger.warning("remote block %s: %s; treated as a miss", key.hex()[:16], e)
            return None
        try:
            # No copy: the payload is a read-only view of `value`, which the store copies into host.
            block = decode_block(record, max_payload_bytes=self._max_block_bytes, expected_key=key, copy=False)
        except CorruptBlock as e:
            logger.warning("remote block %s is damaged (%s); treated as a miss", key.hex()[:16], e)
            return None
        if block.meta.tenant != tenant:  # signed by a holder of the secret, under another tenant's name
            logger.warning("remote block %s names tenant %r under tenant %r's key; treated as a miss",
                           key.hex()[:16], block.meta.tenant, tenant)
            return None
        if legacy:
            self._count(legacy_reads=1)
        return block

    def put_many(self, blocks: Sequence[Block]) -> int:
        """Queue the blocks for the writer thread (their records are made now: the caller's payload
        may be reused once this returns); a block that finds the queue full is dropped, counted.
        Returns how many were queued."""
        queued = 0
        for block in blocks:
            if self._closed:
                break
            if self._queue.full():  # checked first: no record made for nothing
                self._count(writes_dropped=1)
                continue
            try:
                record = encode_block(block)
            except InvalidArgument as e:  # a block the local tiers took but a record cannot carry
                logger.warning("remote write skipped: %s", str(e))
                self._count(write_errors=1)
                continue
            with self._idle:
                self._pending += 1
            try:
                self._queue.put_nowait((self.redis_key(block.meta.key, block.meta.tenant), record))
                queued += 1
            except queue.Full:
                self._done(1)
                self._count(writes_dropped=1)
        return queued

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            batch = [item]
            while len(batch) < self.cfg.batch_blocks:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is _STOP:
                    self._queue.put(_STOP)  # seen again after this batch
                    break
                batch.append(more)
            try:
                self._send(batch)
            except Exception:  # noqa: BLE001 - a failed batch is lost blocks, never a dead writer
                logger.exception("remote writer: batch of %d blocks failed", len(batch))
                self._count(write_errors=len(batch))
            finally:
                self._done(len(batch))

    def _send(self, batch: list[tuple[bytes, bytes]]) -> None:
        rkeys = [rkey for rkey, _ in batch]
        values = [MAGIC + self.mac(rkey, record) + record for rkey, (_, record) in zip(rkeys, batch)]
        ttl_ms = int(self.cfg.ttl_s * 1000)

        def set_value(pipe: Any, rkey: bytes, value: bytes) -> None:
            pipe.set(rkey, value, px=ttl_ms or None)

        replies = self.link.run(set_value, rkeys, values)
        ok = [reply is not FAILED for reply in replies]
        self._count(puts=sum(ok), write_errors=len(ok) - sum(ok),
                    bytes_written=sum(len(v) for v, good in zip(values, ok) if good))

    def _done(self, count: int) -> None:
        with self._idle:
            self._pending -= count
            if not self._pending:
                self._idle.notify_all()

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued write was sent (or failed); False if timeout_s passed first."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._pending, timeout_s)

    def clear(self, tenant: str | None = None) -> int:
        """Delete every key of `tenant` (None: of every tenant) under this daemon's key_prefix on
        every primary; returns how many."""
        pattern = (self._prefix if tenant is None else self.tenant_prefix(tenant)) + b"*"
        removed = 0
        for conn in self.link.primaries():
            try:
                found = list(conn.scan_iter(match=pattern, count=1000))
                for start in range(0, len(found), 1000):
                    pipe = conn.pipeline(transaction=False)
                    for key in found[start : start + 1000]:  # one key per command: keys of other slots
                        pipe.unlink(key)
                    removed += sum(pipe.execute())
            except Exception as e:  # noqa: BLE001 - a shard that fails keeps its keys; the rest go
                logger.warning("remote flush: a shard failed: %s", e)
        self._count(removals=removed)
        return removed

    def queue_depth(self) -> int:
        return self._queue.qsize()

    @property
    def errors(self) -> int:
        return self.link.errors

    # ---- the Tier interface -------------------------------------------------------------------

    # The single-key methods name a block of tenant "" (BlockMeta.tenant's default), or of the
    # tenant given: the store never calls them (its index never lists this tier).

    def contains(self, key: bytes, tenant: str = "") -> bool:
        return self.present_prefix([key], tenant) == 1

    def get(self, key: bytes, tenant: str = "") -> Block:
        blocks = self.get_many([key], tenant)
        if not blocks:
            raise NotFound(f"block {key.hex()[:16]} is not in the remote tier")
        return blocks[0]

    def put(self, block: Block) -> bool:
        return self.put_many([block]) == 1

    def remove(self, key: bytes, tenant: str = "") -> bool:
        removed = self.link.run(_delete, [self.redis_key(key, tenant)])[0]
        present = removed is not FAILED and bool(removed)
        self._count(removals=int(present))
        return present

    def evict(self, key: bytes, tenant: str = "") -> bool:
        removed = self.remove(key, tenant)
        self._count(evictions=int(removed), removals=-int(removed))
        return removed

    def touch(self, key: bytes) -> None:
        """No-op: the cluster's LRU sees our reads."""

    def lru_keys(self) -> Iterator[bytes]:
        return iter(())

    def metas(self) -> Iterator[BlockMeta]:
        return iter(())

    def cost_bytes(self, meta: BlockMeta) -> int:
        return len(MAGIC) + MAC_BYTES + record_size(meta)

    @property
    def used_bytes(self) -> int:
        return 0

    def stats(self) -> TierStats:
        with self._stats_lock:
            c = dict(self.counters)
        return TierStats(name=self.name, capacity_bytes=0, hits=c["hits"], misses=c["misses"], puts=c["puts"],
                         evictions=c["evictions"], removals=c["removals"],
                         verification_failures=c["verification_failures"])

    _census: RemoteCensus | None = None

    def census(self) -> Census:
        """The blocks and bytes the cluster holds under key_prefix, estimated (remote_census.py)."""
        if self._census is None:
            self._census = RemoteCensus(self.link, self._prefix)
        return self._census.get()

    def remote_counters(self) -> dict[str, int]:
        """Every counter, plus errors (shard failures) and the writer's queue depth."""
        with self._stats_lock:
            c = dict(self.counters)
        return {**c, "errors": self.errors, "queue_blocks": self.queue_depth()}

    def check_integrity(self) -> None:
        assert self._pending >= 0, f"remote writer pending count {self._pending} < 0"

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.flush(self.cfg.timeout_ms / 1000 * 10 + 1)
        self._queue.put(_STOP)
        self._writer.join(10)
        self.link.close()
        logger.info("remote tier closed: %s", " ".join(f"{k}={v}" for k, v in self.remote_counters().items()))
