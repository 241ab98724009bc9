"""The slab: one shared-memory file of fixed-size pages and their generation counters (a seqlock per page).

Slab file layout (little-endian; the daemon writes it, SlabReader in worker processes reads it):

    offset 0             header page, 4096 bytes:
                           0  magic         8 bytes  b"TCSLAB1\\0"
                           8  version       u32      1
                          12  reserved      u32      0
                          16  page_bytes    u64
                          24  num_pages     u64
                          32  header_bytes  u64      offset of page 0
    offset 4096          generations: num_pages x i64, one counter per page
    offset header_bytes  pages: num_pages x page_bytes
                         (header_bytes = 4096 + 8 * num_pages rounded up to 4096)

Page generations are a seqlock. The daemon bumps a page's generation to odd before writing into the
page and to even after; freeing a page bumps it by 2; closing the slab makes every generation odd.
The daemon hands a reader a block as (pages, their even generations, nbytes) from HostTier.locate (tiers/host.py).
The reader copies the pages, then re-reads the generations: if any changed or is odd, the page was
being written or has been recycled since, and the copy is discarded. Generations only grow, so an
unchanged even generation proves the copied bytes are the block's. This relies on x86-64 ordering
(stores become visible in program order, loads are not reordered with later loads); a port to a
weakly ordered CPU would need fences around the copies.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import struct

import torch

from tiercache.errors import CapacityExceeded, InvalidArgument
from tiercache.layout import as_uint8

logger = logging.getLogger(__name__)

MAGIC = b"TCSLAB1\0"
VERSION = 1
HEADER = struct.Struct("<8sIIQQQ")
GENERATIONS_OFFSET = 4096


def header_bytes_for(num_pages: int) -> int:
    """Offset of page 0: the header page plus one i64 generation per page, rounded up to 4096."""
    return -(-(GENERATIONS_OFFSET + 8 * num_pages) // 4096) * 4096


def slab_views(slab: mmap.mmap, page_bytes: int, num_pages: int) -> tuple[memoryview, torch.Tensor]:
    """The generations (an i64 memoryview: a few pages at a time cost less than a torch call) and the
    pages [num_pages, page_bytes] u8 tensor of a mapped slab."""
    generations = memoryview(slab)[GENERATIONS_OFFSET : GENERATIONS_OFFSET + 8 * num_pages].cast("q")
    pages = as_uint8(slab)[header_bytes_for(num_pages) :].view(num_pages, page_bytes)
    return generations, pages


def remove_orphan_slabs(shm_dir: str) -> list[str]:
    """Delete slabs left by daemons that died (tiercache-<pid>-*.slab whose pid is gone).

    A SIGKILLed daemon cannot unlink its slab, and /dev/shm is RAM: without this, every crash
    would leak a whole host pool until reboot.
    """
    removed: list[str] = []
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return removed
    for name in names:
        parts = name.split("-")
        if len(parts) != 3 or parts[0] != "tiercache" or not name.endswith((".slab", ".index")) \
                or not parts[1].isdigit():
            continue
        try:
            os.kill(int(parts[1]), 0)
            continue  # alive (or not ours to judge)
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        try:
            os.unlink(os.path.join(shm_dir, name))
            removed.append(name)
        except OSError:
            continue
    if removed:
        logger.warning("removed %d slab(s) left by dead daemons in %s: %s", len(removed), shm_dir, ", ".join(removed))
    return removed


def create_slab(path: str, size: int) -> mmap.mmap:
    """Create the slab file with all its memory reserved, and map it read-write."""
    try:
        # 0o600: it holds every tenant's blocks, so only the daemon's user may map it (and, with
        # server.local_group, the group's members: server/access.py hands it to them once made).
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise InvalidArgument(f"slab {path} already exists") from None
    except OSError as e:
        raise InvalidArgument(f"host.shm_dir {os.path.dirname(path)!r}: cannot create the slab there: "
                              f"{e.strerror}") from None
    try:
        os.ftruncate(fd, size)
        # Reserve tmpfs memory now: a /dev/shm too small fails here with ENOSPC, not SIGBUS later.
        os.posix_fallocate(fd, 0, size)
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as e:
        os.unlink(path)
        if e.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            raise CapacityExceeded(f"cannot reserve host slab {path}: bytes={size}: {e.strerror}") from None
        raise
    finally:
        os.close(fd)


def header_problem(size: int, magic: bytes, version: int, page_bytes: int, num_pages: int,
                    header_bytes: int) -> str:
    """What is wrong with a slab header read back from a file of `size` bytes; "" if nothing."""
    if magic != MAGIC:
        return "bad magic"
    if version != VERSION:
        return f"version {version}, expected {VERSION}"
    if page_bytes < 8 or page_bytes % 8:
        return f"page_bytes={page_bytes}"
    if num_pages < 1 or header_bytes != header_bytes_for(num_pages):
        return f"header_bytes={header_bytes} for num_pages={num_pages}"
    if size != header_bytes + num_pages * page_bytes:
        return f"file size {size} != {header_bytes + num_pages * page_bytes}"
    return ""


def slab_geometry(slab: mmap.mmap, path: str) -> tuple[int, int, int]:
    """(page_bytes, num_pages, header_bytes) of a mapped slab, checked against its size; otherwise the
    map is closed and InvalidArgument names the problem."""
    magic, version, _, page_bytes, num_pages, header_bytes = HEADER.unpack_from(slab, 0)
    problem = header_problem(len(slab), magic, version, page_bytes, num_pages, header_bytes)
    if problem:
        slab.close()
        raise InvalidArgument(f"{path} is not a valid tiercache slab: {problem}")
    return page_bytes, num_pages, header_bytes
