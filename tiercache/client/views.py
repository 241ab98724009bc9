"""Views into the daemon's slab that a same-host client keeps between fetches: a worker fetches the
same prefix (a system prompt, a conversation so far) again and again, and while the blocks stay
where they were, the views and metas it made last time are right again; only their checksums and
page generations are read again (see ViewedChains.kept)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from tiercache.block import Block

if TYPE_CHECKING:  # the client imports it only when it maps a slab
    from tiercache.samehost.reader import SlabReader

VIEWED_CHAINS = 64  # chains kept per client
VIEWED_PER_FIRST_KEY = 8  # of which starting with the same key (one system prompt, several conversations)


def _common_prefix(a: Sequence[bytes], b: Sequence[bytes]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # one C loop: the usual case, a chain seen whole again
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i


class _Viewed:
    """One chain as a fetch returned it: its keys, the bytes of its index slots (pages, metas,
    checksums), its pages and their generations then, the blocks (views and metas) and a plan of
    the checksum pass over its blocks."""

    __slots__ = ("keys", "rows", "pages", "expected", "page_ends", "reader", "blocks", "sums", "checksums")

    def __init__(self, keys: list[bytes], hits: np.ndarray, counts: np.ndarray, pages: np.ndarray,
                 expected: np.ndarray, reader: SlabReader, blocks: list[Block]) -> None:
        self.keys, self.rows, self.reader, self.blocks = keys, hits.tobytes(), reader, blocks
        self.pages, self.expected, self.page_ends = pages, expected.copy(), np.cumsum(counts).tolist()
        self.sums: Callable[[], np.ndarray] = reader.sums_plan(pages, counts, hits["nbytes"].astype(np.int64))
        self.checksums: list[int] = hits["checksum"].tolist()

    def first(self, m: int, hits: np.ndarray, expected: np.ndarray, reader: SlabReader) -> list[Block] | None:
        """The first m blocks (whose keys the caller matched), if the first m of `hits` (the slots
        found now, `expected` the generations of their pages) are what they were, their checksums
        are still right, and no page of theirs changed while it was summed; else None."""
        pages = self.page_ends[m - 1]
        if reader is not self.reader or hits[:m].tobytes() != self.rows[: m * hits.itemsize] \
                or not np.array_equal(expected[:pages], self.expected[:pages]) \
                or self.sums()[:m].tolist() != self.checksums[:m]:
            return None
        # Read after the sums: an unchanged even generation proves no write touched the page meanwhile.
        if not reader.unchanged(self.pages[:pages], self.expected[:pages]):
            return None
        return self.blocks[:m]


class ViewedChains:
    """The chains a client viewed lately (see the module), found again by their first key."""

    def __init__(self) -> None:
        self._by_first: dict[bytes, list[_Viewed]] = {}
        self._count = 0

    def clear(self) -> None:
        """Forget every chain (their views keep the slab they point into mapped)."""
        self._by_first, self._count = {}, 0

    def kept(self, keys: Sequence[bytes], hits: np.ndarray, expected: np.ndarray, reader: SlabReader
             ) -> list[Block]:
        """The blocks of the longest prefix of `keys` that a kept chain shares and that is still
        intact (see _Viewed.first), found now as `hits` with page generations `expected` through
        `reader`; [] when none. A kept chain more than twice as long as the shared part is not
        used (its checksum pass would read more than it saves)."""
        best, m, found = None, 0, keys[: len(hits)]
        for viewed in self._by_first.get(keys[0], ()):
            shared = _common_prefix(found, viewed.keys)
            if shared > m and 2 * shared >= len(viewed.keys):
                best, m = viewed, shared
        if best is None:
            return []
        return best.first(m, hits, expected, reader) or []

    def remember(self, keys: Sequence[bytes], hits: np.ndarray, counts: np.ndarray, pages: np.ndarray,
                 expected: np.ndarray, reader: SlabReader, blocks: list[Block]) -> None:
        """Keep a chain just viewed, all of whose blocks were intact (the views in `blocks`)."""
        if self._count >= VIEWED_CHAINS:
            self.clear()
        chain = list(keys[: len(hits)])
        others = [v for v in self._by_first.get(chain[0], ()) if v.keys != chain][-(VIEWED_PER_FIRST_KEY - 1):]
        # A new list, not the old one changed: another thread may be walking that (kept).
        self._by_first[chain[0]] = [*others, _Viewed(chain, hits, counts, pages, expected, reader, list(blocks))]
        self._count = sum(map(len, self._by_first.values()))
