"""Opening the disk tier's LMDB environment: owner lock, sub-databases, the index from the meta db
(the damage checks it runs first are in disk_damage.py)."""

from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lmdb

from tiercache import codec
from tiercache.block import Block, BlockMeta
from tiercache.config import DiskConfig, MiB
from tiercache.errors import AlreadyRunning, InvalidArgument
from tiercache.samehost.disk_files import BLOCKS_DB, LOCK_NAME, META_DB, check_not_marked_damaged, check_not_truncated
from tiercache.tiers.disk_damage import probe

logger = logging.getLogger(__name__)

RESERVE_NAME = "RESERVE"  # ballast file: space held back so that deletes can commit on a full filesystem
MAX_READERS = 1024  # LMDB reader slots (its default, 126, is a few dozen workers)
OS_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")  # LMDB's page size in a map it creates here (env.stat()["psize"])
# Modes of the environment's directory and files: the daemon's user alone, or also server.local_group
# (set_file_access), whose members read blocks in place (client/disk_reader.py). An LMDB reader takes
# a slot in lock.mdb, so the group writes that file; data.mdb it only reads; LOCK is the daemon's.
OWNER_MODES = {".": 0o700, "data.mdb": 0o600, "lock.mdb": 0o600, LOCK_NAME: 0o600}
GROUP_MODES = {".": 0o750, "data.mdb": 0o640, "lock.mdb": 0o660, LOCK_NAME: 0o600}
# Errors that mean "busy" or "short of resources", not "damaged": never a reason to move files aside.
NOT_DAMAGE = (lmdb.LockError, lmdb.ReadersFullError, lmdb.TlsFullError, lmdb.MemoryError, lmdb.DiskError,
              lmdb.ReadonlyError, lmdb.InvalidParameterError, lmdb.MapResizedError)


@dataclass(slots=True)
class DiskEntry:
    """One block in the disk tier's index."""

    meta: BlockMeta
    attrs: dict
    size: int  # map bytes of the record once committed (stored_bytes); cost_bytes while the write is queued
    last_access: float  # unix seconds
    pending: Block | None = None  # the block until its write commits
    # Called once the writer no longer reads the pending payload (written, dropped or removed): the
    # host tier's hold on the slab pages a payload viewed (DurableTier.put).
    release: Callable[[], None] | None = None
    writing: bool = False  # the writer thread holds the pending payload right now (being encoded)

    def release_payload(self) -> None:
        """Call `release`, once."""
        release, self.release = self.release, None
        if release is not None:
            release()


@dataclass
class LoadedIndex:
    """What open_env found in the meta db: the index in LRU order and the keys to delete."""

    index: OrderedDict[bytes, DiskEntry] = field(default_factory=OrderedDict)
    used_bytes: int = 0
    last_stamp: float = 0.0
    bad_keys: set[bytes] = field(default_factory=set)  # in one db only, unreadable, or over capacity
    num_bad_meta: int = 0
    num_evicted: int = 0
    page_bytes: int = OS_PAGE_BYTES  # the map's page size, fixed when it was created (see stored_bytes)
    legacy_keys: list[bytes] = field(default_factory=list)  # written by 0.1: see disk_upgrade.py
    upgraded: set[bytes] = field(default_factory=set)  # legacy keys rewritten by disk_upgrade
    unsized_keys: set[bytes] = field(default_factory=set)  # meta records without stored_bytes: to rewrite


def json_attrs(attrs: object) -> dict[str, Any]:
    """A private, JSON-normalised copy of a block's attrs; InvalidArgument if they are not JSON-able."""
    if attrs is None:
        return {}
    try:
        if not isinstance(attrs, dict):
            raise TypeError(f"expected a dict, got {type(attrs).__name__}")
        # The store's attributes are plain numbers under string keys: a copy is their JSON form already
        # (a dumps-loads round trip cost a write-through put a tenth of its time at 64 KiB blocks).
        if all(type(k) is str and type(v) in (int, float) and math.isfinite(v) for k, v in attrs.items()):
            return dict(attrs)
        return json.loads(json.dumps(attrs))
    except (TypeError, ValueError) as e:
        raise InvalidArgument(f"block attrs must be a JSON-able dict: {e}") from None


def meta_record(entry: DiskEntry, size: int | None = None) -> bytes:
    """The meta db value of a block: JSON {meta, attrs, last_access, format, stored_bytes}; `format`
    names the block record's format (0.1 wrote none: load_index lists those blocks for disk_upgrade);
    `stored_bytes` is the map bytes its record takes (stored_bytes(len(record))), `size` or else
    entry.size, which must then be the committed record's (0.2.0 wrote none: load_index reads it
    from the record then, once). With it a start reads the meta db alone, never a payload page."""
    assert size is not None or entry.pending is None, "a queued block's size is not yet its record's"
    attrs, stamp = json.dumps(entry.attrs, separators=(",", ":")), json.dumps(entry.last_access)
    return (f'{{"meta":{codec.meta_json(entry.meta)},"attrs":{attrs},"last_access":{stamp},'
            f'"format":"{codec.FORMAT}","stored_bytes":{entry.size if size is None else size}}}').encode()


