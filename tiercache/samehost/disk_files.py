"""The files of the disk tier's LMDB environment as same-host readers see them: the names of its
sub-databases and markers, and the checks that must pass before anyone maps data.mdb."""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO

import lmdb

BLOCKS_DB = b"blocks"  # sub-database: store key -> codec record
META_DB = b"meta"  # sub-database: store key -> meta record JSON (tiers/disk_env.py)
LOCK_NAME = "LOCK"  # the owner's flock: one daemon per environment
DAMAGED_NAME = "DAMAGED"  # written when a commit meets a damaged page: the next start moves the files aside


def check_not_marked_damaged(path: Path) -> None:
    """Raise lmdb.CorruptedError when the last run left a DAMAGED marker (a commit met a damaged page)."""
    try:
        why = (path / DAMAGED_NAME).read_text(errors="replace").strip()
    except FileNotFoundError:
        return
    raise lmdb.CorruptedError(f"the last run marked it damaged: {why or 'no reason recorded'}")


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
    todo, seen = ([] if root == _NO_PAGE else [root]), set[int]()
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
