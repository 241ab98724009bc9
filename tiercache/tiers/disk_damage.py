"""The disk tier's defences against damaged files (LMDB has no page checksums): the DAMAGED marker
a failed commit leaves, a probe child that reads and writes the environment before the daemon opens
it, and moving the files aside to start empty. The checks that readers run before they map the files
(the marker, a truncated data.mdb) are in samehost/disk_files.py."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import lmdb

from tiercache.samehost.disk_files import DAMAGED_NAME, LOCK_NAME

logger = logging.getLogger(__name__)


PROBE_TIMEOUT_S = 120.0

# Errors that can only come from damaged files. The probe counts nothing else as damage: its write may
# also fail for lack of space (a plain lmdb.Error with errno EIO or ENOSPC, or MapFullError).
DAMAGE = (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.InvalidError, lmdb.VersionMismatchError,
          lmdb.IncompatibleError, lmdb.CursorFullError, lmdb.PageFullError, lmdb.BadTxnError)


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