def take_lock(path: Path) -> int:
    """An exclusive flock on path/LOCK (its descriptor); AlreadyRunning if another process holds it."""
    fd = os.open(path / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise AlreadyRunning(f"disk tier {path} is already open elsewhere "
                             f"(another process holds the lock {path / LOCK_NAME})") from None
    return fd


def set_file_access(path: Path, gid: int | None) -> None:
    """Give the environment's directory and files (OWNER_MODES) to the daemon's user alone (gid None),
    or also to group gid (GROUP_MODES; the process must belong to it, or be root). OSError if it cannot."""
    for name, mode in (OWNER_MODES if gid is None else GROUP_MODES).items():
        target = path / name
        if gid is not None:
            os.chown(target, -1, gid)
        os.chmod(target, mode)


def open_env(path: Path, cfg: DiskConfig) -> tuple[lmdb.Environment, lmdb._Database, lmdb._Database, LoadedIndex]:
    """The environment, its b"blocks" and b"meta" sub-dbs, and the index loaded from them."""
    map_size = map_size_bytes(cfg)
    check_not_marked_damaged(path)
    check_not_truncated(path / "data.mdb")
    probe(path, map_size)
    found = read_metadata(path, map_size)
    # Reader slots for the daemon's threads and for same-host workers reading it (disk_reader.py):
    # each worker holds one while it reads, and one more kept for its next read.
    env = lmdb.open(str(path), map_size=map_size, max_dbs=4, lock=True, subdir=True, max_readers=MAX_READERS)
    try:
        # LMDB creates its files world-readable (0644 under the usual umask), and they hold every
        # tenant's blocks: the daemon's user alone, until server/access.py shares them with a group.
        try:
            set_file_access(path, None)
        except OSError as e:  # a filesystem without Unix modes (vfat): its mount options decide
            logger.warning("disk tier %s: cannot restrict its files to the daemon's user: %s", path, e)
        blocks = env.open_db(BLOCKS_DB)
        meta = env.open_db(META_DB)
        stale = env.reader_check()
        if stale:
            logger.info("disk tier %s: cleared %d stale reader slots", path, stale)
        loaded = load_index(path, env, blocks, found, cfg.capacity_bytes)
    except BaseException:
        env.close()
        raise
    warn_if_short_of_room(path, map_size, cfg.capacity_bytes)
    return env, blocks, meta, loaded


def stored_bytes(value_len: int, page_bytes: int = OS_PAGE_BYTES) -> int:
    """Bytes of the map that a block record of value_len bytes takes, as the tier's capacity counts
    them. LMDB keeps a value over about half a page in overflow pages of its own (whole pages, a
    16-byte header first): a record of 4 KiB and a few hundred bytes takes 8 KiB. Counting records
    at their length let a tier of small blocks fill its map at a third of its capacity."""
    node = 48  # in a leaf page: the 32-byte key, the node's header, the value or its first page number
    if value_len + node <= page_bytes // 2:
        return value_len + node
    return -(-(value_len + 16) // page_bytes) * page_bytes + node


def map_size_bytes(cfg: DiskConfig) -> int:
    return cfg.map_size_bytes or int(cfg.capacity_bytes * 1.5) + 64 * MiB


def warn_if_short_of_room(path: Path, map_size: int, capacity_bytes: int) -> None:
    """Log a warning when the filesystem cannot hold the map: the disk fills before the tier does."""
    try:
        vfs = os.statvfs(path)
        room = vfs.f_bavail * vfs.f_frsize + sum(
            (path / name).stat().st_size for name in ("data.mdb", RESERVE_NAME) if (path / name).exists())
    except OSError:
        return
    if map_size > room:
        logger.warning("disk tier %s: map_size=%d bytes exceeds the room on its filesystem (bytes=%d free or "
                       "already ours): capacity_bytes=%d cannot be honoured, the filesystem will fill first",
                       path, map_size, room, capacity_bytes)


@dataclass
class Metadata:
    """What read_metadata found: the meta db's records, the blocks db's keys, the map's page size."""

    records: dict[bytes, bytes]
    block_keys: set[bytes]
    page_bytes: int


def read_metadata(path: Path, map_size: int) -> Metadata:
    """The meta db's records and the blocks db's keys, read without touching a payload page.

    Three things read payload pages otherwise (measured: 904 of 904 MiB of data.mdb resident after
    a start, 800 blocks of 1.1 MiB). py-lmdb touches every page of each value it returns (its
    preload(), so that a copy never faults with the GIL held): a cursor over the blocks db with
    values reads every payload, hence the sizes come from the meta records (stored_bytes). LMDB
    reads the first overflow page of each record its cursor passes even without values (4 KiB a
    block, a random read each): the blocks db's keys are walked only when its entry count differs
    from the meta db's, which takes a bug (every transaction that writes one db writes the other).
    And the kernel answers a fault in a file map by reading read_ahead_kb around it (8 MiB on the
    machine measured): the meta db's leaf pages lie among the payloads' overflow pages, so a fault
    on each read most of the file. This environment is therefore opened without readahead
    (MADV_RANDOM), read, and closed before open_env opens the tier's own with readahead, which a
    block read wants (a cold 1.1 MiB record: 4.4 ms with it, 23 ms page by page). The caller
    holds the LOCK: nothing can commit in between.
    """
    env = lmdb.open(str(path), map_size=map_size, max_dbs=4, lock=True, subdir=True, readahead=False)
    try:
        blocks_db, meta_db = env.open_db(BLOCKS_DB), env.open_db(META_DB)
        with env.begin(buffers=True) as txn:
            records = {bytes(k): bytes(v) for k, v in txn.cursor(db=meta_db)}
            stat = txn.stat(blocks_db)
            if stat["entries"] == len(records):
                block_keys = set(records)
            else:
                logger.warning("disk tier %s: blocks=%d in the blocks db but %d meta records: reading every key",
                               path, stat["entries"], len(records))
                block_keys = {bytes(k) for k in txn.cursor(db=blocks_db).iternext(values=False)}
        return Metadata(records=records, block_keys=block_keys, page_bytes=stat["psize"])
    finally:
        env.close()


def record_lengths(env: lmdb.Environment, blocks_db: lmdb._Database, keys: list[bytes]) -> dict[bytes, int]:
    """The length of each key's block record, if it has one: reads every page of each (py-lmdb's preload)."""
    with env.begin(db=blocks_db, buffers=True) as txn:
        return {key: len(record) for key in keys if (record := txn.get(key)) is not None}


def load_index(path: Path, env: lmdb.Environment, blocks_db: lmdb._Database, found: Metadata,
               capacity_bytes: int) -> LoadedIndex:
    """The index in last-access order; anything inconsistent, unreadable or over capacity in bad_keys.

    DiskEntry sizes come from the meta records' stored_bytes. Only a meta record without one (written
    by 0.2.0, or a 0.1 record that disk_upgrade rewrites next) has its block record read for it,
    at the first start of this version: its key goes to unsized_keys, and DiskTier writes its
    meta record again."""
    page, raw = found.page_bytes, found.records
    out = LoadedIndex(bad_keys=found.block_keys ^ set(raw), page_bytes=page)
    loaded: list[DiskEntry] = []
    unsized: list[DiskEntry] = []
    for key, value in raw.items():
        if key not in found.block_keys:
            continue
        try:
            rec = json.loads(value)
            size = rec.get("stored_bytes")
            if size is not None and (type(size) is not int or size <= 0):
                raise ValueError(f"stored_bytes={size!r}")
            entry = DiskEntry(BlockMeta.from_dict(rec["meta"]), rec["attrs"], size or 0, float(rec["last_access"]))
            if entry.meta.key != key or not isinstance(entry.attrs, dict):
                raise ValueError("key or attrs do not match")
            if rec.get("format") != codec.FORMAT:
                out.legacy_keys.append(key)
        except Exception as e:  # noqa: BLE001 - any malformed meta record: drop the block rather than refuse to start
            logger.warning("disk tier %s: dropping block %s with a bad meta record: %s", path, key.hex(), e)
            out.num_bad_meta += 1
            out.bad_keys.add(key)
            continue
        loaded.append(entry)
        if not entry.size:
            unsized.append(entry)
    if unsized:
        started = time.monotonic()
        lengths = record_lengths(env, blocks_db, [e.meta.key for e in unsized])
        for entry in unsized:
            if entry.meta.key in lengths:
                entry.size = stored_bytes(lengths[entry.meta.key], page)
            else:  # only in the meta db after all (read_metadata compared counts, not keys)
                out.bad_keys.add(entry.meta.key)
        loaded = [e for e in loaded if e.size]
        out.unsized_keys = {e.meta.key for e in unsized if e.size}
        logger.warning("disk tier %s: read the records of blocks=%d (bytes=%d) in ms=%.0f for sizes their meta "
                       "records lack (written by an older version); their meta records are written again, "
                       "so this is done once", path, len(unsized), sum(lengths.values()),
                       (time.monotonic() - started) * 1000)
    loaded.sort(key=lambda e: (e.last_access, e.meta.key))
    out.index = OrderedDict((e.meta.key, e) for e in loaded)
    out.used_bytes = sum(e.size for e in loaded)
    # Over capacity: the configured capacity shrank since the last run, or the tier was written by a
    # version before 0.1.1, which counted records at their length, not the map pages they take.
    while out.used_bytes > capacity_bytes:
        key, entry = out.index.popitem(last=False)
        out.used_bytes -= entry.size
        out.num_evicted += 1
        out.bad_keys.add(key)
    if out.num_evicted:
        logger.warning("disk tier %s: evicting blocks=%d (the least recently used) to fit capacity_bytes=%d: the "
                       "capacity shrank, or an older version counted the blocks smaller than the map pages they "
                       "take", path, out.num_evicted, capacity_bytes)
    out.last_stamp = max((e.last_access for e in loaded), default=0.0)
    return out


