"""A file's pages in the page cache, measured and dropped (Linux: mincore and posix_fadvise), for the
benchmarks and tests that show what a start reads."""

from __future__ import annotations

import ctypes
import mmap
import os
import pathlib


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return libc


def resident_bytes(path: pathlib.Path) -> int:
    """Bytes of the file in the page cache (mincore over a fresh map of it: mapping touches nothing)."""
    libc = _libc()
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        try:
            pages = (ctypes.c_ubyte * -(-size // mmap.PAGESIZE))()
            assert libc.mincore(addr, size, pages) == 0, os.strerror(ctypes.get_errno())
            return sum(p & 1 for p in bytes(pages)) * mmap.PAGESIZE
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


def drop_page_cache(path: pathlib.Path) -> None:
    """Evict the file's pages from the page cache (written back first: DONTNEED skips dirty pages)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    assert resident_bytes(path) < 1 << 20, "posix_fadvise(DONTNEED) did not drop the file's pages"
