"""SlabReader: a worker's read-only view of the daemon's host slab (the file layout and the seqlock
protocol are described in samehost/slab.py)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from functools import partial
from itertools import accumulate

import numpy as np
import torch

from tiercache.errors import InvalidArgument
from tiercache.layout import checksum, xxh3_64
from tiercache.page_pool import PagePool, is_run, pages_for
from tiercache.samehost.index import map_shared, page_runs
from tiercache.samehost.slab import GENERATIONS_OFFSET, slab_geometry, slab_views

logger = logging.getLogger(__name__)

BIG_BLOCK_BYTES = 256 << 10  # read_many copies blocks this big one by one (see _read_runs)
READ_GROUP_BYTES = 2 << 20  # pages per gather buffer: small enough to stay in cache for the checksum pass
INTO_PIECE_BYTES = 256 << 10  # read_into copies and hashes this much at a time, while it is in cache
# A block located in the slab: (its pages, their generations, nbytes); the pages and generations as
# any sequence of ints, or int arrays (what a client's read of the shared index finds).
Located = tuple[Sequence[int] | np.ndarray, Sequence[int] | np.ndarray, int]
# Where read_into puts a block: one flat uint8 array, or the caller's layout (pieces in payload order).
Destination = np.ndarray | Sequence[np.ndarray]


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
    """layout.checksum (XXH3-64) of flat[start : start + size] for each segment, as uint64."""
    return np.fromiter((checksum(flat[s : s + n]) for s, n in zip(starts.tolist(), sizes)), dtype=np.uint64,
                       count=len(sizes))


def _in_runs(all_pages: np.ndarray, counts: np.ndarray, first_page: np.ndarray) -> np.ndarray:
    """Per block (counts[b] >= 1 pages from first_page[b] in all_pages): whether its pages are consecutive."""
    breaks = np.concatenate(([0], np.cumsum(np.diff(all_pages) != 1)))  # pages not following their predecessor
    return breaks[first_page + counts - 1] == breaks[first_page]


class SlabReader:
    """A read-only view of a daemon's host slab, for worker processes on the same host."""

    def __init__(self, path: str) -> None:
        self._mmap = map_shared(path, "slab", GENERATIONS_OFFSET)
        page_bytes, num_pages, header_bytes = slab_geometry(self._mmap, path)
        self.path = path
        self.page_bytes: int = page_bytes
        self.num_pages: int = num_pages
        self.header_bytes: int = header_bytes
        self._generations, pages = slab_views(self._mmap, page_bytes, num_pages)
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

    def read_many(self, blocks: Sequence[Located],
                  checksums: Sequence[int] | None = None) -> list[torch.Tensor | None]:
        """Copy several located blocks, each given as (pages, generations, nbytes), out of the slab;
        a uint8 tensor per block, None for a block whose pages changed since it was located (see
        read) or, with `checksums`, whose bytes fail theirs. Same InvalidArgument checks as
        read. The returned tensors are views into a few shared buffers (one per READ_GROUP_BYTES).

        The copy is a fixed number of numpy calls per group, not per block: one gather of all the
        pages, then a checksum per block while the group is in cache, one comparison of all the
        generations. At 64 KiB blocks the per-block Python of a block-at-a-time copy cost more than
        the copy itself."""
        if not blocks:
            return []
        all_pages, expected, counts, first_page = self._descriptors(blocks)
        sizes = np.fromiter((b[2] for b in blocks), dtype=np.int64, count=len(blocks))
        if (sizes >= BIG_BLOCK_BYTES).all() and _in_runs(all_pages, counts, first_page).all():
            return self._read_runs(all_pages, expected, counts, first_page, sizes, checksums)
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

    def _read_runs(self, all_pages: np.ndarray, expected: np.ndarray, counts: np.ndarray, first_page: np.ndarray,
                   sizes: np.ndarray, checksums: Sequence[int] | None) -> list[torch.Tensor | None]:
        """read_many for big blocks that each lie in one run of pages: one copy per block straight
        into its own tensor (a plain memcpy, faster than a gather at these sizes), summed while the
        copy is still in cache."""
        flat, outs = self._pages_np.reshape(-1), []
        intact = np.ones(len(sizes), dtype=bool)
        for b, (start, nbytes) in enumerate(zip((all_pages[first_page] * self.page_bytes).tolist(), sizes.tolist())):
            # numpy, not torch: a third of the per-call cost (copy and sum are the same memcpy and loop).
            out = np.empty(nbytes, dtype=np.uint8)
            np.copyto(out, flat[start : start + nbytes])
            if checksums is not None:
                intact[b] = checksum(out) == checksums[b]
            outs.append(torch.from_numpy(out))
        intact &= self._unchanged_blocks(all_pages, expected, counts, first_page)
        return [out if ok else None for out, ok in zip(outs, intact.tolist())]

    def read_into(self, blocks: Sequence[Located], outs: Sequence[Destination],
                  checksums: Sequence[int]) -> list[bool]:
        """Copy each located block (pages, generations, nbytes) into its destination and verify it:
        per block, whether the bytes copied match its checksum and no page of it changed since it was
        located (else the destination holds bytes to discard). A destination is a writable uint8
        array of nbytes, or the caller's own layout: a list of arrays of any dtype and strides (the
        per-layer K and V slices of a paged pool) that take the block's bytes in order, together
        nbytes. Each piece is copied and hashed while it is in cache: the slab is read once, and the
        caller makes no second copy. Same InvalidArgument checks as read, and for a destination of
        another size."""
        if not blocks:
            return []
        all_pages, expected, counts, first_page = self._descriptors(blocks)
        intact = []
        for (pages, _, nbytes), out, want in zip(blocks, outs, checksums):
            if isinstance(out, np.ndarray):
                if out.size != nbytes:
                    raise InvalidArgument(f"an out of {out.size} bytes for a block of {nbytes}")
                intact.append(self._copy_flat(pages, nbytes, out) == want)
            else:
                given = sum(piece.nbytes for piece in out)
                if given != nbytes:
                    raise InvalidArgument(f"pieces of {given} bytes for a block of {nbytes}")
                intact.append(self._copy_pieces(pages, nbytes, out) == want)
        # Read after the copies: an unchanged even generation proves no write touched the page meanwhile.
        unchanged = self._unchanged_blocks(all_pages, expected, counts, first_page).tolist()
        return [a and b for a, b in zip(intact, unchanged)]

    def _copy_flat(self, pages: Sequence[int] | np.ndarray, nbytes: int, out: np.ndarray) -> int:
        """read_into's copy into one flat array, INTO_PIECE_BYTES at a time; the checksum of what it copied."""
        flat, page_bytes = self._pages_np.reshape(-1), self.page_bytes
        hasher, done = xxh3_64(), 0
        for first, count in page_runs(pages):
            size = min(count * page_bytes, nbytes - done)
            source = first * page_bytes
            for at in range(0, size, INTO_PIECE_BYTES):
                n = min(INTO_PIECE_BYTES, size - at)
                piece = out[done + at : done + at + n]
                np.copyto(piece, flat[source + at : source + at + n])
                hasher.update(piece)
            done += size
        return hasher.intdigest()

    def _copy_pieces(self, pages: Sequence[int] | np.ndarray, nbytes: int, pieces: Sequence[np.ndarray]) -> int:
        """read_into's copy into the caller's layout; the checksum of the slab bytes it copied, each
        piece hashed right after its copy read it (a block in several runs of pages is gathered first:
        two copies, which the allocator's runs make rare)."""
        page_bytes = self.page_bytes
        if is_run(list(pages)):
            start = int(pages[0]) * page_bytes
            source = self._pages_np.reshape(-1)[start : start + nbytes]
        else:
            source = np.empty(nbytes, dtype=np.uint8)
            self._copy_flat(pages, nbytes, source)
        hasher, at = xxh3_64(), 0
        for piece in pieces:
            chunk = source[at : at + piece.nbytes]
            np.copyto(piece, chunk.view(piece.dtype).reshape(piece.shape))
            hasher.update(chunk)
            at += piece.nbytes
        return hasher.intdigest()

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
        sizes = np.fromiter((b[2] for b in blocks), dtype=np.int64, count=len(blocks))
        fast = self.view_runs(all_pages, expected, counts, sizes, np.array(checksums, dtype=np.uint64))
        if fast is not None:
            return fast
        flat, page_bytes = self._pool.flat, self.page_bytes
        outs = []
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
            sums[runs] = _segment_sums(self._pages_np.reshape(-1), starts, [blocks[b][2] for b in runs])
        intact = sums == np.array(checksums, dtype=np.uint64)
        intact &= self._unchanged_blocks(all_pages, expected, counts, first_page)
        return [out if ok else None for out, ok in zip(outs, intact.tolist())]

    def view_runs(self, all_pages: np.ndarray, expected: np.ndarray, counts: np.ndarray, sizes: np.ndarray,
                  checksums: np.ndarray) -> list[torch.Tensor | None] | None:
        """view_many for blocks given as arrays (every page and its generation, pages and bytes per
        block, checksums as uint64), when each lies in one run of pages: a few numpy and torch calls
        in all; None (nothing done) when one does not, or the arrays cannot describe blocks here."""
        page_bytes = self.page_bytes
        # Checked on lists: a list's C loops beat a numpy call each for the few blocks of a chain.
        page_list, count_list, size_list = all_pages.tolist(), counts.tolist(), sizes.tolist()
        if not count_list or not page_list or len(page_list) != sum(count_list) or expected.size != len(page_list) \
                or min(page_list) < 0 or max(page_list) >= self.num_pages or min(size_list) <= 0 \
                or [-(-size // page_bytes) for size in size_list] != count_list:
            return None
        first = page_list[0]
        if page_list == list(range(first, first + len(page_list))) \
                and [count * page_bytes for count in count_list[:-1]] == size_list[:-1]:
            outs = self._stretch_views(first, len(page_list), size_list, checksums, expected)
            if outs is not None:
                return outs
        return self._views_anywhere(all_pages, expected, counts, sizes, checksums)

    def _stretch_views(self, first: int, num_pages: int, sizes: list[int], checksums: np.ndarray,
                       expected: np.ndarray) -> list[torch.Tensor | None] | None:
        """view_runs of blocks back to back over num_pages pages from page first, as a chain put in one go
        usually is: one split, a checksum each; None unless every block is intact (view_runs then
        sorts the blocks out one by one)."""
        lo = first * self.page_bytes
        hi = lo + sum(sizes)
        # not split(): its Python wrapper costs more
        outs: list[torch.Tensor | None] = list(self._pool.flat[lo:hi].split_with_sizes(sizes))
        starts = np.fromiter(accumulate(sizes[:-1], initial=lo), dtype=np.int64, count=len(sizes))
        sums = _segment_sums(self._pages_np.reshape(-1), starts, sizes)
        # Read after the sums: an unchanged even generation proves no write touched the page meanwhile.
        now = self._generations_np[first : first + num_pages]
        generations = expected.tolist()
        if sums.tolist() == checksums.tolist() and now.tolist() == generations and not any(g & 1 for g in generations):
            return outs
        return None

    def _views_anywhere(self, all_pages: np.ndarray, expected: np.ndarray, counts: np.ndarray, sizes: np.ndarray,
                        checksums: np.ndarray) -> list[torch.Tensor | None] | None:
        """view_runs of checked arrays, wherever the blocks lie."""
        page_bytes = self.page_bytes
        ends = np.cumsum(counts)
        first_page = ends - counts
        if all_pages.size != counts.size:  # some block has several pages: are they consecutive?
            steps = np.diff(all_pages) != 1
            steps[ends[:-1] - 1] = False  # from one block to the next any step will do
            if steps.any():
                return None
        starts = all_pages[first_page] * page_bytes
        size_list = sizes.tolist()
        gaps = starts[1:] - (starts[:-1] + sizes[:-1])
        if len(size_list) > 1 and (gaps < 0).any():  # not in slab order, or overlapping
            outs = self._run_views(starts, sizes)
            if outs is None:
                return None
        else:
            lo, hi = int(starts[0]), int(starts[-1]) + size_list[-1]
            stretch = self._pool.flat[lo:hi]
            if len(size_list) == 1 or not gaps.any():  # back to back
                outs = list(stretch.split_with_sizes(size_list))  # not split(): its Python wrapper costs more
            else:
                pieces = np.empty(2 * len(size_list) - 1, dtype=np.int64)
                pieces[0::2], pieces[1::2] = sizes, gaps
                outs = list(stretch.split_with_sizes(pieces.tolist())[0::2])
        sums = _segment_sums(self._pages_np.reshape(-1), starts, size_list)
        # Read after the sums: an unchanged even generation proves no write touched the page meanwhile.
        now = self._generations_np[all_pages]
        changed = (now != expected) | (expected % 2 == 1)
        intact = sums == checksums
        if intact.all() and not changed.any():
            return outs
        changed_before = np.concatenate(([0], np.cumsum(changed)))  # changed pages before each page
        intact &= changed_before[ends] == changed_before[first_page]
        return [out if ok else None for out, ok in zip(outs, intact.tolist())]

    def _run_views(self, starts: np.ndarray, sizes: np.ndarray) -> list[torch.Tensor | None] | None:
        """Views of blocks (each in one run of pages, in any order) that do not overlap, cut by one
        torch.split of the stretch that holds them all; None when some do overlap."""
        order = np.argsort(starts, kind="stable")
        lo, hi = starts[order], starts[order] + sizes[order]
        gaps = lo[1:] - hi[:-1]
        if (gaps < 0).any():
            return None  # the same block twice: not worth a special case
        pieces = np.empty(2 * len(order) - 1, dtype=np.int64)
        pieces[0::2], pieces[1::2] = sizes[order], gaps
        parts = self._pool.flat[int(lo[0]) : int(hi[-1])].split_with_sizes(pieces.tolist())
        views: list[torch.Tensor | None] = [None] * len(order)  # every one set below
        for rank, b in enumerate(order.tolist()):
            views[b] = parts[2 * rank]
        return views

    @property
    def generations(self) -> np.ndarray:
        """The slab's page generations, live (an int64 view of the mapping)."""
        return self._generations_np

    def sums_plan(self, all_pages: np.ndarray, counts: np.ndarray, sizes: np.ndarray) -> Callable[[], np.ndarray]:
        """A function returning the checksum of each block, as view_runs returned them (each in one
        run of pages: every page, pages and bytes per block), over the slab as it is when called:
        for a chain viewed again, whose placement has not changed, it is the whole checksum pass."""
        first = np.cumsum(counts) - counts
        return partial(_segment_sums, self._pages_np.reshape(-1), all_pages[first] * self.page_bytes, sizes.tolist())

    def unchanged(self, pages: np.ndarray, generations: np.ndarray) -> bool:
        """Whether every page still carries its (even) generation: nothing was written to or freed
        from them since. False once the reader is closed."""
        now = self._generations_np
        return now is not None and bool(((now[pages] == generations) & (generations % 2 == 0)).all())

    def _descriptors(self, blocks: Sequence[Located]
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Checked descriptors as arrays: every page, its generation, pages per block and the index
        of each block's first page in the first two. InvalidArgument for what cannot be a block here."""
        page_bytes = self.page_bytes
        for i, (pages, generations, nbytes) in enumerate(blocks):
            if len(pages) != len(generations):
                raise InvalidArgument(f"block {i}: {len(pages)} pages but {len(generations)} generations")
            if nbytes < 0 or -(-nbytes // page_bytes) != len(pages):
                raise InvalidArgument(f"block {i}: nbytes={nbytes} does not fill {len(pages)} pages of "
                                      f"{page_bytes} bytes")
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
        # Typed as always there: only unchanged() is called after close, and it checks; any other use
        # is a bug, which the None makes loud. A check on every read would cost more than it says.
        self._generations_np = self._pages_np = None  # type: ignore[assignment]  # see above
        with contextlib.suppress(BufferError):  # an array of it is still held: freed with that
            self._generations.release()
        self._pool = None  # type: ignore[assignment]  # as above; close() checks it, nothing else may
        try:
            self._mmap.close()
        except BufferError:  # views from view_many are still alive: the mapping goes with the last one
            logger.debug("slab %s stays mapped until its last view is dropped", self.path)
