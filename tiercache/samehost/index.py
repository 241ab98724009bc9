"""The host tier's shared index: where each block of the slab lives, readable by same-host workers
without a call to the daemon.

Index file layout (little-endian), next to the slab in shm_dir, named like it with ".index":

    offset 0      header, 4096 bytes: magic b"TCINDEX1", version u32, daemon pid u32 (informational:
                  liveness is the daemon's flock on the file), num_buckets u64,
                  slots_per_bucket u64, max_extents u64, slot_bytes u64, presence_counters u64
    offset 4096   num_buckets x slots_per_bucket slots of SLOT (below)
    then          presence_counters u8 counters: a counting Bloom filter of every block the store
                  holds in any tier (4 counters per store key, from its bytes 8..24, saturating at 255)

A block lives in one of the slots of bucket (first 8 bytes of its store key as u64) mod num_buckets;
its pages are kept as extents (first page, page count) of consecutive pages, so a block of any size
is published as long as its pages form at most max_extents runs (the page allocator hands out runs:
see pages.py). A block that finds its bucket full, or whose pages form more runs, is not published
(readers then ask the daemon): counted in num_unpublished and logged. Each slot is a seqlock: the
daemon (the only writer, under the store's lock) makes `seq` odd, writes the slot, makes it even.
It publishes a block once its pages are written and unpublishes it before its pages are freed, so a
reader that sees one even `seq` before and after reading a slot and the slab generations of its
pages read consistent values of a live block; SlabReader's generation check after the copy then
proves the bytes (see host.py).

The presence filter lets a reader end a lookup without a call: a key whose counters are not all
non-zero is in no tier. Races with the daemon's updates only cost a miss or a call, never a wrong
block: a key missed that way is recomputed, a false "maybe" is asked of the daemon.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import struct
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from tiercache.block import META_FIELDS, BlockMeta, Kind
from tiercache.errors import InvalidArgument, NotFound
from tiercache.keys import KEY_BYTES
from tiercache.layout import DTYPES

logger = logging.getLogger(__name__)

MAGIC = b"TCINDEX1"
VERSION = 2  # 1 kept up to 16 page numbers per slot; 2 keeps extents
HEADER = struct.Struct("<8sIIQQQQQ")
HEADER_BYTES = 4096
SLOTS_PER_BUCKET = 8
MAX_EXTENTS = 8  # runs of consecutive pages per published block (the slot's 64 bytes, as 16 pages were)
PRESENCE_COUNTERS = 1 << 22  # 4 MiB: about 1 % false "maybe" at 400,000 blocks, more beyond
DTYPE_CODES = {name: i + 1 for i, name in enumerate(DTYPES)}  # 0: empty
DTYPE_NAMES = {code: name for name, code in DTYPE_CODES.items()}
# The meta fields a slot keeps (those META_FIELDS gives a slot type, of that type), in their order in
# the slot. The order is the layout of VERSION 2, which readers of an older daemon map: a field
# joins at the end, with VERSION + 1. Parent comes first after the key (see SLOT_META_SPAN).
SLOT_META = ("key", "parent", "namespace", "nbytes", "checksum", "num_tokens", "dtype", "shape")
_SLOTTED = {f.name: f for f in META_FIELDS if f.slot is not None}
assert set(SLOT_META) == set(_SLOTTED), f"SLOT_META {SLOT_META} must order the slotted fields {sorted(_SLOTTED)}"


def _slot_field(name: str) -> tuple[Any, ...]:
    slot = _SLOTTED[name].slot
    return (name, slot) if isinstance(slot, str) else (name, *(slot or ()))


def _field(dtype: np.dtype, name: str) -> tuple[np.dtype, int]:
    """The type and offset of a field of a structured numpy type."""
    assert dtype.fields is not None
    sub, offset = dtype.fields[name][:2]
    return sub, offset


SLOT = np.dtype([("seq", "<u8"), ("used", "<u4"), ("num_pages", "<u4"), *[_slot_field(name) for name in SLOT_META],
                 ("extents", "<u4", (MAX_EXTENTS, 2))], align=True)
# The slot bytes a client meta is made of besides its key: the meta fields after the key, back to
# back (client/fetch.py remembers metas by them; the parent's store key first).
_LAST, _LAST_AT = _field(SLOT, SLOT_META[-1])
SLOT_META_SPAN = (_field(SLOT, SLOT_META[1])[1], _LAST_AT + _LAST.itemsize)
assert SLOT_META_SPAN[1] - SLOT_META_SPAN[0] == sum(_field(SLOT, name)[0].itemsize for name in SLOT_META[1:])


def _struct_format(dtype: np.dtype, first: str) -> str:
    """The struct format of `dtype`'s fields from `first` on: a byte array as one bytes value, an array
    of numbers as that many values, padding skipped."""
    codes = {np.dtype("<u4"): "I", np.dtype("<u8"): "Q"}
    names = dtype.names or ()
    out, at = "<", _field(dtype, first)[1]
    for name in names[names.index(first):]:
        sub, offset = _field(dtype, name)
        out += f"{offset - at}x" if offset > at else ""
        count = int(np.prod(sub.shape))
        out += f"{count}s" if sub.base == np.uint8 else f"{count if count > 1 else ''}{codes[sub.base]}"
        at = offset + sub.itemsize
    return out


# A slot after its seq, for publish's one write.
_SLOT_BODY = struct.Struct(_struct_format(SLOT, "used"))
_SEQ = struct.Struct("<Q")
_EXTENTS, _EXTENTS_AT = _field(SLOT, "extents")
assert _SLOT_BODY.size == _EXTENTS_AT + _EXTENTS.itemsize - 8 and _field(SLOT, "used")[1] == 8  # all after seq
_SHAPE_DIMS = _field(SLOT, "shape")[0].shape[0]


def page_runs(pages: Iterable[int]) -> list[tuple[int, int]]:
    """`pages` as (first page, count) runs of consecutive pages, in order."""
    runs: list[tuple[int, int]] = []
    for page in pages:
        if runs and runs[-1][0] + runs[-1][1] == page:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((page, 1))
    return runs


def expand_pages(rows: np.ndarray, width: int) -> np.ndarray:
    """The pages of each slot of `rows` (a SLOT array) from its extents, as an (n, width) int64
    array: row i's first num_pages entries are its pages in order, the rest repeat its first page
    (a valid index whatever the slot holds: callers mask by num_pages). Extents of a slot that is
    being rewritten may be garbage: every page stays below the largest value found, never raises."""
    ext = rows["extents"].astype(np.int64)
    starts, counts = ext[:, :, 0], ext[:, :, 1]
    j = np.arange(width)
    if not counts[:, 1:].any():  # one run each: the usual case, one broadcast
        pages = starts[:, :1] + j
    else:
        ends = np.cumsum(counts, axis=1)
        run = np.minimum((j[None, :, None] >= ends[:, None, :]).sum(axis=2), MAX_EXTENTS - 1)
        pages = np.take_along_axis(starts, run, 1) + j - np.take_along_axis(ends - counts, run, 1)
    return np.where(j < rows["num_pages"].astype(np.int64)[:, None], pages, starts[:, :1])


_KEY_WORD = _field(SLOT, "key")[1] // 8  # the slot's u64 word where its key starts


def index_size(num_pages: int) -> tuple[int, int]:
    """(num_buckets, file bytes) for a slab of num_pages: two slots per page, as a power of two."""
    num_buckets = 1 << max(0, (2 * num_pages - 1) // SLOTS_PER_BUCKET).bit_length()
    return num_buckets, HEADER_BYTES + num_buckets * SLOTS_PER_BUCKET * SLOT.itemsize + PRESENCE_COUNTERS


def _presence(buf: mmap.mmap, num_buckets: int) -> np.ndarray:
    return np.frombuffer(buf, dtype=np.uint8, count=PRESENCE_COUNTERS,
                         offset=HEADER_BYTES + num_buckets * SLOTS_PER_BUCKET * SLOT.itemsize)


def _counters(key: bytes) -> np.ndarray:
    """The presence counters of a store key (it is a hash already: its bytes are the hash functions)."""
    return np.frombuffer(key, dtype="<u4", count=4, offset=8) & np.uint32(PRESENCE_COUNTERS - 1)


_COUNTER_WORDS = struct.Struct("<4I")  # a store key's bytes 8..24: see _counters


def _slots(buf: mmap.mmap, num_buckets: int) -> np.ndarray:
    return np.frombuffer(buf, dtype=SLOT, count=num_buckets * SLOTS_PER_BUCKET,
                         offset=HEADER_BYTES).reshape(num_buckets, SLOTS_PER_BUCKET)


def _bucket(key: bytes, num_buckets: int) -> int:
    return int.from_bytes(key[:8], "little") & (num_buckets - 1)


class HostIndex:
    """The daemon's side: publish and unpublish blocks of the slab (the caller serialises calls)."""

    def __init__(self, buf: mmap.mmap, num_pages: int) -> None:
        self._buf = buf
        self.num_buckets, _ = index_size(num_pages)
        self._slots: np.ndarray | None = _slots(buf, self.num_buckets)  # None once closed
        self._fields = {name: self._slots[name] for name in SLOT.names or ()}  # views made once
        self._where: dict[bytes, tuple[int, int]] = {}  # store key -> (bucket, slot)
        self._presence: np.ndarray | None = _presence(buf, self.num_buckets)
        HEADER.pack_into(buf, 0, b"\0" * 8, VERSION, os.getpid(), self.num_buckets, SLOTS_PER_BUCKET, MAX_EXTENTS,
                         SLOT.itemsize, PRESENCE_COUNTERS)
        buf[:8] = MAGIC  # last: a reader never trusts a half-written header
        self.num_unpublished = 0  # blocks readers must ask the daemon for (bucket full, too many runs)
        self._withheld: set[bytes] = set()  # blocks with a TTL: never published (see withhold)

    def present(self, key: bytes, delta: int) -> None:
        """A block of the store (any tier) came (+1) or went (-1). Counters stop at 255 for good:
        a saturated one must never reach 0 while a key behind it is still there."""
        presence = self._presence
        if presence is None:  # closed
            return
        # The counters of _counters, one by one in Python: numpy's fancy indexing cost ~10x more
        # on every Put. A counter two of them share changes once, as with fancy indexing.
        for at in dict.fromkeys(word & (PRESENCE_COUNTERS - 1) for word in _COUNTER_WORDS.unpack_from(key, 8)):
            count = int(presence[at])
            if count < 255:
                presence[at] = min(255, max(0, count + delta))

    def withhold(self, key: bytes) -> None:
        """Keep `key` out of the index (now and when it comes back into host) until release(key):
        readers cannot see a TTL expire, so such blocks are served by the daemon only."""
        self._withheld.add(key)
        self.unpublish(key)

    def release(self, key: bytes) -> None:
        self._withheld.discard(key)

    def saturate_presence(self) -> None:
        """Every presence counter to 255, for good: every key is a "maybe", so readers ask the daemon
        about each key their read of the index misses (saturated counters never come down)."""
        if self._presence is not None:
            self._presence[:] = 255

    def publish(self, meta: BlockMeta, pages: Sequence[int]) -> bool:
        code = DTYPE_CODES.get(meta.dtype)
        if self._slots is None or meta.key in self._withheld:  # closed, or a block with a TTL
            return False
        if meta.key in self._where:
            return False
        runs = page_runs(pages)
        if len(runs) > MAX_EXTENTS or code is None or len(meta.shape) != _SHAPE_DIMS:
            return self._unpublished(meta, f"its pages form {len(runs)} runs, more than {MAX_EXTENTS}"
                                     if len(runs) > MAX_EXTENTS else "its dtype or shape has no slot encoding")
        bucket = _bucket(meta.key, self.num_buckets)
        used = self._fields["used"][bucket].tolist()
        if 0 not in used:
            return self._unpublished(meta, "its bucket is full")
        try:
            # The fields of SLOT_META in its order, written out: through the table (a conversion per
            # field) this took half as long again. tests/test_block_fields.py reads every one back.
            body = _SLOT_BODY.pack(1, len(pages), meta.key, meta.parent, meta.namespace, meta.nbytes, meta.checksum,
                                   meta.num_tokens, code, *meta.shape, *(x for run in runs for x in run),
                                   *(0,) * (2 * (MAX_EXTENTS - len(runs))))
        except struct.error:  # a field wider than the slot's (a token count past 2**32)
            return self._unpublished(meta, "a field is wider than the slot's")
        # The lowest free slot, always: then an unpublished slot that still holds a key's bytes never
        # comes before that key's live slot, and readers, which take the first slot whose key word
        # matches, find the live one (tests/test_host_index.py::test_a_key_put_again_...).
        at = (bucket, used.index(0))
        # The whole slot in one write between the two seq writes (field by field through numpy took
        # ~15 calls per promoted block). Stores reach readers in program order on x86; a weakly
        # ordered CPU would need a barrier here, as it did for the numpy writes.
        offset = HEADER_BYTES + (bucket * SLOTS_PER_BUCKET + at[1]) * SLOT.itemsize
        seq = int(self._fields["seq"][at])
        _SEQ.pack_into(self._buf, offset, seq + 1)  # odd: readers skip the slot while it changes
        self._buf[offset + 8 : offset + 8 + len(body)] = body
        _SEQ.pack_into(self._buf, offset, seq + 2)  # even: the slot describes a live block
        self._where[meta.key] = at
        return True

    def _unpublished(self, meta: BlockMeta, why: str) -> bool:
        """Count a block same-host readers will have to ask the daemon for, and say why (the first
        time, then every 1,000th: a fast path that does not apply is never silent)."""
        self.num_unpublished += 1
        if self.num_unpublished % 1000 == 1:
            logger.warning("shared index: block %s (bytes=%d) not published, so same-host readers ask the "
                           "daemon for it: %s (unpublished so far: %d)", meta.key.hex()[:16], meta.nbytes, why,
                           self.num_unpublished)
        return False

    def unpublish(self, key: bytes) -> None:
        at = self._where.pop(key, None)
        if at is None or self._slots is None:
            return
        f = self._fields
        f["seq"][at] += 1
        f["used"][at] = 0
        f["seq"][at] += 1

    def close(self) -> None:
        """Make the index unusable for readers that still map it (their lookups find nothing)."""
        self._buf[:8] = b"\0" * 8
        self._fields["seq"][...] |= 1
        self._fields = {}
        self._slots = self._presence = None


