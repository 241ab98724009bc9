"""The disk tier's one writer thread: queued puts, deletes and meta updates committed in batched transactions."""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import lmdb

from tiercache import codec
from tiercache.block import Block, TierStats
from tiercache.config import DiskConfig, MiB
from tiercache.errors import DeadlineExceeded, Unavailable
from tiercache.tiers.disk_damage import mark_damaged
from tiercache.tiers.disk_env import DiskEntry, meta_record, stored_bytes
from tiercache.tiers.disk_reserve import Reserve as Reserve  # re-exported: DiskTier builds it

logger = logging.getLogger(__name__)

BATCH_BYTES = 64 * MiB
# Records below this are encoded on the writer thread itself: handing a small block to the encoder
# thread and waiting for it costs two thread wake-ups, more than copying or compressing it.
INLINE_ENCODE_BYTES = 1 * MiB
# Group commit: writes queued within this long of the first share one transaction (and its fsync,
# which costs more CPU than a small put itself); a flush() does not wait for it.
WRITE_GATHER_S = 0.005
MIN_DELETE_CHUNK = 8  # the smallest delete transaction tried on a full filesystem
# A commit that meets a damaged page: the environment, not the filesystem, is at fault.
DAMAGE = (lmdb.CorruptedError, lmdb.PageNotFoundError)


class Op(NamedTuple):
    """One queued change, applied by the writer in queue order."""

    seq: int
    kind: str  # "put" | "del" | "attrs"
    key: bytes
    entry: DiskEntry | None


