"""Same-host reads of the daemon's disk tier: a tokenless worker reads committed blocks straight out of
the daemon's LMDB environment (read-only, in a read transaction of its own) instead of asking the
daemon to promote them into its host tier first."""

from __future__ import annotations

import re
import logging
import os
import threading
from collections.abc import Sequence

import lmdb

from tiercache import codec
from tiercache.errors import TierCacheError
from tiercache.tiers.base import Block, BlockMeta
from tiercache.tiers.disk_env import BLOCKS_DB, META_DB

logger = logging.getLogger(__name__)

MAX_BLOCK_BYTES = 256 << 20  # a record's payload bound here: the client's receive limit

# LMDB forbids opening one environment twice in a process (closing either copy drops the process's
# locks on its lock file), so every client of a process shares one reader per environment file;
# readers are never closed (a thread may be reading), and a forked child opens its own.
_READERS: dict[tuple[int, str, int], DiskReader] = {}
_READERS_LOCK = threading.Lock()


def disk_reader(path: str, daemon_pid: int) -> DiskReader | None:
    """This process's reader of the daemon's disk tier at `path`; None where there is none to have:
    no disk tier, the daemon's own process (its environment is open here already), or files this
    process cannot open read-only (another user, another filesystem view): then the daemon serves."""
    if not path or daemon_pid == os.getpid():
        return None
    try:
        inode = os.stat(os.path.join(path, "data.mdb")).st_ino  # a moved-aside environment is another file
    except OSError as e:
        logger.info("not reading the daemon's disk tier %s directly: %s", path, e)
        return None
    key = (os.getpid(), path, inode)
    with _READERS_LOCK:
        reader = _READERS.get(key)
        if reader is None:
            try:
                reader = DiskReader(path)
            except lmdb.Error as e:
                logger.info("not reading the daemon's disk tier %s directly: %s", path, e)
                return None
            _READERS[key] = reader
        return reader


class DiskReader:
    """Reads of one LMDB environment of a daemon's disk tier, never writes.

    Only blocks without a TTL are read: their expiry is known to the daemon alone (a hit slides it).
    Every record is decoded and checked against its key and checksum as the daemon's own reads are;
    a damaged or absent block ends the run, and the caller asks the daemon for the rest (which drops
    and counts a damaged copy). A block the daemon deleted a moment ago may still be read: its bytes
    are still the verified KV of its key (keys address content).
    """

    def __init__(self, path: str) -> None:
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

    def prefix(self, store_keys: Sequence[bytes]) -> int:
        """How many of `store_keys`, in a row from the first, are committed here without a TTL."""
        try:
            with self._begin() as txn:
                for i, key in enumerate(store_keys):
                    if not _untimed(txn.get(key, db=self._meta)):
                        return i
        except lmdb.Error as e:
            logger.debug("disk tier %s: lookup failed, asking the daemon: %s", self.path, e)
            return 0
        return len(store_keys)

    def read(self, keys: Sequence[bytes], store_keys: Sequence[bytes], start: int) -> list[Block]:
        """The blocks of keys[start:], in a row, while each is committed here without a TTL and its
        record is intact: copies out of the map, verified, under the caller's keys (the parent
        too, when it is the previous key), like the daemon's Fetch would return them."""
        out: list[Block] = []
        try:
            with self._begin() as txn:
                for i in range(start, len(keys)):
                    key = store_keys[i]
                    record = txn.get(key, db=self._blocks)
                    if record is None or not _untimed(txn.get(key, db=self._meta)):
                        break
                    try:
                        block = codec.decode_block(record, max_payload_bytes=MAX_BLOCK_BYTES, expected_key=key)
                    except TierCacheError as e:  # the daemon's read will drop and count it
                        logger.warning("disk tier %s: block %s fails verification; asking the daemon",
                                       self.path, key.hex())
                        logger.debug("%s", e)
                        break
                    m = block.meta
                    parent = keys[i - 1] if i and m.parent == store_keys[i - 1] else b""
                    # Built field by field: dataclasses.replace cost more than the block's checksum.
                    meta = BlockMeta(keys[i], m.namespace, m.num_tokens, m.dtype, m.shape, m.nbytes, m.checksum,
                                     parent, "", m.preview)
                    out.append(Block(meta, block.payload))
        except lmdb.Error as e:
            logger.debug("disk tier %s: read failed, asking the daemon: %s", self.path, e)
        return out

    def _begin(self) -> lmdb.Transaction:
        try:
            return self._env.begin(buffers=True)
        except lmdb.MapResizedError:  # the daemon's map grew since we opened: adopt its size
            self._env.set_mapsize(0)
            return self._env.begin(buffers=True)


_TIMERS = re.compile(rb'"(ttl_s|expires_at)":([^,}]*)')
_ZERO = (b"0", b"0.0")


def _untimed(record: memoryview | None) -> bool:
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
