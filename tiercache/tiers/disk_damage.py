"""The disk tier's defences against damaged files (LMDB has no page checksums): the DAMAGED marker
a failed commit leaves, a truncated data.mdb, a damaged free list, a probe child that reads and
writes the environment before the daemon opens it, and moving the files aside to start empty."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import BinaryIO

import lmdb

logger = logging.getLogger(__name__)


LOCK_NAME = "LOCK"
DAMAGED_NAME = "DAMAGED"  # written when a commit meets a damaged page: the next start moves the files aside
PROBE_TIMEOUT_S = 120.0

# Errors that can only come from damaged files. The probe counts nothing else as damage: its write may
# also fail for lack of space (a plain lmdb.Error with errno EIO or ENOSPC, or MapFullError).
DAMAGE = (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.InvalidError, lmdb.VersionMismatchError,
          lmdb.IncompatibleError, lmdb.CursorFullError, lmdb.PageFullError, lmdb.BadTxnError)


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
