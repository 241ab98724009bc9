"""Same-host reads of the daemon's disk tier: a tokenless worker reads committed blocks straight out of
the daemon's LMDB environment (read-only, in a read transaction of its own) instead of asking the
daemon to promote them into its host tier first."""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Sequence
from pathlib import Path

import lmdb

from tiercache import codec
from tiercache.block import Block, BlockMeta
from tiercache.errors import InvalidArgument
from tiercache.keys import KEY_BYTES
from tiercache.samehost.disk_files import (
    BLOCKS_DB,
    DAMAGED_NAME,
    META_DB,
    check_not_marked_damaged,
    check_not_truncated,
)

logger = logging.getLogger(__name__)

MAX_BLOCK_BYTES = 256 << 20  # a record's payload bound here: the client's receive bound (core.MAX_MESSAGE_BYTES)

# A deliberate module-level registry, against the usual rule: LMDB forbids opening one environment
# twice in a process (closing either copy drops the process's locks on its lock file), so the
# clients of a process share one reader per environment file (device and inode: one file may have
# several paths), closed when the last of them releases it; a forked child opens its own.
_READERS: dict[tuple[int, int, int], DiskReader] = {}
_READERS_LOCK = threading.Lock()


def disk_reader(path: str, daemon_pid: int) -> DiskReader | None:
    """This process's reader of the daemon's disk tier at `path`, for the caller to release() when
    done with it; None where there is none to have: no disk tier, the daemon's own process (its
    environment is open here already), files this process cannot open for reading with LMDB's
    lock (another user, a read-only mount: without the lock file the daemon could reuse pages under
    our reads), or damaged ones: then the daemon serves."""
    if not path or daemon_pid == os.getpid():
        return None
    try:
        data = os.stat(os.path.join(path, "data.mdb"))
        if not os.access(os.path.join(path, "lock.mdb"), os.W_OK) or os.statvfs(path).f_flag & os.ST_RDONLY:
            raise PermissionError(f"cannot take LMDB reader slots in {path}")
    except OSError as e:
        logger.info("not reading the daemon's disk tier %s directly: %s", path, e)
        return None
    key = (os.getpid(), data.st_dev, data.st_ino)
    with _READERS_LOCK:
        reader = _READERS.get(key)
        if reader is None:
            try:
                reader = DiskReader(path, daemon_pid)
            except lmdb.Error as e:
                logger.info("not reading the daemon's disk tier %s directly: %s", path, e)
                return None
            _READERS[key] = reader
        reader.users += 1
        return reader


def release(reader: DiskReader) -> None:
    """Give back a reader from disk_reader(): the last user's release closes its environment (after
    any read in progress). A reader inherited across fork is left alone."""
    with _READERS_LOCK:
        reader.users -= 1
        if reader.users == 0 and reader.pid == os.getpid():
            for key in [k for k, v in _READERS.items() if v is reader]:
                del _READERS[key]
            reader.close()


