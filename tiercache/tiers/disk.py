"""The disk tier: codec records in one LMDB environment, written in batches by one writer thread."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import lmdb

from tiercache import codec
from tiercache.block import Block, BlockMeta, TierStats
from tiercache.config import DiskConfig, MiB
from tiercache.errors import CapacityExceeded, CorruptBlock, InvalidArgument, NotFound
from tiercache.tiers.base import Attrs, DurableTier
from tiercache.tiers.disk_damage import move_aside
from tiercache.tiers.disk_env import NOT_DAMAGE, RESERVE_NAME, DiskEntry, json_attrs, open_env, stored_bytes, take_lock
from tiercache.tiers.disk_upgrade import upgrade_legacy
from tiercache.tiers.disk_writer import BATCH_BYTES, DiskWriter, Reserve

logger = logging.getLogger(__name__)

__all__ = ["BACKLOG_WAIT_S", "BATCH_BYTES", "DISK_FULL_RETRY_S", "MAX_PENDING_BYTES", "DiskTier"]

MAX_PENDING_BYTES = 256 * MiB
BACKLOG_WAIT_S = 10.0
DISK_FULL_RETRY_S = 5.0  # after a failed write, puts are refused this long unless space is freed first


def reserve_bytes(path: Path, max_block_bytes: int) -> int:
    """The reserve's size: room for the deletes of two of the largest blocks and their free-list records,
    at most 1/16 of the filesystem (a small test filesystem must keep room for blocks)."""
    vfs = os.statvfs(path)
    return min(2 * max_block_bytes + MiB, vfs.f_blocks * vfs.f_frsize // 16)


class DiskTier(DiskWriter, DurableTier):
    """Blocks as codec records in LMDB: sub-databases b"blocks" (key -> record) and b"meta"
    (key -> JSON {meta, attrs, last_access, format, stored_bytes}), plus an in-memory index in LRU
    order, loaded at open from the meta db alone (disk_env.read_metadata: no payload page is read).

    All writes go through one writer thread (DiskWriter); put/remove/evict/set_attrs only queue work
    and take effect in memory at once. The process holds an exclusive flock on path/LOCK and keeps a
    ballast file path/RESERVE (Reserve) so that deletes can commit on a full filesystem. An LMDB
    environment must never be used across fork: every method checks os.getpid() and raises
    Unavailable in a forked child.
    `write_failures` counts blocks dropped because their write failed (TierStats has no field for it).
    Invariants: used_bytes == sum of entry sizes <= capacity_bytes; after the queue drains, the
    index, the meta db and the blocks db hold the same keys and each entry's size is the map bytes its
    record takes (disk_env.stored_bytes), as its meta record says (unless a rewrite of it is queued).
    A queued block's payload tensor is kept, not copied, until it commits: callers must not modify it.
    """

    name = "disk"
    verifies_reads = True  # every record's checksum, on every read

    def __init__(self, path: str | Path, cfg: DiskConfig, *, max_block_bytes: int) -> None:
        self.path = Path(path)
        self.cfg = cfg
        self.capacity_bytes = cfg.capacity_bytes
        self.max_block_bytes = max_block_bytes
        self._pid = os.getpid()
        self._mu = threading.RLock()
        self._cond = threading.Condition(self._mu)
        self._commit_lock = threading.Lock()
        self._queue = deque()
        self._seq = self._done_seq = 0
        self._pending_bytes = 0
        self._undeleted = set()
        self._dirty_meta = set()
        self._disk_full = ""
        self._disk_full_at = 0.0
        self._damaged = ""
        self._closing = self._closed = False
        self.write_failures = 0
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock_fd = take_lock(self.path)
        self._reserve = Reserve(self.path / RESERVE_NAME, reserve_bytes(self.path, max_block_bytes))
        if self._reserve.free_bytes() < MiB:
            self._reserve.release()  # LMDB writes its lock file through a map: no free byte would be a SIGBUS
        try:
            try:
                self._env, self._blocks, self._meta, loaded = open_env(self.path, cfg)
            except lmdb.Error as e:
                if isinstance(e, NOT_DAMAGE):
                    raise
                move_aside(self.path, e)
                self._env, self._blocks, self._meta, loaded = open_env(self.path, cfg)
            upgrade_legacy(self.path, self._env, self._blocks, self._meta, loaded, cfg, max_block_bytes)
        except BaseException:
            os.close(self._lock_fd)  # closing the descriptor releases the flock
            raise
        self._index, self._used, self._last_stamp = loaded.index, loaded.used_bytes, loaded.last_stamp
        self._page_bytes = loaded.page_bytes  # what stored_bytes counts in
        self._reserve.fill()
        if self._reserve.size < self._reserve.target_bytes:
            logger.warning("disk tier %s: only bytes=%d of the reserve's %d are free on its filesystem",
                           self.path, self._reserve.size, self._reserve.target_bytes)
        self._stats = TierStats(name=self.name, capacity_bytes=self.capacity_bytes,
                                evictions=loaded.num_evicted, verification_failures=loaded.num_bad_meta)
        with self._cond:
            for key in sorted(loaded.bad_keys):
                self._enqueue("del", key, None)
            # Meta records without stored_bytes (an older version's), so that the next start reads
            # none of their records; disk_upgrade wrote those it rewrote.
            for key in sorted(loaded.unsized_keys - loaded.upgraded):
                if key in self._index:
                    self._enqueue("attrs", key, self._index[key])
        self._snapshot = threading.local()  # see snapshot_reads
        self._encoder = ThreadPoolExecutor(1, thread_name_prefix=f"tiercache-disk-encoder:{self.path}")
        self._record_bufs = (codec.RecordBuffer(), codec.RecordBuffer())
        self._thread = threading.Thread(target=self._writer, name=f"tiercache-disk-writer:{self.path}", daemon=True)
        self._thread.start()

    def _stamp(self) -> float:
        """Unix time, strictly increasing, so the LRU order survives a restart exactly."""
        self._last_stamp = max(time.time(), self._last_stamp + 1e-6)
        return self._last_stamp

    def contains(self, key: bytes) -> bool:
        self._check_open()
        with self._mu:
            return key in self._index

    def get(self, key: bytes) -> Block:
        self._check_open()
        with self._mu:  # held across the read so no delete of this key can commit meanwhile
            entry = self._index.get(key)
            if entry is None:
                self._stats.misses += 1
                raise NotFound(f"block {key.hex()} is not in the disk tier")
            if entry.pending is not None:
                block = Block(entry.meta, entry.pending.payload.clone())
            else:
                block = self._read(key, entry)
            self._stats.hits += 1
            self._touch(key, entry)
            return block

    @contextlib.contextmanager
    def snapshot_reads(self) -> Iterator[None]:
        """Within the block, get() in this thread reads through one LMDB read transaction and returns
        committed blocks as read-only views into LMDB's map, not copies: valid only until the block
        exits, so the caller copies what it keeps (a promotion into the host tier does anyway). A
        chain promoted from disk saves a transaction and a copy per block."""
        self._check_open()
        if getattr(self._snapshot, "txn", None) is not None:  # nested: the outer one serves
            yield
            return
        env = self._env
        try:
            txn = env.begin(db=self._blocks, buffers=True)
        except lmdb.Error as e:  # every read below then takes its own path and error
            logger.debug("disk tier %s: no snapshot for a batch of reads: %s", self.path, e)
            yield
            return
        self._snapshot.txn, self._snapshot.env = txn, env
        try:
            yield
        finally:
            self._snapshot.txn = self._snapshot.env = None
            txn.abort()

    def _snapshot_read(self, key: bytes, entry: DiskEntry) -> Block | None:
        """The block through snapshot_reads' transaction, as a view; None outside one, or when the
        snapshot does not hold this entry's record intact: committed after it began, or deleted and
        put again (another meta) meanwhile. The caller then reads afresh, and only that read may
        find the block damaged and drop it."""
        txn = getattr(self._snapshot, "txn", None)
        if txn is None or self._snapshot.env is not self._env:  # none, or the env was replaced
            return None
        record = txn.get(key)
        if record is None:
            return None
        try:
            return codec.decode_block(record, max_payload_bytes=self.max_block_bytes, expected_key=key,
                                      expected_meta=entry.meta, copy=False)
        except CorruptBlock:
            return None

    def _read(self, key: bytes, entry: DiskEntry, drop: bool = True) -> Block:
        """The committed block, verified. A failure (with drop) forgets it, queues its delete and
        counts it before CorruptBlock propagates."""
        try:
            try:
                block = self._snapshot_read(key, entry)
                if block is not None:
                    return block
                with self._env.begin(db=self._blocks, buffers=True) as txn:
                    record = txn.get(key)
                    if record is None:
                        raise CorruptBlock(f"block {key.hex()} is indexed but missing from the blocks db")
                    # The index knows the meta: an intact uncompressed record is checked against it
                    # byte for byte instead of being parsed.
                    return codec.decode_block(record, max_payload_bytes=self.max_block_bytes, expected_key=key,
                                              expected_meta=entry.meta)
            except NOT_DAMAGE as e:  # short of reader slots and the like: a miss, the block stays
                raise NotFound(f"block {key.hex()}: LMDB could not read it now: {e}") from e
            except lmdb.Error as e:  # a damaged page on the way to the record
                raise CorruptBlock(f"block {key.hex()}: LMDB read failed: {e}") from e
        except CorruptBlock as e:
            if drop:
                logger.warning("disk tier %s: dropped block %s that failed verification: %s", self.path, key.hex(), e)
                self._stats.verification_failures += 1
                self._forget(key, entry)
                self._enqueue("del", key, None)
            raise

    def check(self, key: bytes) -> int:
        """DurableTier.check. The read holds no lock (the background scrub must not stall reads and
        writes for a disk read), so a block deleted or rewritten meanwhile may look damaged: a
        caller drops only after reading it again through get()."""
        self._check_open()
        with self._mu:
            entry = self._index.get(key)
        if entry is None or entry.pending is not None:
            return 0
        try:
            with self._env.begin(db=self._blocks, buffers=True) as txn:
                record = txn.get(key)
                if record is None:
                    raise CorruptBlock(f"block {key.hex()} is indexed but missing from the blocks db")
                codec.decode_block(record, max_payload_bytes=self.max_block_bytes, expected_key=key,
                                   expected_meta=entry.meta, copy=False)
                return len(record)
        except NOT_DAMAGE as e:  # short of reader slots and the like: not checked this time
            logger.debug("disk tier %s: block %s not checked now: %s", self.path, key.hex(), e)
            return 0
        except lmdb.Error as e:  # a damaged page on the way to the record
            raise CorruptBlock(f"block {key.hex()}: LMDB read failed: {e}") from e

    def put(self, block: Block, attrs: Attrs | None = None, release: Callable[[], None] | None = None) -> bool:
        """DurableTier.put; `attrs` are the store's initial attributes (JSON-able), kept in the meta
        record. `release` is called at once when the block is not queued (present, or refused)."""
        try:
            queued = self._queue_put(block, attrs, release)
        except BaseException:
            if release is not None:
                release()
            raise
        if not queued and release is not None:
            release()
        return queued

    def put_many(self, items: Sequence[tuple[Block, Attrs | None, Callable[[], None] | None]]) -> list[bool]:
        """DurableTier.put_many."""
        results: list[bool] = []
        with self._cond:  # one hold: the writer takes the whole batch, not a block at a time
            for n, (block, attrs, release) in enumerate(items):
                try:
                    results.append(self.put(block, attrs, release))
                except BaseException:
                    for _, _, rest in items[n + 1 :]:
                        if rest is not None:
                            rest()
                    raise
        return results

    def _queue_put(self, block: Block, attrs: Attrs | None, release: Callable[[], None] | None) -> bool:
        self._check_open()
        codec.check_block(block)
        meta = block.meta
        if meta.nbytes > self.max_block_bytes:
            raise InvalidArgument(f"block of {meta.nbytes} bytes exceeds max_block_bytes={self.max_block_bytes}")
        attrs = json_attrs(attrs)
        cost = self.cost_bytes(meta)
        deadline = time.monotonic() + BACKLOG_WAIT_S
        with self._cond:
            while True:
                self._check_open()
                if meta.key in self._index:
                    return False
                if self._damaged:
                    raise CapacityExceeded(f"disk tier {self.path} is damaged ({self._damaged}); disk writes "
                                           "are refused until a restart moves it aside")
                if self._disk_full and time.monotonic() - self._disk_full_at < DISK_FULL_RETRY_S:
                    raise CapacityExceeded(f"disk tier {self.path}: the disk is full ({self._disk_full}); "
                                           "remove or evict blocks")
                if self._used + cost > self.capacity_bytes:
                    raise CapacityExceeded(f"disk tier full: used_bytes={self._used} + bytes={cost} > "
                                           f"capacity_bytes={self.capacity_bytes}")
                if not self._pending_bytes or self._pending_bytes + cost <= MAX_PENDING_BYTES:
                    break
                if not self._cond.wait(deadline - time.monotonic()) and time.monotonic() >= deadline:
                    raise CapacityExceeded(f"disk writer backlog: bytes={self._pending_bytes} still queued "
                                           f"after {BACKLOG_WAIT_S} s")
            entry = DiskEntry(meta, attrs, cost, self._stamp(), pending=block, release=release)
            self._index[meta.key] = entry
            self._used += cost
            self._pending_bytes += cost
            self._stats.puts += 1
            self._enqueue("put", meta.key, entry)
        return True

    def _delete(self, key: bytes, counter: str) -> bool:
        self._check_open()
        with self._mu:
            entry = self._index.get(key)
            if entry is None:
                return False
            self._forget(key, entry)
            self._disk_full = ""  # freed space: let the next put try again
            setattr(self._stats, counter, getattr(self._stats, counter) + 1)
            self._enqueue("del", key, None)
            return True

    def remove(self, key: bytes) -> bool:
        return self._delete(key, "removals")

    def evict(self, key: bytes) -> bool:
        return self._delete(key, "evictions")

    def touch(self, key: bytes) -> None:
        self._check_open()
        with self._mu:
            entry = self._index.get(key)
            if entry is not None:
                self._touch(key, entry)

    def touch_many(self, keys: Sequence[bytes]) -> None:
        self._check_open()  # once, not per key: a Fetch touches every block of its chain
        with self._mu:
            for key in keys:
                entry = self._index.get(key)
                if entry is not None:
                    self._touch(key, entry)

    def _touch(self, key: bytes, entry: DiskEntry) -> None:
        self._index.move_to_end(key)
        entry.last_access = self._stamp()
        self._dirty_meta.add(key)  # persisted lazily by the writer, so reads never write

    def lru_keys(self) -> Iterator[bytes]:
        self._check_open()
        with self._mu:
            return iter(list(self._index))

    def metas(self) -> Iterator[BlockMeta]:
        self._check_open()
        with self._mu:
            return iter([e.meta for e in self._index.values()])

    def records(self) -> Iterator[tuple[BlockMeta, dict[str, float]]]:
        """Every committed or queued block with a copy of its attrs (a snapshot)."""
        self._check_open()
        with self._mu:
            return iter([(e.meta, dict(e.attrs)) for e in self._index.values()])

    def set_attrs(self, key: bytes, attrs: Attrs) -> None:
        """Merge `attrs` into the block's stored attributes (NotFound if absent); durable after flush()."""
        self._check_open()
        attrs = json_attrs(attrs)
        with self._mu:
            entry = self._index.get(key)
            if entry is None:
                raise NotFound(f"block {key.hex()} is not in the disk tier")
            entry.attrs = {**entry.attrs, **attrs}
            self._enqueue("attrs", key, entry)

    def cost_bytes(self, meta: BlockMeta) -> int:
        return stored_bytes(codec.record_size(meta), self._page_bytes)

    @property
    def used_bytes(self) -> int:
        return self._used

    def stats(self) -> TierStats:
        with self._mu:
            return replace(self._stats, used_bytes=self._used, num_blocks=len(self._index))

    def verify(self, drop: bool = True) -> tuple[int, list[bytes]]:
        """Re-read and check every committed block, and the map bytes its record takes against its
        entry; returns (checked, bad keys). With drop, damaged blocks are dropped and counted as
        verification failures (a size that disagrees is logged and returned, the block kept)."""
        self._check_open()
        with self._mu:
            keys = [k for k, e in self._index.items() if e.pending is None]
        checked, bad = 0, []
        for key in keys:
            with self._mu:  # one block at a time, so puts and gets interleave with a long verify
                entry = self._index.get(key)
                if entry is None or entry.pending is not None:
                    continue
                checked += 1
                try:
                    self._read(key, entry, drop)
                except CorruptBlock:
                    bad.append(key)
                    continue
                with self._env.begin(db=self._blocks, buffers=True) as txn:
                    record = txn.get(key)
                    size = stored_bytes(len(record), self._page_bytes) if record is not None else None
                if size != entry.size:  # intact, but the accounting disagrees: a bug, said, not dropped
                    logger.error("disk tier %s: block %s takes %s map bytes, its entry says %d", self.path,
                                 key.hex(), size, entry.size)
                    bad.append(key)
        return checked, bad

    def check_integrity(self) -> None:
        self._check_open()
        # Metadata only: the meta db and the blocks db's entry count, never a block record (a NAS's
        # tier of hundreds of GB would be read whole at every idle check). Each record's length
        # against its entry is checked where records are read anyway: verify().
        with self._commit_lock, self._mu:  # the writer is between batches: the dbs match the applied ops
            with self._env.begin(buffers=True) as txn:
                num_records = txn.stat(self._blocks)["entries"]
                meta_sizes = {bytes(k): _stored_bytes(v) for k, v in txn.cursor(db=self._meta)}
            deleting = {op.key for op in self._queue if op.kind == "del"} | self._undeleted
            rewriting = {op.key for op in self._queue if op.kind == "attrs"} | self._dirty_meta
            committed = {k: e.size for k, e in self._index.items() if e.pending is None}
            assert abs(num_records - len(meta_sizes)) <= len(deleting), \
                f"blocks db holds {num_records} records, meta db {len(meta_sizes)}"
            for key, size in committed.items():
                assert key in meta_sizes, f"block {key.hex()} is indexed but has no meta record"
                assert meta_sizes[key] == size or key in rewriting, \
                    f"block {key.hex()}: its meta record says stored_bytes={meta_sizes[key]}, not {size}"
            assert set(meta_sizes) - set(committed) <= deleting, "the meta db holds blocks the index lacks"
            assert self._used == sum(e.size for e in self._index.values()), "used_bytes != sum of sizes"
            pending = sum(e.size for e in self._index.values() if e.pending is not None)
            assert self._pending_bytes == pending, f"pending bytes {self._pending_bytes} != {pending}"
            assert self._used <= self.capacity_bytes, f"used_bytes={self._used} > capacity={self.capacity_bytes}"


def _stored_bytes(meta_record: memoryview) -> object:
    """A meta record's stored_bytes (None without one, or when the record is not a JSON object)."""
    try:
        return json.loads(bytes(meta_record)).get("stored_bytes")
    except (ValueError, AttributeError):
        return None