class DiskWriter:
    """The writer half of DiskTier: the queue it drains, the transactions it commits, flush and close.

    Every write goes through this one thread because an LMDB write transaction belongs to the thread
    that began it. DiskTier sets every attribute below before starting the thread; `_mu` guards all
    of them, and `_commit_lock` is held from taking a batch to applying its outcome.
    """

    path: Path
    cfg: DiskConfig
    write_failures: int
    _pid: int
    _mu: threading.RLock
    _cond: threading.Condition
    _commit_lock: threading.Lock
    _env: lmdb.Environment
    _blocks: lmdb._Database
    _meta: lmdb._Database
    _lock_fd: int
    _thread: threading.Thread
    _index: OrderedDict[bytes, DiskEntry]
    _queue: deque[Op]
    _seq: int
    _done_seq: int
    _used: int
    _pending_bytes: int
    _undeleted: set[bytes]  # deletes whose transaction failed, retried with the next batch
    _dirty_meta: set[bytes]  # touched since their meta record was written
    _disk_full: str  # why the last write failed; puts are refused until a write succeeds
    _disk_full_at: float
    _damaged: str  # why a commit met a damaged page; disk puts are refused for the rest of this run
    _reserve: Reserve
    _page_bytes: int  # the environment's page size, which stored_bytes counts in
    _closing: bool
    _closed: bool
    _stats: TierStats
    _encoder: ThreadPoolExecutor  # one thread: encodes the next record while LMDB copies this one
    _record_bufs: tuple[codec.RecordBuffer, codec.RecordBuffer]  # its scratch in turn; each grows to fit
    _writer_waiting: bool = False  # the writer sleeps on an empty queue: only then does an enqueue wake it
    _queued_at: float = 0.0  # time.monotonic() when the queue last became non-empty
    _num_flushing: int = 0  # flush() calls waiting: the writer commits without gathering more

    def _check_open(self) -> None:
        if os.getpid() != self._pid:
            raise Unavailable(f"disk tier {self.path} was opened by pid {self._pid}; an LMDB environment "
                              f"must not be used across fork (this is pid {os.getpid()})")
        if self._closing:
            raise Unavailable(f"disk tier {self.path} is closed")

    def _enqueue(self, kind: str, key: bytes, entry: DiskEntry | None) -> None:
        self._seq += 1
        if not self._queue:
            self._queued_at = time.monotonic()
        self._queue.append(Op(self._seq, kind, key, entry))
        if self._writer_waiting:  # a busy or gathering writer takes the queue in time; a wake-up is wasted
            self._cond.notify_all()

    def _forget(self, key: bytes, entry: DiskEntry) -> None:
        del self._index[key]
        self._used -= entry.size
        if entry.pending is not None:
            self._pending_bytes -= entry.size
            entry.pending = None
            if not entry.writing:  # else the writer releases it once it is done with the payload
                entry.release_payload()
        self._dirty_meta.discard(key)

    # ---- the thread ------------------------------------------------------------------------
    def _writer(self) -> None:
        interval = max(self.cfg.reader_check_interval_s, 0.001)
        next_check = time.monotonic() + interval
        while True:
            with self._cond:
                while not self._closing and time.monotonic() < next_check:
                    if not self._queue:
                        self._writer_waiting = True
                        self._cond.wait(next_check - time.monotonic())
                        self._writer_waiting = False
                        continue
                    gather_left = self._queued_at + WRITE_GATHER_S - time.monotonic()
                    if gather_left <= 0 or self._num_flushing:
                        break
                    self._cond.wait(gather_left)
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
                metas = {k: meta_record(self._index[k]) for k in ready}
            self._commit_or_keep(deletes, metas)

    def _commit_or_keep(self, deletes: list[bytes], metas: dict[bytes, bytes]) -> int:
        """Commit deletes and meta updates; returns how many deletes committed, and keeps what failed
        for the next attempt. When the transaction fails (typically a full filesystem) the reserve is
        released and the deletes are retried alone in ever smaller transactions: each one frees pages
        that the one after next can reuse, so even a filesystem with no byte left empties. The reserve
        stays released until a commit succeeds: the next puts may need the file to grow (LMDB did not
        always find runs of free pages for their records), and refilling it at once left them none,
        so that writes stayed refused after a Flush (2 of 12 runs under load)."""
        try:
            self._commit(deletes, metas, [])
            self._reserve.fill()
            return len(deletes)
        except (lmdb.Error, OSError) as e:
            error = e
        if self._damaged or isinstance(error, DAMAGE):
            self._mark_damaged(error)
            self._keep(deletes, metas)
            return 0
        freed = self._reserve.release() if deletes else 0
        done, size = 0, max(len(deletes) // 2, MIN_DELETE_CHUNK)
        while done < len(deletes):
            try:
                self._commit(deletes[done : done + size], {}, [])
                done += min(size, len(deletes) - done)
            except lmdb.Error:
                if size == MIN_DELETE_CHUNK:
                    break
                size = max(size // 2, MIN_DELETE_CHUNK)
        if done == len(deletes) and metas:
            try:
                self._commit([], metas, [])
                metas = {}
            except lmdb.Error:
                pass
        if deletes:
            logger.warning("disk tier %s: deletes=%d failed (%s); released reserve bytes=%d, committed deletes=%d "
                           "in small transactions; retrying the rest and meta updates=%d later", self.path,
                           len(deletes), error, freed, done, len(metas))
        else:
            logger.warning("disk tier %s: meta updates=%d failed, will retry: %s", self.path, len(metas), error)
        self._keep(deletes[done:], metas)
        return done

    def _keep(self, deletes: list[bytes], metas: dict[bytes, bytes]) -> None:
        with self._mu:
            self._undeleted.update(deletes)
            self._dirty_meta.update(k for k in metas if k in self._index)

    def _mark_damaged(self, error: Exception) -> None:
        """A commit met a damaged page: refuse disk writes from now on and leave the DAMAGED marker, so
        that the next start moves the environment aside (LMDB cannot repair it; retrying only fails again)."""
        with self._cond:
            if self._damaged:
                return
            self._damaged = f"{type(error).__name__}: {error}"
        logger.error("disk tier %s is damaged (%s): disk writes are refused from now on; the next start moves "
                     "it aside and starts empty", self.path, self._damaged)
        mark_damaged(self.path, f"a commit failed with {self._damaged}")

    def _write_batch(self) -> None:
        with self._commit_lock:
            with self._mu:
                ops = []
                size = 0
                while self._queue and size < BATCH_BYTES:
                    op = self._queue.popleft()
                    ops.append(op)
                    if op.kind == "put":
                        assert op.entry is not None  # a put is always queued with its entry
                        size += op.entry.size
            if ops:
                try:
                    self._write_ops(ops)
                finally:  # whatever happened, these ops are done: flush() must not wait for them forever
                    with self._cond:
                        self._done_seq = max(self._done_seq, max(op.seq for op in ops))
                        self._cond.notify_all()

    def _write_ops(self, ops: list[Op]) -> None:
        with self._mu:  # snapshot; deletes commit first, which is right for any order of the queue
            deletes, self._undeleted = sorted(self._undeleted), set()
            puts: list[tuple[DiskEntry, Block]] = []
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
                        entry.writing = True
                        puts.append((entry, entry.pending))
                else:
                    metas[op.key] = meta_record(entry)
        failed: Exception | None = None
        refuse = False
        try:
            written = self._commit(deletes, metas, puts)
            self._reserve.fill()
        except Exception as e:  # noqa: BLE001 - map or disk full, or worse: the puts are dropped, the rest kept
            failed, written = e, {}
            if isinstance(e, DAMAGE):
                self._mark_damaged(e)
            # Puts wait DISK_FULL_RETRY_S before trying again, unless this freed pages for them.
            refuse = not self._commit_or_keep(deletes, metas)
        self._apply(puts, written, failed, refuse)

    def _commit(self, deletes: list[bytes], metas: dict[bytes, bytes],
                puts: list[tuple[DiskEntry, Block]]) -> dict[int, int]:
        """One transaction; returns the map bytes of each put written (stored_bytes), by id() of its entry."""
        written: dict[int, int] = {}
        if not (deletes or metas or puts):
            return written
        if self._damaged:  # every commit would meet the damaged page again
            raise lmdb.CorruptedError(self._damaged)
        with self._env.begin(write=True) as txn:
            for key in deletes:
                txn.delete(key, db=self._blocks)
                txn.delete(key, db=self._meta)
            for key, value in metas.items():
                txn.put(key, value, db=self._meta)
            # A big record's encoding (a copy of the payload, or zstd) runs on the encoder thread one
            # record ahead, while LMDB copies the previous one: both release the GIL. A small one is
            # encoded here (see INLINE_ENCODE_BYTES). Two scratch buffers take turns, so no record is
            # a fresh allocation.
            ahead = self._encode_ahead(puts, 0)
            for i, (entry, block) in enumerate(puts):
                pending, ahead = ahead, self._encode_ahead(puts, i + 1)
                try:
                    record = pending.result() if pending is not None else self._encode(block, i)
                except Exception as e:  # noqa: BLE001 - whatever the encoder raised drops this block, not the batch
                    logger.warning("disk tier %s: cannot encode block %s: %s", self.path, entry.meta.key.hex(), e)
                    continue
                size = stored_bytes(len(record), self._page_bytes)
                with self._mu:  # its meta record carries the size, known only now (compression)
                    meta_rec = meta_record(entry, size)
                txn.put(entry.meta.key, record, db=self._blocks)
                txn.put(entry.meta.key, meta_rec, db=self._meta)
                written[id(entry)] = size
        with self._cond:
            self._disk_full = ""
        return written

    def _encode_ahead(self, puts: list[tuple[DiskEntry, Block]], i: int) -> Future[bytes | memoryview] | None:
        """Put i's record being encoded on the encoder thread; None when there is no put i or it is
        small enough to encode inline."""
        if i >= len(puts) or puts[i][1].meta.nbytes < INLINE_ENCODE_BYTES:
            return None
        return self._encoder.submit(self._encode, puts[i][1], i)

    def _encode(self, block: Block, i: int) -> bytes | memoryview:
        """The record of put i of a batch, in scratch buffer i % 2."""
        cfg = self.cfg
        return codec.encode_block(block, compression=cfg.compression, level=cfg.zstd_level, shuffle=cfg.shuffle,
                                  min_ratio=cfg.min_compress_ratio, into=self._record_bufs[i % 2])

    def _apply(self, puts: list[tuple[DiskEntry, Block]], written: dict[int, int],
               failed: Exception | None, refuse: bool) -> None:
        with self._cond:
            lost = 0
            for entry, _ in puts:
                entry.writing = False
                key = entry.meta.key
                # Not when removed while being written: its delete is queued behind.
                if self._index.get(key) is entry and entry.pending is not None:
                    if id(entry) in written:
                        self._pending_bytes -= entry.size
                        self._used += written[id(entry)] - entry.size
                        entry.size, entry.pending = written[id(entry)], None
                    else:
                        self._forget(key, entry)
                        lost += 1
                entry.release_payload()  # written, dropped or removed: its payload is not read again
            if refuse:
                self._disk_full, self._disk_full_at = f"{type(failed).__name__}: {failed}", time.monotonic()
            if lost:
                self.write_failures += lost
                logger.warning("disk tier %s: dropped blocks=%d that could not be written: %s",
                               self.path, lost, failed or "encoding failed")

    # ---- waiting for and stopping the writer ---------------------------------------------------
    def flush(self, timeout_s: float | None = None) -> None:
        """Block until every write queued before this call has committed (or failed and been dropped).
        Raises DeadlineExceeded after timeout_s seconds."""
        if os.getpid() != self._pid:
            self._check_open()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            target = self._seq
            if self._done_seq >= target:
                return
            self._num_flushing += 1
            self._cond.notify_all()  # a gathering writer commits now
            try:
                while self._done_seq < target:
                    if not self._thread.is_alive():
                        raise Unavailable(f"disk tier {self.path}: the writer thread has stopped")
                    left = 1.0 if deadline is None else deadline - time.monotonic()
                    if left <= 0:
                        raise DeadlineExceeded(f"disk tier {self.path}: writes={target - self._done_seq} "
                                               f"still queued after {timeout_s} s")
                    self._cond.wait(min(left, 1.0))
            finally:
                self._num_flushing -= 1

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
        # RLock._is_owned is CPython's (no public way to ask whether this thread holds it), not in typeshed.
        if self._mu._is_owned():  # type: ignore[attr-defined]  # see above
            raise RuntimeError("DiskTier.close() re-entered from a signal handler; close from the main loop")
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join()
        self._encoder.shutdown()
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
