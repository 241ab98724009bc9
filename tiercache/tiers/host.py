"""The host tier: blocks in fixed-size pages of one shared-memory slab that same-host workers map read-only.

Slab file layout (little-endian; SlabReader, in worker processes, depends on it):

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
The daemon hands a reader a block as (pages, their even generations, nbytes) from HostTier.locate.
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
import secrets
import struct
from collections.abc import Sequence

import numpy as np
import torch

from tiercache.config import HostConfig
from tiercache.errors import CapacityExceeded, InvalidArgument, NotFound
from tiercache.layout import as_uint8, checksum
from tiercache.tiers.paged import PagedTier, PagePool, is_run, pages_for

logger = logging.getLogger(__name__)

MAGIC = b"TCSLAB1\0"
VERSION = 1
HEADER = struct.Struct("<8sIIQQQ")
GENERATIONS_OFFSET = 4096


def header_bytes_for(num_pages: int) -> int:
    """Offset of page 0: the header page plus one i64 generation per page, rounded up to 4096."""
    return -(-(GENERATIONS_OFFSET + 8 * num_pages) // 4096) * 4096


def _views(slab: mmap.mmap, page_bytes: int, num_pages: int) -> tuple[memoryview, torch.Tensor]:
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
    removed = []
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return removed
    for name in names:
        parts = name.split("-")
        if len(parts) != 3 or parts[0] != "tiercache" or not name.endswith(".slab") or not parts[1].isdigit():
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


class HostTier(PagedTier):
    """The shared-memory CPU pool; see the module docstring for the slab layout and the seqlock.

    Besides PagedTier's invariants: every used page has an even generation between calls.
    """

    def __init__(self, cfg: HostConfig, *, slab_name: str | None = None) -> None:
        num_pages = cfg.capacity_bytes // cfg.page_bytes
        if num_pages < 1 or cfg.page_bytes % 8:
            raise InvalidArgument(f"host tier needs >= 1 page of a multiple of 8 bytes, got "
                                  f"capacity_bytes={cfg.capacity_bytes} page_bytes={cfg.page_bytes}")
        # The pid lets a later daemon recognise slabs left behind by one that died.
        name = slab_name or f"tiercache-{os.getpid()}-{secrets.token_hex(6)}.slab"
        if os.path.basename(name) != name or name in ("", ".", ".."):
            raise InvalidArgument(f"slab_name must be a plain file name, got {name!r}")
        path = os.path.join(cfg.shm_dir, name)
        remove_orphan_slabs(cfg.shm_dir)
        header_bytes = header_bytes_for(num_pages)
        size = header_bytes + num_pages * cfg.page_bytes
        self._mmap = _create_slab(path, size)
        self._path = path
        self._closed = False
        self._generations, pool = _views(self._mmap, cfg.page_bytes, num_pages)
        pool.zero_()  # fault every page in now, so no request pays for it (the header is written below)
        super().__init__("host", pool)
        self.header_bytes = header_bytes
        HEADER.pack_into(self._mmap, 0, b"\0" * 8, VERSION, 0, cfg.page_bytes, num_pages, header_bytes)
        self._mmap[:8] = MAGIC  # last, so a reader never validates a half-written header
        self._pinned = _cuda_register(self._mmap)
        logger.info("host slab %s: pages=%d page_bytes=%d bytes=%d pinned=%s",
                    path, num_pages, cfg.page_bytes, size, self._pinned)

    @property
    def slab_path(self) -> str:
        return self._path

    def _bump(self, pages: Sequence[int], by: int) -> None:
        generations = self._generations
        for page in pages:
            generations[page] += by

    def _begin_write(self, pages: Sequence[int]) -> None:
        self._bump(pages, 1)

    def _end_write(self, pages: Sequence[int]) -> None:
        self._bump(pages, 1)

    def _on_free(self, pages: Sequence[int]) -> None:
        self._bump(pages, 2)

    def locate(self, key: bytes) -> tuple[list[int], list[int]]:
        """The block's pages and their current (even) generations, for SlabReader.read in another
        process. Does not mutate, does not touch LRU order or counters. Raises NotFound if absent."""
        entry = self._entries.get(key)
        if entry is None:
            raise NotFound(f"block {key.hex()} is not in the host tier")
        generations = [self._generations[page] for page in entry.pages]
        assert all(g % 2 == 0 for g in generations), "locate while a page is being written"
        return list(entry.pages), generations

    def payload_view(self, pages: Sequence[int], nbytes: int) -> torch.Tensor:
        """The bytes of a block located by locate(), as a zero-copy view of the slab when its pages
        are one run (the common case), else gathered into a new tensor. Takes no lock: the caller
        must check still_valid() after its last read of the view and discard what it read if not."""
        if is_run(pages):
            start = pages[0] * self.page_bytes
            return self._pool.flat[start : start + nbytes]
        out = torch.empty(nbytes, dtype=torch.uint8)
        self._pool.gather(pages, out)
        return out

    def still_valid(self, pages: Sequence[int], generations: Sequence[int]) -> bool:
        """Whether no page of a located block has been written or freed since locate() (the seqlock)."""
        now = self._generations
        return not self._closed and all(now[p] == g for p, g in zip(pages, generations))

    def check_integrity(self) -> None:
        super().check_integrity()
        odd = [p for entry in self._entries.values() for p in entry.pages if self._generations[p] % 2]
        assert not odd, f"used pages {odd} have odd generations outside a write"

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # Readers still holding the mapping must never validate a page again.
        for page in range(self.num_pages):
            self._generations[page] |= 1
        if self._pinned:
            err = int(torch.cuda.cudart().cudaHostUnregister(self._pool.pages.data_ptr() - self.header_bytes))
            if err:
                logger.warning("cudaHostUnregister of %s failed: cudaError=%d", self._path, err)
        self._entries.clear()
        self._generations.release()
        del self._pool
        try:
            self._mmap.close()
        except BufferError:  # a caller still holds a view; the mapping goes when that does
            logger.warning("host slab %s still has views at close", self._path)
        try:
            os.unlink(self._path)
        except FileNotFoundError:
            pass


def _create_slab(path: str, size: int) -> mmap.mmap:
    """Create the slab file with all its memory reserved, and map it read-write."""
    try:
        # 0o600: it holds every tenant's blocks, so only the daemon's user may map it.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise InvalidArgument(f"slab {path} already exists") from None
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


def _cuda_register(slab: mmap.mmap) -> bool:
    """Pin the slab for fast device copies when CUDA is present; whether it was pinned."""
    if not torch.cuda.is_available():
        return False
    whole = torch.frombuffer(slab, dtype=torch.uint8)
    err = int(torch.cuda.cudart().cudaHostRegister(whole.data_ptr(), whole.numel(), 1))  # 1: Portable
    if err:
        logger.warning("cudaHostRegister of the host slab failed (cudaError=%d); copies stay unpinned", err)
    return not err


def _header_problem(size: int, magic: bytes, version: int, page_bytes: int, num_pages: int,
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


SCATTER_GAP_BYTES = 1 << 20  # see _scattered_sums
READ_GROUP_BYTES = 4 << 20  # pages per gather buffer: small enough to stay in cache for the checksum pass


def _groups(counts: np.ndarray, max_pages: int) -> list[tuple[int, int]]:
    """Consecutive block ranges [lo, hi) of at most max_pages pages each (a bigger block alone)."""
    groups, lo, pages = [], 0, 0
    for i, n in enumerate(counts.tolist()):
        if i > lo and pages + n > max_pages:
            groups.append((lo, i))
            lo, pages = i, 0
        pages += n
    groups.append((lo, len(counts)))
    return groups


def _segment_sums(flat: np.ndarray, starts: np.ndarray, sizes: Sequence[int]) -> np.ndarray:
    """layout.checksum (sum64) of flat[start : start + size] for each segment, in one pass when every
    segment is a whole number of 8-byte words (KV blocks always are)."""
    sizes_np = np.asarray(sizes, dtype=np.int64)
    if sizes_np.size and (starts % 8 == 0).all() and (sizes_np % 8 == 0).all() and (sizes_np > 0).all():
        words = flat.view(np.uint64)
        edges = np.empty(2 * len(sizes_np), dtype=np.int64)
        edges[0::2], edges[1::2] = starts // 8, (starts + sizes_np) // 8
        if edges[-1] == words.size:  # reduceat's last segment runs to the end by itself
            edges = edges[:-1]
        return np.add.reduceat(words, edges, dtype=np.uint64)[0::2]
    return np.array([checksum(flat[s : s + n]) for s, n in zip(starts.tolist(), sizes)], dtype=np.uint64)


def _scattered_sums(flat: np.ndarray, starts: np.ndarray, sizes: Sequence[int]) -> np.ndarray:
    """_segment_sums of segments anywhere in `flat` (a whole slab). Segments sorted by start fall
    into clusters with at most SCATTER_GAP_BYTES between neighbours; each cluster is one reduceat
    over its stretch of the slab, so at most one gap per segment is read in vain."""
    sizes_np = np.asarray(sizes, dtype=np.int64)
    if not ((starts % 8 == 0).all() and (sizes_np % 8 == 0).all() and (sizes_np > 0).all()):
        return _segment_sums(flat, starts, sizes)
    order = np.argsort(starts, kind="stable")
    lo_b, hi_b = starts[order], starts[order] + sizes_np[order]
    breaks = (np.nonzero(lo_b[1:] - hi_b[:-1] > SCATTER_GAP_BYTES)[0] + 1).tolist()
    words = flat.view(np.uint64)
    sums = np.empty(len(order), dtype=np.uint64)
    for lo, hi in zip([0, *breaks], [*breaks, len(order)]):
        base, top = int(lo_b[lo]) // 8, int(hi_b[lo:hi].max()) // 8
        if top >= words.size:  # reduceat needs one word past every segment: none at the slab's end
            sums[order[lo:hi]] = _segment_sums(flat, lo_b[lo:hi], sizes_np[order[lo:hi]].tolist())
            continue
        edges = np.empty(2 * (hi - lo), dtype=np.int64)
        edges[0::2], edges[1::2] = lo_b[lo:hi] // 8 - base, hi_b[lo:hi] // 8 - base
        sums[order[lo:hi]] = np.add.reduceat(words[base : top + 1], edges, dtype=np.uint64)[0::2]
    return sums


class SlabReader:
    """A read-only view of a daemon's host slab, for worker processes on the same host."""

    def __init__(self, path: str) -> None:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise NotFound(f"slab {path} does not exist") from None
        try:
            size = os.fstat(fd).st_size
            if size < GENERATIONS_OFFSET:
                raise InvalidArgument(f"{path} is not a tiercache slab: bytes={size}")
            self._mmap = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        magic, version, _, page_bytes, num_pages, header_bytes = HEADER.unpack_from(self._mmap, 0)
        problem = _header_problem(size, magic, version, page_bytes, num_pages, header_bytes)
        if problem:
            self._mmap.close()
            raise InvalidArgument(f"{path} is not a valid tiercache slab: {problem}")
        self.path = path
        self.page_bytes: int = page_bytes
        self.num_pages: int = num_pages
        self.header_bytes: int = header_bytes
        self._generations, pages = _views(self._mmap, page_bytes, num_pages)
        self._pool = PagePool(pages)
        # For read_many: the generations and the pages as numpy arrays (gathered and compared at once).
        self._generations_np = np.frombuffer(self._generations, dtype=np.int64)
        self._pages_np = pages.numpy()

    def read(self, pages: Sequence[int], generations: Sequence[int], nbytes: int,
             out: torch.Tensor | None = None) -> torch.Tensor | None:
        """Copy a block located by HostTier.locate into `out` (any contiguous CPU tensor of nbytes
        bytes) or a new uint8 tensor, and return it; None if a page changed since it was located
        (the block was evicted or overwritten: ask the daemon again). InvalidArgument for pages,
        generations, nbytes or out that cannot describe a block of this slab."""
        if len(pages) != len(generations):
            raise InvalidArgument(f"{len(pages)} pages but {len(generations)} generations")
        if nbytes < 0 or pages_for(nbytes, self.page_bytes) != len(pages):
            raise InvalidArgument(f"nbytes={nbytes} does not fill {len(pages)} pages of {self.page_bytes} bytes")
        if not all(isinstance(p, int) and 0 <= p < self.num_pages for p in pages):
            raise InvalidArgument(f"page index out of range [0, {self.num_pages}) in {list(pages)}")
        if not all(isinstance(g, int) for g in generations):
            raise InvalidArgument("generations must be integers")
        if out is None:
            out = flat = torch.empty(nbytes, dtype=torch.uint8)
        elif out.device.type != "cpu" or not out.is_contiguous() or out.nbytes != nbytes:
            raise InvalidArgument(f"out must be a contiguous CPU tensor of {nbytes} bytes, got "
                                  f"{out.device} {tuple(out.shape)} {out.dtype}")
        else:
            flat = out if out.dtype == torch.uint8 and out.dim() == 1 else out.view(-1).view(torch.uint8)
        self._pool.gather(pages, flat)
        # Read after the copy: an unchanged even generation proves no write touched the page meanwhile.
        now = self._generations
        if any(g % 2 or now[p] != g for p, g in zip(pages, generations)):
            return None
        return out

    def read_many(self, blocks: Sequence[tuple[Sequence[int], Sequence[int], int]],
                  checksums: Sequence[int] | None = None) -> list[torch.Tensor | None]:
        """Copy several located blocks, each given as (pages, generations, nbytes), out of the slab;
        a uint8 tensor per block, None for a block whose pages changed since it was located (see
        read) or, with `checksums`, whose bytes fail theirs (sum64). Same InvalidArgument checks as
        read. The returned tensors are views into a few shared buffers (one per READ_GROUP_BYTES).

        The work is a fixed number of numpy calls per group, not per block: one gather of all the
        pages, one segmented sum for the checksums, one comparison of all the generations. At 64 KiB
        blocks the per-block Python of a block-at-a-time copy cost more than the copy itself."""
        if not blocks:
            return []
        all_pages, expected, counts, first_page = self._descriptors(blocks)
        outs: list[torch.Tensor] = []
        intact = np.ones(len(blocks), dtype=bool)
        for lo, hi in _groups(counts, max(1, READ_GROUP_BYTES // self.page_bytes)):
            p0, p1 = int(first_page[lo]), int(first_page[hi - 1] + counts[hi - 1])
            gathered = self._pages_np[all_pages[p0:p1]]  # fancy indexing: 4x faster than np.take(out=)
            flat = torch.from_numpy(gathered).view(-1)
            starts = (first_page[lo:hi] - p0) * self.page_bytes
            outs += [flat[start : start + b[2]] for start, b in zip(starts.tolist(), blocks[lo:hi])]
            if checksums is not None:
                intact[lo:hi] = _segment_sums(gathered.reshape(-1), starts, [b[2] for b in blocks[lo:hi]]) == \
                    np.array(checksums[lo:hi], dtype=np.uint64)
        # Read after the copies: an unchanged even generation proves no write touched the page meanwhile.
        intact &= self._unchanged_blocks(all_pages, expected, counts, first_page)
        return [out if ok else None for out, ok in zip(outs, intact.tolist())]

    def view_many(self, blocks: Sequence[tuple[Sequence[int], Sequence[int], int]],
                  checksums: Sequence[int]) -> list[torch.Tensor | None]:
        """read_many without the copy: a block in one run of pages comes as a read-only view into
        the slab (others are gathered), checked against its checksum and generations now. The daemon
        may recycle those pages at any time after: the caller reads the views (copies them where it
        needs them) and then calls unchanged(pages, generations) for all of them; if that is False,
        what it read may be another block's bytes and must be discarded."""
        if not blocks:
            return []
        all_pages, expected, counts, first_page = self._descriptors(blocks)
        flat, page_bytes = self._pool.flat, self.page_bytes
        outs: list[torch.Tensor] = []
        runs: list[int] = []  # blocks viewed in place, summed together below
        sums = np.zeros(len(blocks), dtype=np.uint64)
        for b, (pages, _, nbytes) in enumerate(blocks):
            if nbytes and is_run(pages):
                outs.append(flat[pages[0] * page_bytes : pages[0] * page_bytes + nbytes])
                runs.append(b)
            else:
                out = torch.empty(nbytes, dtype=torch.uint8)
                if nbytes:
                    self._pool.gather(pages, out)
                outs.append(out)
                sums[b] = checksum(out)
        if runs:
            starts = all_pages[first_page[runs]] * page_bytes
            sums[runs] = _scattered_sums(self._pages_np.reshape(-1), starts, [blocks[b][2] for b in runs])
        intact = sums == np.array(checksums, dtype=np.uint64)
        intact &= self._unchanged_blocks(all_pages, expected, counts, first_page)
        return [out if ok else None for out, ok in zip(outs, intact.tolist())]

    def unchanged(self, pages: np.ndarray, generations: np.ndarray) -> bool:
        """Whether every page still carries its (even) generation: nothing was written to or freed
        from them since. False once the reader is closed."""
        now = self._generations_np
        return now is not None and bool(((now[pages] == generations) & (generations % 2 == 0)).all())

    def _descriptors(self, blocks: Sequence[tuple[Sequence[int], Sequence[int], int]]
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Checked descriptors as arrays: every page, its generation, pages per block and the index
        of each block's first page in the first two. InvalidArgument for what cannot be a block here."""
        page_bytes = self.page_bytes
        for i, (pages, generations, nbytes) in enumerate(blocks):
            if len(pages) != len(generations):
                raise InvalidArgument(f"block {i}: {len(pages)} pages but {len(generations)} generations")
            if nbytes < 0 or -(-nbytes // page_bytes) != len(pages):
                raise InvalidArgument(f"block {i}: nbytes={nbytes} does not fill {len(pages)} pages of {page_bytes} bytes")
        try:
            all_pages = np.fromiter((p for b in blocks for p in b[0]), dtype=np.int64)
            expected = np.fromiter((g for b in blocks for g in b[1]), dtype=np.int64)
        except (TypeError, ValueError, OverflowError):
            raise InvalidArgument("pages and generations must be integers") from None
        if all_pages.size and (all_pages.min() < 0 or all_pages.max() >= self.num_pages):
            raise InvalidArgument(f"page index out of range [0, {self.num_pages})")
        counts = np.fromiter((len(b[0]) for b in blocks), dtype=np.int64, count=len(blocks))
        first_page = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)
        return all_pages, expected, counts, first_page

    def _unchanged_blocks(self, all_pages: np.ndarray, expected: np.ndarray, counts: np.ndarray,
                          first_page: np.ndarray) -> np.ndarray:
        """Per block: every one of its pages still carries its even generation."""
        changed = (self._generations_np[all_pages] != expected) | (expected % 2 == 1)
        changed_before = np.concatenate(([0], np.cumsum(changed)))  # changed pages before each page
        return changed_before[first_page + counts] == changed_before[first_page]

    def close(self) -> None:
        """Unmap the slab. Idempotent."""
        if getattr(self, "_pool", None) is None:
            return
        self._generations_np = self._pages_np = None  # type: ignore[assignment]
        self._generations.release()
        self._pool = None  # type: ignore[assignment]
        try:
            self._mmap.close()
        except BufferError:  # views from view_many are still alive: the mapping goes with the last one
            logger.debug("slab %s stays mapped until its last view is dropped", self.path)