def map_shared(path: str, what: str, min_bytes: int, *, writable: bool = False) -> mmap.mmap:
    """Map a daemon's shared-memory file, read-only unless `writable`: NotFound if it is gone,
    InvalidArgument if it is shorter than min_bytes (then it is not a `what` at all) or this process
    may not open it so."""
    try:
        fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
    except FileNotFoundError:
        raise NotFound(f"{what} {path} does not exist") from None
    except PermissionError:
        raise InvalidArgument(f"{what} {path} is not {'writable' if writable else 'readable'} by this process "
                              "(another user?)") from None
    try:
        size = os.fstat(fd).st_size
        if size < min_bytes:
            raise InvalidArgument(f"{path} is not a tiercache {what}: bytes={size}")
        # MAP_POPULATE: page tables filled once, now, not by a fault at the first touch of each page
        # (147 MB of first writes into reserved room cost three times their copy).
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), prot=prot)
    finally:
        os.close(fd)


class IndexReader:
    """A worker's read-only view of the daemon's index."""

    def __init__(self, path: str) -> None:
        self._buf = map_shared(path, "index", HEADER_BYTES)
        size = len(self._buf)
        self._lock_fd = os.open(path, os.O_RDONLY)  # to probe the daemon's lock (see live)
        magic, version, self.pid, num_buckets, per_bucket, max_extents, slot_bytes, counters = \
            HEADER.unpack_from(self._buf, 0)
        expected = HEADER_BYTES + num_buckets * SLOTS_PER_BUCKET * SLOT.itemsize + PRESENCE_COUNTERS
        if (magic, version, per_bucket, max_extents, slot_bytes, counters) != (
                MAGIC, VERSION, SLOTS_PER_BUCKET, MAX_EXTENTS, SLOT.itemsize, PRESENCE_COUNTERS) or size != expected \
                or num_buckets < 1 or num_buckets & (num_buckets - 1):
            self._buf.close()
            os.close(self._lock_fd)
            raise InvalidArgument(f"{path} is not a valid tiercache index (magic {magic!r}, version {version}, "
                                  f"bytes={size})")
        self.path = path
        self.num_buckets = num_buckets
        self._slots: np.ndarray | None = _slots(self._buf, num_buckets)  # None once closed
        # Plain views of the slots, made once: numpy indexes a plain dtype several times faster
        # than a structured one. _words: each slot as u64 words (flat slot numbers); _seq: each
        # slot's seq; _probe: each bucket's slots' key bytes 8..16, enough to pick the slot of a key.
        num_slots, words = num_buckets * SLOTS_PER_BUCKET, SLOT.itemsize // 8
        self._words = np.frombuffer(self._buf, dtype="<u8", count=num_slots * words,
                                    offset=HEADER_BYTES).reshape(num_slots, words)
        self._seq = self._words[:, 0]
        self._probe = self._words[:, _KEY_WORD + 1].reshape(num_buckets, SLOTS_PER_BUCKET)
        self._presence: np.ndarray | None = _presence(self._buf, num_buckets)
        # The last prefix find() found: (its keys joined, its slots' rows, where they are, their
        # seqs). A worker finds the same chain again and again (its lookup, then its fetch; the
        # next request's system prompt): while none of those slots has changed, that is the answer.
        self._last: tuple[bytes, np.ndarray, np.ndarray, np.ndarray, list[int]] | None = None

    def find(self, store_keys: Sequence[bytes], generations: np.ndarray
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The slots of the longest prefix of `store_keys` published now (a structured SLOT array),
        their pages (expand_pages: an (n, width) array, width the most pages of any of them) and the
        generations of those pages read from the slab's `generations` while the slots were stable.
        Vectorised: a fixed number of numpy calls whatever the key count."""
        if not store_keys or self._slots is None:
            return np.empty(0, dtype=SLOT), np.empty((0, 1), dtype=np.int64), np.empty((0, 1), dtype=np.int64)
        n = len(store_keys)
        joined = b"".join(store_keys)
        last = self._last
        if last is not None and last[0] == joined:
            rows, pages, at, seqs = last[1], last[2], last[3], last[4]
            gens = np.take(generations, pages, mode="clip")
            # Read after the generations, as find reads `after`: a seq that moved since the slot
            # was found (every change moves it, through an odd value) means it may hold another block now.
            if self._seq[at].tolist() == seqs:
                return rows, pages, gens
        keys = np.frombuffer(joined, dtype="<u8").reshape(n, 4)
        buckets = (keys[:, 0] & np.uint64(self.num_buckets - 1)).view(np.int64)
        # Pick each key's slot by 8 of its key bytes, then copy that slot whole between two reads of
        # its seq and check the whole key in the copy: a slot that changed meanwhile (or is being
        # changed), or holds another key, counts as absent.
        at = buckets * SLOTS_PER_BUCKET + (self._probe[buckets] == keys[:, 1:2]).argmax(axis=1)
        before = self._seq[at]
        words = self._words[at]
        rows = np.frombuffer(words, dtype=SLOT)
        # Checked on lists first: comparing whole lists is one C loop, a numpy call costs more for a few keys.
        if words[:, _KEY_WORD : _KEY_WORD + 4].tobytes() == joined and rows["used"].tolist() == [1] * n:
            keyed = None
            width = int(rows["num_pages"].max())
        else:
            keyed = (words[:, _KEY_WORD : _KEY_WORD + 4] == keys).all(axis=1) & (rows["used"] == 1)
            width = int(rows["num_pages"][keyed].max()) if keyed.any() else 1
        # A slot changing under the copy may claim any page count: the slab bounds it.
        pages = expand_pages(rows, max(1, min(width, generations.size)))
        gens = np.take(generations, pages, mode="clip")  # garbage stays in range
        after = self._seq[at]
        seqs = before.tolist()
        if keyed is None and seqs == after.tolist() == words[:, 0].tolist() and not any(seq & 1 for seq in seqs):
            self._last = (joined, rows, pages, at, seqs)
            return rows, pages, gens
        found = keyed if keyed is not None else np.ones(n, dtype=bool)
        found &= (before == after) & (words[:, 0] == before) & (before % 2 == 0)
        n = int(found.argmin()) if not found.all() else n
        if n:
            self._last = (joined[: n * KEY_BYTES], rows[:n], pages[:n], at[:n], seqs[:n])
        return rows[:n], pages[:n], gens[:n]

    def present_prefix(self, store_keys: Sequence[bytes]) -> int:
        """How many of `store_keys`, in a row from the first, maybe_present says may be present;
        one numpy pass for the whole list."""
        presence = self._presence
        if presence is None or not store_keys:
            return len(store_keys)
        words = np.frombuffer(b"".join(store_keys), dtype="<u4").reshape(len(store_keys), 8)[:, 2:6]
        ok = presence[words & np.uint32(PRESENCE_COUNTERS - 1)].all(axis=1)
        return len(store_keys) if ok.all() else int(ok.argmin())

    def maybe_present(self, store_key: bytes) -> bool:
        """False: the block is in no tier of the store (now). True: it may be; ask the daemon."""
        return self._presence is None or bool(self._presence[_counters(store_key)].all())

    def live(self) -> bool:
        """Whether the daemon that writes this index still runs and has not closed it: a dead one's
        mapping would keep serving (correct) blocks the next daemon no longer has. The daemon holds
        an exclusive lock on the file while it lives: if a shared one can be had, it is gone."""
        if self._slots is None or self._buf[:8] != MAGIC:
            return False
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
        return False

    def close(self) -> None:
        if self._slots is not None:
            os.close(self._lock_fd)
            del self._seq, self._words, self._probe  # views of the mapping; find() reads them only while _slots is set
        self._slots = self._presence = None
        try:
            self._buf.close()
        except BufferError:
            pass


def _byte_values(column: np.ndarray) -> list[bytes]:
    """Each row's bytes; equal ones as one object (a chain's blocks share one namespace)."""
    raw, width = column.tobytes(), column.nbytes // max(1, len(column))
    seen: dict[bytes, bytes] = {}
    return [seen.setdefault(part, part) for part in (raw[i : i + width] for i in range(0, len(raw), width))]


def _dtype_names(column: np.ndarray) -> list[str]:
    return [DTYPE_NAMES[code] for code in column.tolist()]


def _dims_values(column: np.ndarray) -> list[tuple[int, ...]]:
    return list(map(tuple, column.tolist()))


_FROM_SLOT: dict[Kind, Callable[[np.ndarray], list[Any]]] = {
    Kind.KEY: _byte_values, Kind.LINK: _byte_values, Kind.COUNT: np.ndarray.tolist, Kind.DTYPE: _dtype_names,
    Kind.DIMS: _dims_values}
# The fields a meta read from a slot takes from the reader: a slot keeps store keys, the reader's
# are client keys. The others come from the slot (from_slot), or take their defaults.
_SUPPLIED = ("key", "parent")
_READ = tuple(f for f in META_FIELDS if f.from_slot)
assert {f.name for f in META_FIELDS if f.slot is not None and not f.from_slot} == set(_SUPPLIED)


def slot_metas(slots: np.ndarray, keys: Sequence[bytes], parents: Sequence[bytes]) -> list[BlockMeta]:
    """The BlockMeta of each found slot of `slots` (a SLOT array), with the caller's client keys and
    parents (preview not kept); each field read once for all of them: reading the fields of one slot
    at a time costs ~15 us a block."""
    if any(len(key) != KEY_BYTES for key in keys) or any(parent and len(parent) != KEY_BYTES for parent in parents):
        raise InvalidArgument(f"block keys and parents must be {KEY_BYTES} bytes")
    columns = {f.name: _FROM_SLOT[f.kind](slots[f.name]) for f in _READ}
    # The slot's own fields are 32 bytes and unsigned, the reader's keys checked above: nothing to check.
    return BlockMeta.checked_already_columns({**columns, "key": keys, "parent": parents})