class DiskReader:
    """Reads of one LMDB environment of a daemon's disk tier, never writes.

    Only blocks without a TTL are read: their expiry is known to the daemon alone (a hit slides it).
    Every record is decoded and checked against its key and checksum as the daemon's own reads are;
    a damaged or absent block ends the run, and the caller asks the daemon for the rest (which drops
    and counts a damaged copy). Reads stop when the daemon has marked the environment damaged (a
    damaged page can kill a reader with SIGBUS; the daemon moves such files aside at its restart).
    Reads, a remap and close() take turns (one lock): a remap unmaps what a read may be copying.
    """

    def __init__(self, path: str, daemon_pid: int) -> None:
        check_not_marked_damaged(Path(path))
        check_not_truncated(Path(path) / "data.mdb")
        # map_size=0: map what the daemon's environment declares (a reader's own size would be
        # too small once the daemon's file grew past it).
        self._env = lmdb.open(path, readonly=True, lock=True, create=False, subdir=True, max_dbs=4, map_size=0)
        try:
            self._blocks = self._env.open_db(BLOCKS_DB, create=False)
            self._meta = self._env.open_db(META_DB, create=False)
        except lmdb.Error:
            self._env.close()  # this process's only copy: closing it drops no other's locks
            raise
        self.path = path
        self.daemon_pid = daemon_pid
        self.pid = os.getpid()
        self.users = 0  # see disk_reader and release
        self._damaged = os.path.join(path, DAMAGED_NAME)
        self._lock = threading.Lock()
        self._closed = False
        # (LMDB transaction id, store keys) of the last prefix(): those keys were committed without
        # a TTL in that snapshot. A read() in the same snapshot (no write committed since: the usual
        # lookup-then-fetch) need not read and parse their meta records again.
        self._untimed_at: tuple[int, frozenset[bytes]] | None = None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._env.close()

    def prefix(self, store_keys: Sequence[bytes]) -> int:
        """How many of `store_keys`, in a row from the first, are committed here without a TTL."""
        with self._lock:
            try:
                with self._begin() as txn:
                    for i, key in enumerate(store_keys):
                        if not _untimed(txn.get(key, db=self._meta)):
                            self._untimed_at = (txn.id(), frozenset(store_keys[:i]))
                            return i
                    self._untimed_at = (txn.id(), frozenset(store_keys))
            except lmdb.Error as e:
                logger.debug("disk tier %s: lookup failed, asking the daemon: %s", self.path, e)
                return 0
        return len(store_keys)

    def read(self, keys: Sequence[bytes], store_keys: Sequence[bytes], start: int, stop: int) -> list[Block]:
        """The blocks of keys[start:stop], in a row, while each is committed here without a TTL and
        its record is intact: copies out of the map, verified, under the caller's keys (the parent
        too, when it is the previous key), like the daemon's Fetch would return them. The payloads
        of one read share one buffer (codec.decode_run)."""
        out: list[Block] = []
        if any(len(key) != KEY_BYTES for key in keys[start:stop]):
            raise InvalidArgument(f"block keys must be {KEY_BYTES} bytes")
        with self._lock:
            try:
                with self._begin() as txn:
                    known = self._untimed_at
                    untimed = known[1] if known is not None and known[0] == txn.id() else frozenset()
                    records = []
                    for key in store_keys[start:stop]:
                        record = txn.get(key, db=self._blocks)
                        if record is None or (key not in untimed and not _untimed(txn.get(key, db=self._meta))):
                            break
                        records.append(record)
                    # Copied out of the map (into one buffer) before the transaction ends.
                    blocks, error = codec.decode_run(records, max_payload_bytes=MAX_BLOCK_BYTES,
                                                     expected_keys=list(store_keys[start : start + len(records)]))
                if error is not None:  # the daemon's read will drop and count it
                    logger.warning("disk tier %s: block %d of the run fails verification (%s); asking the daemon",
                                   self.path, start + len(blocks), error)
                for i, block in enumerate(blocks, start):
                    m = block.meta
                    parent = keys[i - 1] if i and m.parent == store_keys[i - 1] else b""
                    # The verified record's fields under the caller's (checked) keys: nothing to check again.
                    meta = BlockMeta.checked_already(keys[i], m.namespace, m.num_tokens, m.dtype, m.shape, m.nbytes,
                                                     m.checksum, parent, m.preview)
                    out.append(Block(meta, block.payload))
            except lmdb.Error as e:
                logger.debug("disk tier %s: read failed, asking the daemon: %s", self.path, e)
        return out

    def _begin(self) -> lmdb.Transaction:
        """A read transaction (the caller holds the lock); lmdb.Error when closed or marked damaged."""
        if self._closed or os.path.exists(self._damaged):
            raise lmdb.Error(f"{self.path} is closed or marked damaged")
        try:
            return self._env.begin(buffers=True)
        except lmdb.MapResizedError:  # the daemon's map grew since we opened: adopt its size
            self._env.set_mapsize(0)
            return self._env.begin(buffers=True)


_TIMERS = re.compile(rb'"(ttl_s|expires_at)":([^,}]*)')
_ZERO = (b"0", b"0.0")


def _untimed(record: bytes | memoryview | None) -> bool:
    """Whether a meta db record (disk_env.meta_record: {"meta":{...},"attrs":{...},"last_access":t})
    exists and its attrs say ttl_s 0 and expires_at 0 (no TTL). Read with a regex over the attrs
    alone (json.loads of even those took ~6 us a block): the last `,"attrs":{` is theirs, as such
    bytes inside the meta's strings would be escaped. Anything unexpected reads as timed."""
    if record is None:
        return False
    text = bytes(record)
    start = text.rfind(b',"attrs":{')
    end = text.find(b"}", start)
    if start < 0 or end < 0:
        return False
    found = dict(_TIMERS.findall(text, start, end))
    return len(found) == 2 and found[b"ttl_s"] in _ZERO and found[b"expires_at"] in _ZERO
