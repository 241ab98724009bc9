"""Opening the disk tier's LMDB environment: owner lock, damage checks, sub-databases, move-aside, index."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import lmdb

from tiercache import codec
from tiercache.config import MiB, DiskConfig
from tiercache.errors import AlreadyRunning, InvalidArgument
from tiercache.tiers.base import Block, BlockMeta

logger = logging.getLogger(__name__)

BLOCKS_DB = b"blocks"  # sub-database: store key -> codec record
META_DB = b"meta"  # sub-database: store key -> meta_record JSON
LOCK_NAME = "LOCK"
DAMAGED_NAME = "DAMAGED"  # written when a commit meets a damaged page: the next start moves the files aside
RESERVE_NAME = "RESERVE"  # ballast file: space held back so that deletes can commit on a full filesystem
PROBE_TIMEOUT_S = 120.0
MAX_READERS = 1024  # LMDB reader slots (its default, 126, is a few dozen workers)
OS_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")  # LMDB's page size in a map it creates here (env.stat()["psize"])
# Errors that mean "busy" or "short of resources", not "damaged": never a reason to move files aside.
NOT_DAMAGE = (lmdb.LockError, lmdb.ReadersFullError, lmdb.TlsFullError, lmdb.MemoryError, lmdb.DiskError,
              lmdb.ReadonlyError, lmdb.InvalidParameterError, lmdb.MapResizedError)
# Errors that can only come from damaged files. The probe counts nothing else as damage: its write may
# also fail for lack of space (a plain lmdb.Error with errno EIO or ENOSPC, or MapFullError).
DAMAGE = (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.InvalidError, lmdb.VersionMismatchError,
          lmdb.IncompatibleError, lmdb.CursorFullError, lmdb.PageFullError, lmdb.BadTxnError)


@dataclass(slots=True)
class Entry:
    """One block in the disk tier's index."""

    meta: BlockMeta
    attrs: dict
    size: int  # map bytes of the record once committed (stored_bytes); cost_bytes while the write is queued
    last_access: float  # unix seconds
    pending: Block | None = None  # the block until its write commits


@dataclass
class LoadedIndex:
    """What open_env found in the meta db: the index in LRU order and the keys to delete."""

    index: OrderedDict[bytes, Entry] = field(default_factory=OrderedDict)
    used_bytes: int = 0
    last_stamp: float = 0.0
    bad_keys: set[bytes] = field(default_factory=set)  # in one db only, unreadable, or over capacity
    num_bad_meta: int = 0
    num_evicted: int = 0
    page_bytes: int = OS_PAGE_BYTES  # the map's page size, fixed when it was created (see stored_bytes)
    legacy_keys: list[bytes] = field(default_factory=list)  # written by 0.1: see disk_upgrade.py
    upgraded: set[bytes] = field(default_factory=set)  # legacy keys rewritten by disk_upgrade
    unsized_keys: set[bytes] = field(default_factory=set)  # meta records without stored_bytes: to rewrite


def json_attrs(attrs: dict | None) -> dict:
    """A private, JSON-normalised copy of a block's attrs; InvalidArgument if they are not JSON-able."""
    if attrs is None:
        return {}
    try:
        if not isinstance(attrs, dict):
            raise TypeError(f"expected a dict, got {type(attrs).__name__}")
        return json.loads(json.dumps(attrs))
    except (TypeError, ValueError) as e:
        raise InvalidArgument(f"block attrs must be a JSON-able dict: {e}") from None


