"""The disk tier: codec records in one LMDB environment, written in batches by one writer thread."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

import lmdb

from tiercache import codec
from tiercache.config import MiB, DiskConfig
from tiercache.errors import (AlreadyRunning, CapacityExceeded, CorruptBlock, DeadlineExceeded,
                              InvalidArgument, NotFound, Unavailable)
from tiercache.tiers.base import Block, BlockMeta, Tier, TierStats

logger = logging.getLogger(__name__)

LOCK_NAME = "LOCK"
MAX_PENDING_BYTES = 256 * MiB
BACKLOG_WAIT_S = 10.0
BATCH_BYTES = 64 * MiB
DISK_FULL_RETRY_S = 5.0  # after a failed write, puts are refused this long unless space is freed first
# Errors that mean "busy" or "short of resources", not "damaged": never a reason to move files aside.
_NOT_DAMAGE = (lmdb.LockError, lmdb.ReadersFullError, lmdb.TlsFullError, lmdb.MemoryError, lmdb.DiskError,
               lmdb.ReadonlyError, lmdb.InvalidParameterError, lmdb.MapResizedError)


@dataclass(slots=True)
class _Entry:
    meta: BlockMeta
    attrs: dict
    size: int  # record bytes once committed; cost_bytes while the write is queued
    last_access: float  # unix seconds
    pending: Block | None = None  # the block until its write commits


class _Op(NamedTuple):
    seq: int
    kind: str  # "put" | "del" | "attrs"
    key: bytes
    entry: _Entry | None


def _json_attrs(attrs: dict | None) -> dict:
    if attrs is None:
        return {}
    try:
        if not isinstance(attrs, dict):
            raise TypeError(f"expected a dict, got {type(attrs).__name__}")
        return json.loads(json.dumps(attrs))  # a private, JSON-normalised copy
    except (TypeError, ValueError) as e:
        raise InvalidArgument(f"block attrs must be a JSON-able dict: {e}") from None


def _meta_record(entry: _Entry) -> bytes:
    return json.dumps({"meta": entry.meta.to_dict(), "attrs": entry.attrs, "last_access": entry.last_access},
                      separators=(",", ":")).encode()


class DiskTier(Tier):
    """Blocks as codec records in LMDB: sub-databases b"blocks" (key -> record) and b"meta"
    (key -> JSON {meta, attrs, last_access}), plus an in-memory index in LRU order.

    All writes go through one writer thread because an LMDB write transaction belongs to the thread
    that began it; put/remove/evict/set_attrs only queue work and take effect in memory at once.
    The process holds an exclusive flock on path/LOCK. An LMDB environment must never be used across
    fork: every method checks os.getpid() and raises Unavailable in a forked child.
    `write_failures` counts blocks dropped because their write failed (TierStats has no field for it).
    Invariants: used_bytes == sum of entry sizes <= capacity_bytes; after the queue drains, the
    index, the meta db and the blocks db hold the same keys and each entry's size is its record's length.
    A queued block's payload tensor is kept, not copied, until it commits: callers must not modify it.
    """

    name = "disk"

    def __init__(self, path: str | Path, cfg: DiskConfig, *, max_block_bytes: int) -> None:
        self.path = Path(path)
        self.cfg = cfg
        self.capacity_bytes = cfg.capacity_bytes
        self.max_block_bytes = max_block_bytes
        self._pid = os.getpid()
        self._mu = threading.RLock()
        self._cond = threading.Condition(self._mu)
        self._commit_lock = threading.Lock()  # held by the writer from taking a batch to applying it
        self._index: OrderedDict[bytes, _Entry] = OrderedDict()
        self._queue: deque[_Op] = deque()
        self._seq = self._done_seq = 0
        self._used = self._pending_bytes = 0
        self._undeleted: set[bytes] = set()  # deletes whose transaction failed, retried with the next batch
        self._dirty_meta: set[bytes] = set()  # touched since their meta record was written
        self._disk_full = ""  # why the last write failed; puts are refused until a write succeeds
        self._disk_full_at = 0.0
        self._last_stamp = 0.0
        self._closing = self._closed = False
        self.write_failures = 0
        self._stats = TierStats(name=self.name, capacity_bytes=self.capacity_bytes)
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock_fd = self._take_lock()
        try:
            try:
                self._env = self._open_env()
            except lmdb.Error as e:
                if isinstance(e, _NOT_DAMAGE):
                    raise
                self._move_aside(e)
                self._env = self._open_env()
        except BaseException:
            os.close(self._lock_fd)  # closing the descriptor releases the flock
            raise
        self._thread = threading.Thread(target=self._writer, name=f"tiercache-disk-writer:{self.path}", daemon=True)
        self._thread.start()

    # ---- opening -------------------------------------------------------------------------
    def _take_lock(self) -> int:
        fd = os.open(self.path / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise AlreadyRunning(f"disk tier {self.path} is already open elsewhere "
                                 f"(another process holds the lock {self.path / LOCK_NAME})") from None
        return fd

    def _open_env(self) -> lmdb.Environment:
        map_size = self.cfg.map_size_bytes or int(self.cfg.capacity_bytes * 1.5) + 64 * MiB
        env = lmdb.open(str(self.path), map_size=map_size, max_dbs=4, lock=True, subdir=True)
        try:
            self._blocks = env.open_db(b"blocks")
            self._meta = env.open_db(b"meta")
            stale = env.reader_check()
            if stale:
                logger.info("disk tier %s: cleared %d stale reader slots", self.path, stale)
            self._rebuild(env)
        except BaseException:
            env.close()
            raise
        return env

    def _rebuild(self, env: lmdb.Environment) -> None:
        """Load the index from the meta db in last-access order; queue deletes for anything inconsistent."""
        with env.begin(buffers=True) as txn:
            sizes = {bytes(k): len(v) for k, v in txn.cursor(db=self._blocks)}
            raw = {bytes(k): bytes(v) for k, v in txn.cursor(db=self._meta)}
        bad = set(sizes) ^ set(raw)
        loaded: list[_Entry] = []
        for key, value in raw.items():
            if key not in sizes:
                continue
            try:
                rec = json.loads(value)
                entry = _Entry(BlockMeta.from_dict(rec["meta"]), rec["attrs"], sizes[key], float(rec["last_access"]))
                if entry.meta.key != key or not isinstance(entry.attrs, dict):
                    raise ValueError("key or attrs do not match")
            except Exception as e:  # any malformed meta record: drop the block rather than refuse to start
                logger.warning("disk tier %s: dropping block %s with a bad meta record: %s", self.path, key.hex(), e)
                self._stats.verification_failures += 1
                bad.add(key)
                continue
            loaded.append(entry)
        loaded.sort(key=lambda e: (e.last_access, e.meta.key))
        index = OrderedDict((e.meta.key, e) for e in loaded)
        used = sum(e.size for e in loaded)
        while used > self.capacity_bytes:  # the configured capacity shrank since the last run
            key, entry = index.popitem(last=False)
            used -= entry.size
            self._stats.evictions += 1
            bad.add(key)
        self._index, self._used = index, used
        self._last_stamp = max((e.last_access for e in loaded), default=0.0)
        with self._cond:
            for key in sorted(bad):
                self._enqueue("del", key, None)

    def _move_aside(self, err: lmdb.Error) -> None:
        """Move every file but our LOCK (still held, so no other process can slip in) to path.corrupt-<time>."""
        stamp = int(time.time())
        aside, n = Path(f"{self.path}.corrupt-{stamp}"), 0
        while aside.exists():
            n += 1
            aside = Path(f"{self.path}.corrupt-{stamp}-{n}")
        aside.mkdir()
        for child in self.path.iterdir():
            if child.name != LOCK_NAME:
                os.replace(child, aside / child.name)
        logger.warning("disk tier %s is damaged (%s: %s); moved it aside to %s and starting empty",
                       self.path, type(err).__name__, err, aside)
        self._stats = TierStats(name=self.name, capacity_bytes=self.capacity_bytes)

    # ---- the Tier interface ----------------------------------------------------------------
    def _check_open(self) -> None:
        if os.getpid() != self._pid:
            raise Unavailable(f"disk tier {self.path} was opened by pid {self._pid}; an LMDB environment "
                              f"must not be used across fork (this is pid {os.getpid()})")
        if self._closing:
            raise Unavailable(f"disk tier {self.path} is closed")

    def _stamp(self) -> float:
        """Unix time, strictly increasing, so the LRU order survives a restart exactly."""
        self._last_stamp = max(time.time(), self._last_stamp + 1e-6)
        return self._last_stamp

    def _enqueue(self, kind: str, key: bytes, entry: _Entry | None) -> None:
        self._seq += 1
        self._queue.append(_Op(self._seq, kind, key, entry))
        self._cond.notify_all()

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
            self.touch(key)
            return block

    def _read(self, key: bytes, entry: _Entry, drop: bool = True) -> Block:
        """The committed block, verified. A failure (with drop) forgets it, queues its delete and
        counts it before CorruptBlock propagates."""
        try:
            try:
                with self._env.begin(db=self._blocks, buffers=True) as txn:
                    record = txn.get(key)
                    if record is None:
                        raise CorruptBlock(f"block {key.hex()} is indexed but missing from the blocks db")
                    return codec.decode_block(record, max_payload_bytes=self.max_block_bytes, expected_key=key)
            except lmdb.Error as e:  # a damaged page on the way to the record
                raise CorruptBlock(f"block {key.hex()}: LMDB read failed: {e}") from e
        except CorruptBlock as e:
            if drop:
                logger.warning("disk tier %s: dropped block %s that failed verification: %s", self.path, key.hex(), e)
                self._stats.verification_failures += 1
                self._forget(key, entry)
                self._enqueue("del", key, None)
            raise

    def put(self, block: Block, attrs: dict | None = None) -> bool:
        """Tier.put; `attrs` are the store's initial attributes (JSON-able), kept in the meta record."""
        self._check_open()
        codec.check_block(block)
        meta = block.meta
        if meta.nbytes > self.max_block_bytes:
            raise InvalidArgument(f"block of {meta.nbytes} bytes exceeds max_block_bytes={self.max_block_bytes}")
        attrs = _json_attrs(attrs)
        cost = self.cost_bytes(meta)
        deadline = time.monotonic() + BACKLOG_WAIT_S
        with self._cond:
            while True:
                self._check_open()
                if meta.key in self._index:
                    return False
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
            entry = _Entry(meta, attrs, cost, self._stamp(), pending=block)
            self._index[meta.key] = entry
            self._used += cost
            self._pending_bytes += cost
            self._stats.puts += 1
            self._enqueue("put", meta.key, entry)
        return True

    def _forget(self, key: bytes, entry: _Entry) -> None:
        del self._index[key]
        self._used -= entry.size
        if entry.pending is not None:
            self._pending_bytes -= entry.size
            entry.pending = None
        self._dirty_meta.discard(key)

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

    def records(self) -> Iterator[tuple[BlockMeta, dict]]:
        """Every committed or queued block with a copy of its attrs (a snapshot)."""
        self._check_open()
        with self._mu:
            return iter([(e.meta, dict(e.attrs)) for e in self._index.values()])

    def set_attrs(self, key: bytes, attrs: dict) -> None:
        """Merge `attrs` into the block's stored attributes (NotFound if absent); durable after flush()."""
        self._check_open()
        attrs = _json_attrs(attrs)
        with self._mu:
            entry = self._index.get(key)
            if entry is None:
                raise NotFound(f"block {key.hex()} is not in the disk tier")
            entry.attrs = {**entry.attrs, **attrs}
            self._enqueue("attrs", key, entry)

    def cost_bytes(self, meta: BlockMeta) -> int:
        return codec.record_size(meta)

    @property
    def used_bytes(self) -> int:
        return self._used

    def stats(self) -> TierStats:
        with self._mu:
            return replace(self._stats, used_bytes=self._used, num_blocks=len(self._index))

    # ---- the writer thread -------------------------------------------------------------------
    def _writer(self) -> None:
        interval = max(self.cfg.reader_check_interval_s, 0.001)
        next_check = time.monotonic() + interval
        while True:
            with self._cond:
                while not self._queue and not self._closing and time.monotonic() < next_check:
                    self._cond.wait(next_check - time.monotonic())
                stop = self._closing and not self._queue
            if stop or time.monotonic() >= next_check:
                next_check = time.monotonic() + interval
                self._maintain()
            if stop:
                return
            try:
                self._write_batch()
            except Exception:  # a bug must not stop the writer: flush() would wait forever
                logger.exception("disk tier %s: writer batch failed", self.path)

    def _maintain(self) -> None:
        """Clear stale reader slots; persist last-access times and retry failed deletes in one transaction."""
        try:
            self._env.reader_check()
        except lmdb.Error as e:
            logger.warning("disk tier %s: reader_check failed: %s", self.path, e)
        with self._commit_lock:
            with self._mu:
                deletes, self._undeleted = sorted(self._undeleted), set()
                ready = [k for k in self._dirty_meta if self._index[k].pending is None]
                self._dirty_meta.difference_update(ready)  # a queued block's touches wait for its commit
                metas = {k: _meta_record(self._index[k]) for k in ready}
            self._commit_or_keep(deletes, metas)

    def _commit_or_keep(self, deletes: list[bytes], metas: dict[bytes, bytes]) -> None:
        """Commit deletes and meta updates; on failure keep them for the next attempt."""
        try:
            self._commit(deletes, metas, [])
        except Exception as e:
            logger.warning("disk tier %s: deletes=%d meta updates=%d failed, will retry: %s",
                           self.path, len(deletes), len(metas), e)
            with self._mu:
                self._undeleted.update(deletes)
                self._dirty_meta.update(k for k in metas if k in self._index)

    def _write_batch(self) -> None:
        with self._commit_lock:
            with self._mu:
                ops = []
                size = 0
                while self._queue and size < BATCH_BYTES:
                    ops.append(self._queue.popleft())
                    size += ops[-1].entry.size if ops[-1].kind == "put" else 0  # type: ignore[union-attr]
            if ops:
                try:
                    self._write_ops(ops)
                finally:  # whatever happened, these ops are done: flush() must not wait for them forever
                    with self._cond:
                        self._done_seq = max(self._done_seq, max(op.seq for op in ops))
                        self._cond.notify_all()

    def _write_ops(self, ops: list[_Op]) -> None:
        with self._mu:  # snapshot; deletes commit first, which is right for any order of the queue
            deletes, self._undeleted = sorted(self._undeleted), set()
            puts: list[tuple[_Entry, Block, bytes]] = []
            metas: dict[bytes, bytes] = {}
            for op in ops:
                entry = self._index.get(op.key)
                if op.kind == "del":
                    deletes.append(op.key)
                    metas.pop(op.key, None)
                elif entry is None or entry is not op.entry:
                    continue  # removed (and maybe put again) after this op was queued
                elif entry.pending is not None:
                    if op.kind == "put":  # attrs of a queued block travel with its put
                        puts.append((entry, entry.pending, _meta_record(entry)))
                else:
                    metas[op.key] = _meta_record(entry)
        records: list[tuple[_Entry, bytes, bytes]] = []
        for entry, block, meta_rec in puts:  # encoding and zstd run here, off the caller's thread
            try:
                records.append((entry, codec.encode_block(
                    block, compression=self.cfg.compression, level=self.cfg.zstd_level,
                    shuffle=self.cfg.shuffle, min_ratio=self.cfg.min_compress_ratio), meta_rec))
            except Exception as e:
                logger.warning("disk tier %s: cannot encode block %s: %s", self.path, entry.meta.key.hex(), e)
        failed: Exception | None = None
        try:
            self._commit(deletes, metas, records)
        except Exception as e:  # map or disk full (or worse): drop the puts, keep the rest
            failed = e
            self._commit_or_keep(deletes, metas)
        self._apply(puts, records, failed)

    def _commit(self, deletes: list[bytes], metas: dict[bytes, bytes],
                records: list[tuple[_Entry, bytes, bytes]]) -> None:
        if not (deletes or metas or records):
            return
        with self._env.begin(write=True) as txn:
            for key in deletes:
                txn.delete(key, db=self._blocks)
                txn.delete(key, db=self._meta)
            for key, value in metas.items():
                txn.put(key, value, db=self._meta)
            for entry, record, meta_rec in records:
                txn.put(entry.meta.key, record, db=self._blocks)
                txn.put(entry.meta.key, meta_rec, db=self._meta)
        with self._cond:
            self._disk_full = ""

    def _apply(self, puts: list[tuple[_Entry, Block, bytes]],
               records: list[tuple[_Entry, bytes, bytes]], failed: Exception | None) -> None:
        written = {id(entry): len(record) for entry, record, _ in records} if failed is None else {}
        with self._cond:
            lost = 0
            for entry, _, _ in puts:
                key = entry.meta.key
                if self._index.get(key) is not entry or entry.pending is None:
                    continue  # removed while being written; its delete is queued behind
                if id(entry) in written:
                    self._pending_bytes -= entry.size
                    self._used += written[id(entry)] - entry.size
                    entry.size, entry.pending = written[id(entry)], None
                else:
                    self._forget(key, entry)
                    lost += 1
            if failed is not None:
                self._disk_full, self._disk_full_at = f"{type(failed).__name__}: {failed}", time.monotonic()
            if lost:
                self.write_failures += lost
                logger.warning("disk tier %s: dropped blocks=%d that could not be written: %s",
                               self.path, lost, failed or "encoding failed")

    # ---- whole-tier operations -----------------------------------------------------------
    def flush(self, timeout_s: float | None = None) -> None:
        """Block until every write queued before this call has committed (or failed and been dropped).
        Raises DeadlineExceeded after timeout_s seconds."""
        if os.getpid() != self._pid:
            self._check_open()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            target = self._seq
            while self._done_seq < target:
                if not self._thread.is_alive():
                    raise Unavailable(f"disk tier {self.path}: the writer thread has stopped")
                left = 1.0 if deadline is None else deadline - time.monotonic()
                if left <= 0:
                    raise DeadlineExceeded(f"disk tier {self.path}: writes={target - self._done_seq} "
                                           f"still queued after {timeout_s} s")
                self._cond.wait(min(left, 1.0))

    def verify(self, drop: bool = True) -> tuple[int, list[bytes]]:
        """Re-read and check every committed block; returns (checked, bad keys). With drop, bad
        blocks are dropped and counted as verification failures."""
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
        return checked, bad

    def check_integrity(self) -> None:
        self._check_open()
        with self._commit_lock, self._mu:  # the writer is between batches: the dbs match the applied ops
            with self._env.begin(buffers=True) as txn:
                block_sizes = {bytes(k): len(v) for k, v in txn.cursor(db=self._blocks)}
                meta_keys = {bytes(k) for k in txn.cursor(db=self._meta).iternext(values=False)}
            deleting = {op.key for op in self._queue if op.kind == "del"} | self._undeleted
            committed = {k: e.size for k, e in self._index.items() if e.pending is None}
            assert set(block_sizes) ^ meta_keys <= deleting, "blocks and meta dbs disagree on keys"
            for key, size in committed.items():
                assert block_sizes.get(key) == size, f"block {key.hex()} size {block_sizes.get(key)} != {size}"
            assert set(block_sizes) - set(committed) <= deleting, "the blocks db holds blocks the index lacks"
            assert self._used == sum(e.size for e in self._index.values()), "used_bytes != sum of sizes"
            pending = sum(e.size for e in self._index.values() if e.pending is not None)
            assert self._pending_bytes == pending, f"pending bytes {self._pending_bytes} != {pending}"
            assert self._used <= self.capacity_bytes, f"used_bytes={self._used} > capacity={self.capacity_bytes}"

    def close(self) -> None:
        """Commit everything queued, stop the writer, sync and close LMDB, release the lock. Idempotent.

        Safe from any thread, including the one running a SIGTERM shutdown; not from a signal handler
        that interrupted a call on this tier (that call holds the lock the writer needs to drain).
        """
        if os.getpid() != self._pid:
            # A forked child shares the parent's flock: closing our descriptor copy must not unlock it.
            if not self._closed:
                self._closed = self._closing = True
                os.close(self._lock_fd)
            return
        if self._mu._is_owned():  # type: ignore[attr-defined]
            raise RuntimeError("DiskTier.close() re-entered from a signal handler; close from the main loop")
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join()
        with self._mu:
            if self._closed:
                return
            self._closed = True
            try:
                self._env.sync(True)
                self._env.close()
            finally:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
                os.close(self._lock_fd)