def meta_record(entry: Entry, size: int | None = None) -> bytes:
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
    fd = os.open(path / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise AlreadyRunning(f"disk tier {path} is already open elsewhere "
                             f"(another process holds the lock {path / LOCK_NAME})") from None
    return fd


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


def check_not_marked_damaged(path: Path) -> None:
    """Raise lmdb.CorruptedError when the last run left a DAMAGED marker (a commit met a damaged page)."""
    try:
        why = (path / DAMAGED_NAME).read_text(errors="replace").strip()
    except FileNotFoundError:
        return
    raise lmdb.CorruptedError(f"the last run marked it damaged: {why or 'no reason recorded'}")


def mark_damaged(path: Path, why: str) -> None:
    """Leave the DAMAGED marker (best effort: on a failing disk even this write may fail)."""
    try:
        with open(path / DAMAGED_NAME, "w") as f:
            f.write(why + "\n")
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        logger.error("disk tier %s: cannot write the %s marker: %s", path, DAMAGED_NAME, e)


# The probe child: it imports nothing but lmdb (the parent's sys.path, no site: ~25 ms to start), reads
# what read_metadata will read (the meta db's pages, and the blocks db's only when their counts differ;
# without readahead, for the reasons read_metadata gives), and commits one write transaction, which
# makes LMDB save its free list. Exit 3 reports an lmdb.Error as
# "Class: message" on stderr's last line; a damaged page can also kill it with SIGBUS or SIGABRT.
_PROBE = """
import json, resource, sys
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # an abort is an expected outcome here: no core file
sys.path[:] = json.loads(sys.argv[3])
import lmdb
try:
    env = lmdb.open(sys.argv[1], map_size=int(sys.argv[2]), max_dbs=4, lock=True, subdir=True, readahead=False)
    try:
        dbs = [env.open_db(name) for name in (b"blocks", b"meta")]  # BLOCKS_DB, META_DB: a separate process
        with env.begin(buffers=True) as txn:  # what read_metadata reads: the meta records, the blocks db's count
            for _, value in txn.cursor(db=dbs[1]):
                bytes(value)
            if txn.stat(dbs[0])["entries"] != txn.stat(dbs[1])["entries"]:
                for _ in txn.cursor(db=dbs[0]).iternext(values=False):
                    pass
        with env.begin(write=True, db=dbs[1]) as txn:
            txn.put(b"\\0tiercache-probe", b"1")
            txn.delete(b"\\0tiercache-probe")
    finally:
        env.close()
except lmdb.Error as e:
    sys.stderr.write("\\n%s: %s\\n" % (type(e).__name__, e))
    sys.exit(3)
"""


# How a damaged page kills a process: a read past the end of the file or through a wild pointer, or abort().
_FAULTS = {signal.SIGBUS, signal.SIGSEGV, signal.SIGABRT}


def probe(path: Path, map_size: int) -> None:
    """Raise lmdb.CorruptedError (or the LMDB damage error met) when reading and writing the environment
    in a child process fails: LMDB trusts its pages, and a damaged branch or free-list page kills the
    process that meets it (SIGBUS, or SIGABRT from an assertion at the first commit), which no
    Python code can catch. lmdb.DiskError (not damage) when the child died of a full filesystem.
    A new, empty environment is not probed; a probe that cannot run, times out or fails for any
    other reason is logged and skipped, never a reason to move data aside."""
    data_file = path / "data.mdb"
    try:
        if data_file.stat().st_size == 0:
            return
    except FileNotFoundError:
        return
    started = time.monotonic()
    cmd = [sys.executable, "-I", "-S", "-c", _PROBE, str(path), str(map_size), json.dumps(sys.path)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=PROBE_TIMEOUT_S,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        logger.warning("disk tier %s: could not probe it in a child process, opening it unprobed: %s", path, e)
        return
    rc, last = done.returncode, done.stderr.strip().rpartition("\n")[2]
    if rc == 0:
        logger.info("disk tier %s: probed in a child process in ms=%.0f", path, (time.monotonic() - started) * 1000)
        return
    if rc < 0 and -rc in _FAULTS:
        vfs = os.statvfs(path)
        if rc == -signal.SIGBUS and vfs.f_bavail * vfs.f_frsize < 64 * 1024:
            # LMDB maps its lock file and writes through the map: on a full filesystem that is a SIGBUS too.
            raise lmdb.DiskError(f"a probe process died with SIGBUS and the filesystem of {path} is full")
        raise lmdb.CorruptedError(f"a probe process died with {signal.Signals(-rc).name} reading and writing it"
                                  + (f" ({last})" if last else ""))
    if rc == 3:
        cls = getattr(lmdb, last.partition(": ")[0], None)
        if isinstance(cls, type) and issubclass(cls, DAMAGE):
            raise cls(f"{last.partition(': ')[2]} (met by a probe process)")
    # Killed by SIGTERM with the service's whole group, out of space, not startable: no sign of damage.
    logger.warning("disk tier %s: the probe failed (%s), opening it anyway", path,
                   f"signal {-rc}" if rc < 0 else f"exit {rc}: {last}")


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


_META_MAGIC = 0xBEEFC0DE
_NO_PAGE = 0xFFFFFFFFFFFFFFFF  # P_INVALID: an empty tree's root


def _u(buf: bytes, at: int, size: int) -> int:
    return int.from_bytes(buf[at : at + size], "little")


def check_not_truncated(data_file: Path) -> None:
    """Raise lmdb.CorruptedError when data.mdb is shorter than its newest meta page says it is.

    LMDB maps the file and trusts its meta pages: a read past the end of a truncated file is a
    SIGBUS that kills the process, so a truncated file must be caught before it is opened. The
    layout read here is LMDB's on-disk format (64-bit): page header 16 bytes, then MDB_meta with
    the page size in mm_dbs[FREE_DBI].md_pad (offset 40), the free db's root at 80, mm_last_pg at
    136 and mm_txnid at 144. Pages past the end that the free list holds are no truncation: LMDB
    never writes a page that a transaction allocated and freed again (a "loose" page), and never
    reads a free one (seen after a commit failed on a full filesystem).
    """
    try:
        size = data_file.stat().st_size
        with open(data_file, "rb") as f:
            head = f.read(4096)
            psize = _u(head, 40, 4) if len(head) >= 152 else 0
            if not 512 <= psize <= 65536:
                return  # not a meta page we can read: let LMDB judge the file
            f.seek(psize)
            metas = [head[:152], f.read(152)]
            newest = max((m for m in metas if len(m) == 152 and _u(m, 16, 4) == _META_MAGIC),
                         key=lambda m: _u(m, 144, 8), default=None)
            if newest is None:
                return
            last_pg = _u(newest, 136, 8)
            needed = (last_pg + 1) * psize
            if size >= needed:
                return
            beyond = range(-(-size // psize), last_pg + 1)
            if len(beyond) <= 4096 and set(beyond) <= _free_pages(f, psize, _u(newest, 80, 8), size):
                return
    except FileNotFoundError:
        return
    raise lmdb.CorruptedError(f"{data_file} is truncated: {size} bytes, its last committed page ends at {needed}")


def _free_pages(f: BinaryIO, psize: int, root: int, size: int) -> set[int]:
    """Page numbers in the free db (keys: txn ids; values: u64 count, then u64 page numbers, inline or in
    overflow pages). Empty when a page it needs lies past the end or the tree looks wrong."""
    free: set[int] = set()
    todo, seen = ([] if root == _NO_PAGE else [root]), set()
    while todo:
        pgno = todo.pop()
        if pgno in seen or (pgno + 1) * psize > size or len(seen) > 10_000:
            return set()
        seen.add(pgno)
        f.seek(pgno * psize)
        page = f.read(psize)
        flags, lower = _u(page, 10, 2), _u(page, 12, 2)
        for i in range((lower - 16) // 2):
            node = _u(page, 16 + 2 * i, 2)
            lo, hi, nflags, ksize = (_u(page, node + 2 * j, 2) for j in range(4))
            if flags & 0x01:  # P_BRANCH: the child's page number is in lo, hi and flags
                todo.append(lo | hi << 16 | nflags << 32)
                continue
            if not flags & 0x02:
                return set()
            data_at, dsize = node + 8 + ksize, lo | hi << 16
            if nflags & 0x01:  # F_BIGDATA: the IDL lives in overflow pages
                over = _u(page, data_at, 8)
                if over * psize + 16 + dsize > size:
                    return set()
                f.seek(over * psize + 16)
                ids = f.read(dsize)
            else:
                ids = page[data_at : data_at + dsize]
            free.update(_u(ids, 8 + 8 * k, 8) for k in range(min(_u(ids, 0, 8), (len(ids) - 8) // 8)))
    return free


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

    Entry sizes come from the meta records' stored_bytes. Only a meta record without one (written
    by 0.2.0, or a 0.1 record that disk_upgrade rewrites next) has its block record read for it,
    at the first start of this version: its key goes to unsized_keys, and DiskTier writes its
    meta record again."""
    page, raw = found.page_bytes, found.records
    out = LoadedIndex(bad_keys=found.block_keys ^ set(raw), page_bytes=page)
    loaded: list[Entry] = []
    unsized: list[Entry] = []
    for key, value in raw.items():
        if key not in found.block_keys:
            continue
        try:
            rec = json.loads(value)
            size = rec.get("stored_bytes")
            if size is not None and (type(size) is not int or size <= 0):
                raise ValueError(f"stored_bytes={size!r}")
            entry = Entry(BlockMeta.from_dict(rec["meta"]), rec["attrs"], size or 0, float(rec["last_access"]))
            if entry.meta.key != key or not isinstance(entry.attrs, dict):
                raise ValueError("key or attrs do not match")
            if rec.get("format") != codec.FORMAT:
                out.legacy_keys.append(key)
        except Exception as e:  # any malformed meta record: drop the block rather than refuse to start
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


def move_aside(path: Path, err: lmdb.Error) -> Path:
    """Move every file but our LOCK (still held, so no other process can slip in) to path.corrupt-<time>."""
    stamp = int(time.time())
    aside, n = Path(f"{path}.corrupt-{stamp}"), 0
    while aside.exists():
        n += 1
        aside = Path(f"{path}.corrupt-{stamp}-{n}")
    aside.mkdir()
    for child in path.iterdir():
        if child.name != LOCK_NAME:
            os.replace(child, aside / child.name)
    logger.warning("disk tier %s is damaged (%s: %s); moved it aside to %s and starting empty",
                   path, type(err).__name__, err, aside)
    return aside
