"""Fetch responses on the client side: parsing them without copying records, and copying shared-memory
blocks out of the daemon's host slab."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeGuard

import numpy as np

from tiercache.block import Block, BlockMeta
from tiercache.client.disk_reader import DiskReader, disk_reader, release
from tiercache.client.views import ViewedChains
from tiercache.errors import InvalidArgument, TierCacheError
from tiercache.samehost.index import SLOT, SLOT_META_SPAN, slot_metas
from tiercache.v1 import tiercache_pb2 as pb
from tiercache.wire import read_varint, walk_fields

if TYPE_CHECKING:  # imported when first needed: only same-host callers map the slab
    import torch

    from tiercache.samehost.index import IndexReader
    from tiercache.samehost.reader import Destination, SlabReader

logger = logging.getLogger(__name__)

META_MEMO_BLOCKS = 1 << 14  # block metas kept per client: about 6 MiB at most


def _is_descriptor_message(data: bytes) -> bool:
    """Whether a serialized FetchResponse carries slab descriptors, not a record: it opens with the
    slab info (field 1) or its first block's body is a SlabBlock (field 3). Only FetchShared's reply
    mixes the two (a block the host tier could not hold), and it opens with the slab: the first tags
    decide the whole message without walking a multi-MiB record."""
    view = memoryview(data)
    if not len(view) or view[0] != 0x12:  # 0x12: field 2 (blocks), length-delimited
        return bool(len(view)) and view[0] == 0x0A  # 0x0A: field 1 (slab)
    try:
        _, pos = read_varint(view, 1)  # the block's length
        if pos < len(view) and view[pos] == 0x08:  # its index (absent when 0)
            _, pos = read_varint(view, pos + 1)
    except ValueError:
        return False
    return pos < len(view) and view[pos] == 0x1A  # 0x1A: field 3 (slab_block)


def parse_fetch_response(data: bytes) -> tuple[pb.SlabInfo | None, list[tuple[int, memoryview | pb.SlabBlock]]]:
    """A serialized FetchResponse as (slab, [(index, record view or SlabBlock)]); ValueError if malformed."""
    if _is_descriptor_message(data):
        # Descriptors are small: the C parser reads a batch of them far faster than a walk in Python.
        try:
            message = pb.FetchResponse.FromString(data)
        except Exception as e:  # noqa: BLE001 - protobuf's DecodeError differs by implementation
            raise ValueError(str(e)) from None
        slab = message.slab if message.HasField("slab") else None
        parsed: list[tuple[int, memoryview | pb.SlabBlock]] = []
        for fb in message.blocks:
            body = fb.WhichOneof("body")
            if body is None:
                raise ValueError(f"block {fb.index} has neither a record nor a slab descriptor")
            parsed.append((fb.index, fb.slab_block if body == "slab_block" else memoryview(fb.record)))
        return slab, parsed
    slab = None
    items: list[tuple[int, memoryview | pb.SlabBlock]] = []
    for number, value in walk_fields(memoryview(data)):
        if number == 1 and isinstance(value, memoryview):
            slab = pb.SlabInfo.FromString(bytes(value))
        elif number == 2 and isinstance(value, memoryview):
            index, body = 0, None
            for inner, item in walk_fields(value):
                if inner == 1 and isinstance(item, int):
                    index = item
                elif inner == 2 and isinstance(item, memoryview):
                    body = item
                elif inner == 3 and isinstance(item, memoryview):
                    body = pb.SlabBlock.FromString(bytes(item))
            if body is None:
                raise ValueError(f"block {index} has neither a record nor a slab descriptor")
            items.append((index, body))
    return slab, items


def _all_intact(payloads: list[torch.Tensor | None] | None) -> TypeGuard[list[torch.Tensor]]:
    """Whether a read or view of several blocks found every one intact (None marks one that was not)."""
    return payloads is not None and not any(p is None for p in payloads)  # not `None in`: a tensor's == is slow


def _meta_bytes(slots: np.ndarray) -> bytes:
    """The bytes of found slots that their metas are made of, besides the key (SLOT_META_SPAN: the
    parent's store key first)."""
    lo, hi = SLOT_META_SPAN
    raw = np.frombuffer(np.ascontiguousarray(slots), dtype=np.uint8).reshape(len(slots), SLOT.itemsize)
    return raw[:, lo:hi].tobytes()


class FetchedBlocks(list):
    """The blocks of one fetch (a list); those from Client.fetch_views may be views into the
    daemon's slab, valid only while still_valid() says so (see there)."""

    _watched: list[tuple[SlabReader, np.ndarray, np.ndarray]] | None = None

    def watch(self, reader: SlabReader, pages: np.ndarray, generations: np.ndarray) -> None:
        self._watched = (self._watched or []) + [(reader, pages, generations)]

    def still_valid(self) -> bool:
        """Whether no page under a viewed block has been written or recycled since the fetch: call
        it after the last read of the views; always True for copies."""
        return all(reader.unchanged(pages, generations)
                   for reader, pages, generations in self._watched or ())


class SlabCopier:
    """One client's view of the daemon's host slab: the mapped SlabReader (remapped when the daemon
    restarts with a new slab) and the copies of described blocks out of it."""

    def __init__(self) -> None:
        self._metas: dict[tuple, BlockMeta] = {}
        self._chains: dict[tuple, list[BlockMeta]] = {}  # chains found through the index: their metas
        self._chain_blocks = 0  # metas in _chains
        self._viewed = ViewedChains()  # chains viewed lately, for viewing again
        # The mapped slab and its index, as one pair replaced in one assignment: a thread reading
        # through the old pair keeps it (the mappings go when the last reference does).
        self._pair: tuple[SlabReader, IndexReader | None] | None = None
        # The daemon's disk tier, read here (see fetch_here): its reader, or (path, daemon pid)
        # until first needed.
        self._disk: DiskReader | tuple[str, int] | None = None
        self._held: list[DiskReader] = []  # every reader this client opened (a restart opens another)
        self.num_disk_blocks = 0  # blocks read straight from the daemon's disk tier
        self.usable = True  # False once the slab cannot be mapped: fetch bytes instead
        self.remote = False  # the daemon has a remote tier (SlabInfo.remote)
        self.staging_dir = ""  # SlabInfo.staging_dir of the slab mapped last

    @property
    def index(self) -> IndexReader | None:
        pair = self._pair
        return pair[1] if pair is not None else None

    def close(self) -> None:
        pair, self._pair, self._disk = self._pair, None, None
        self._viewed.clear()
        held, self._held = self._held, []
        for reader in held:
            release(reader)
        if pair is not None:
            for mapped in pair:
                if mapped is not None:
                    mapped.close()

    def reader(self, slab: pb.SlabInfo) -> SlabReader | None:
        """The reader of the announced slab; None (and usable = False) when it cannot be mapped."""
        from tiercache.samehost.reader import SlabReader  # only same-host callers need it

        pair = self._pair
        if pair is not None and pair[0].path == slab.path:
            return pair[0]
        self._pair = None  # a restarted daemon has a new slab; the old pair goes with its last user
        self._viewed.clear()  # (their views would keep the old slab mapped)
        try:
            reader = SlabReader(slab.path)
        except (TierCacheError, OSError) as e:
            # Same socket, different filesystem view (e.g. a container): stream bytes from now on.
            logger.warning("cannot map the daemon's slab %s (%s); fetching bytes instead", slab.path, e)
            self.usable = False
            return None
        if (reader.page_bytes, reader.header_bytes, reader.num_pages) != (
                slab.page_bytes, slab.header_bytes, slab.num_pages):
            reader.close()
            raise TierCacheError(f"slab {slab.path} geometry differs from what the daemon announced")
        index = self._open_index(slab.index_path)
        self.remote = slab.remote
        # Only with the index: the disk tier is for the same tokenless callers, and its pid tells
        # whether the daemon is this very process. Opened when first read (see _disk_reader): a
        # worker whose blocks stay in host never pays for it.
        self._disk = (slab.disk_path, index.pid) if index is not None and slab.disk_path else None
        self._pair = (reader, index)
        self.staging_dir = slab.staging_dir  # where staged Puts go (client.put); empty: none
        return reader

    def maybe_present(self, store_key: bytes) -> bool:
        """False only when the daemon's presence filter proves the block is in no tier."""
        index = self.index
        return index is None or index.maybe_present(store_key)

    def local_prefix(self, scoped: Sequence[bytes]) -> int:
        """How many blocks of the store keys `scoped` the shared index holds in a row, now."""
        found = self._find(scoped)
        return len(found[0]) if found is not None else 0

    def _find(self, scoped: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray, np.ndarray, SlabReader] | None:
        """(slots, their pages, those pages' generations, the reader they belong to) of the longest
        indexed prefix (see IndexReader.find); None without a live index, or without keys."""
        pair = self._pair
        if pair is None or not scoped:
            return None
        reader, index = pair
        if index is None:
            return None
        if not index.live():
            if self._pair is pair:
                self._pair = self._disk = None  # that daemon is gone: its slab is no one's cache any more
                self._viewed.clear()
            return None
        return (*index.find(scoped, reader.generations), reader)

    @staticmethod
    def _open_index(path: str) -> IndexReader | None:
        from tiercache.samehost.index import IndexReader

        if not path:
            return None
        try:
            return IndexReader(path)
        except (TierCacheError, OSError) as e:  # blocks then come through calls, as before
            logger.warning("cannot map the daemon's index %s (%s); asking the daemon instead", path, e)
            return None

    def local_fetch(self, keys: Sequence[bytes], scoped: Sequence[bytes], *, views: bool,
                    prefix: bool = False) -> FetchedBlocks | None:
        """The blocks of `keys` (store keys `scoped`) found through the shared index: copies, or with
        `views` read-only views (see view_many), each verified; None unless the index holds all of
        them intact right now (the caller then asks the daemon, which also promotes from disk), or
        with `prefix` those of the longest prefix it holds (None if one of them is not intact).
        Their metas carry no preview (the index does not keep it)."""
        found = self._find(scoped)
        num_hits = len(found[0]) if found is not None else 0
        if not keys or (num_hits < len(keys) and not prefix):
            return None
        if found is None or not num_hits:
            return FetchedBlocks()
        hits, pages, gens, reader = found
        counts = hits["num_pages"].astype(np.int64)
        count_list = counts.tolist()
        if count_list.count(count_list[0]) == len(count_list):  # all alike: no mask to build
            all_pages = pages[:, : count_list[0]].reshape(-1)
            expected = gens[:, : count_list[0]].reshape(-1)
        else:
            used = np.arange(pages.shape[1]) < counts[:, None]
            all_pages, expected = pages[used], gens[used]
        if views:
            return self._view(keys, scoped, hits, counts, all_pages, expected, reader)
        sizes = hits["nbytes"].astype(np.int64)
        bounds = np.cumsum(counts)[:-1]
        located = list(zip(np.split(all_pages, bounds), np.split(expected, bounds), sizes.tolist()))
        payloads = reader.read_many(located, checksums=hits["checksum"].tolist())
        if not _all_intact(payloads):
            return None
        return FetchedBlocks(map(Block, self._slot_metas(keys, scoped, hits), payloads))

    def _view(self, keys: Sequence[bytes], scoped: Sequence[bytes], hits: np.ndarray, counts: np.ndarray,
              all_pages: np.ndarray, expected: np.ndarray, reader: SlabReader) -> FetchedBlocks | None:
        """local_fetch's views of the slots `hits` (their pages and generations flattened): those
        of the longest prefix viewed lately and still intact again (ViewedChains.kept), the rest
        made and verified now (view_runs); None if one is not intact."""
        blocks = self._viewed.kept(keys, hits, expected, reader)
        m = len(blocks)
        if m < len(hits):
            first = int(counts[:m].sum())  # pages of the kept blocks
            rest = hits[m:]
            payloads = reader.view_runs(all_pages[first:], expected[first:], counts[m:],
                                        rest["nbytes"].astype(np.int64), rest["checksum"])
            if not _all_intact(payloads):
                return None
            blocks = [*blocks, *map(Block, self._slot_metas(keys, scoped, rest, m), payloads)]
            self._viewed.remember(keys, hits, counts, all_pages, expected, reader, blocks)
        fetched = FetchedBlocks(blocks)
        fetched.watch(reader, all_pages, expected)
        return fetched

    def disk_prefix(self, scoped: Sequence[bytes]) -> int:
        """How many of the store keys `scoped`, in a row, the daemon's disk tier holds for reading
        here (DiskReader.prefix); 0 without a reader."""
        disk = self._disk_reader()
        return disk.prefix(scoped[: self._present_prefix(scoped)]) if disk is not None else 0

    def _present_prefix(self, scoped: Sequence[bytes]) -> int:
        """How many of `scoped`, in a row, the presence filter says may be in the store. The disk
        tier is read only that far: a block the daemon dropped (evicted, flushed) may stay in LMDB
        a moment, or while a full disk holds its delete back, and is gone from the filter at once."""
        index = self.index
        return index.present_prefix(scoped) if index is not None else 0

    def _disk_reader(self) -> DiskReader | None:
        disk = self._disk
        if disk is not None and not isinstance(disk, tuple) and disk.pid != os.getpid():
            disk = self._disk = (disk.path, disk.daemon_pid)  # inherited across fork: this process opens its own
        if isinstance(disk, tuple):
            opened = disk_reader(*disk)
            if opened is not None:
                self._held.append(opened)  # released by close(): another thread may still read it
            if self._disk is disk:  # not replaced meanwhile by a restarted daemon's
                self._disk = opened
            return opened
        return disk

    def local_into(self, keys: Sequence[bytes], scoped: Sequence[bytes], outs: Sequence[Destination]
                   ) -> list[BlockMeta] | None:
        """The metas of the longest prefix of `keys` that the shared index holds and whose blocks
        were copied into `outs` (flat uint8 arrays, or pieces in the caller's layout) and verified in
        the same pass (SlabReader.read_into), up to the first that was not intact; None when the
        index holds none of them (ask the daemon)."""
        found = self._find(scoped[: len(outs)])
        if found is None or not len(found[0]):
            return None
        hits, pages, gens, reader = found
        counts = hits["num_pages"].tolist()
        sizes = hits["nbytes"].tolist()
        for i, (size, out) in enumerate(zip(sizes, outs)):
            given = out.size if isinstance(out, np.ndarray) else sum(piece.nbytes for piece in out)
            if given != size:
                raise InvalidArgument(f"outs[{i}] has {given} bytes, block {i} has {size}")
        located = [(row[:count], gen[:count], size) for row, gen, count, size in zip(pages, gens, counts, sizes)]
        intact = reader.read_into(located, outs, hits["checksum"].tolist())
        n = intact.index(False) if False in intact else len(intact)
        return self._slot_metas(keys, scoped, hits[:n]) if n else []

    def fetch_here(self, keys: Sequence[bytes], scoped: Sequence[bytes], *, views: bool) -> FetchedBlocks | None:
        """The blocks of `keys` without a call: those the shared index holds in a row (local_fetch),
        then those that follow read straight from the daemon's disk tier (verified copies); None
        unless that is the whole cached prefix: every key, or up to one the presence filter proves
        absent (else the daemon may hold more, pending or withheld, and is asked). One walk of the
        index; the disk tier is opened only when the index does not hold the whole chain."""
        blocks = self.local_fetch(keys, scoped, views=views, prefix=True)
        if blocks is None or len(blocks) == len(keys):
            return blocks
        disk = self._disk_reader()
        if disk is None:
            return None
        found = len(blocks)
        blocks.extend(disk.read(keys, scoped, found, found + self._present_prefix(scoped[found:])))
        end = len(blocks)
        if end == found or (end < len(keys) and self.maybe_present(scoped[end])):
            return None
        self.num_disk_blocks += end - found
        return blocks

    def _slot_metas(self, keys: Sequence[bytes], scoped: Sequence[bytes], hits: np.ndarray,
                    start: int = 0) -> list[BlockMeta]:
        """The client metas of found slots (those of keys[start:]), remembered like the daemon's (see
        _meta): a whole run of a chain under its keys and the slot bytes a meta is made of besides them."""
        n = len(hits)
        fields = _meta_bytes(hits)
        memo_key = (*keys[max(0, start - 1) : start + n], start > 0, fields)
        metas = self._chains.get(memo_key)
        if metas is None:
            # A slot names its parent by store key: the chain's own previous key means keys[i - 1].
            width = len(fields) // n
            linked = [start + i > 0 and fields[i * width : i * width + 32] == scoped[start + i - 1] for i in range(n)]
            metas = slot_metas(hits, keys[start : start + n],
                               [keys[start + i - 1] if linked[i] else b"" for i in range(n)])
            if self._chain_blocks + n > META_MEMO_BLOCKS:
                self._chains, self._chain_blocks = {}, 0
            self._chains[memo_key] = metas
            self._chain_blocks += n
        return list(metas)

    def copy_out(self, reader: SlabReader, described: list[tuple[int, pb.SlabBlock]], blocks: FetchedBlocks, *,
                 views: bool = False) -> None:
        """Copy the described blocks out of the slab (or, with `views`, take read-only views of them,
        which blocks.still_valid() checks later) and set blocks[index] to each one that is intact
        (its pages unchanged and its checksum right); the others stay None."""
        located = [(d.pages, d.generations, d.meta.nbytes) for _, d in described]
        checksums = [d.meta.checksum for _, d in described]
        try:
            if views:
                payloads = reader.view_many(located, checksums)
            else:
                payloads = reader.read_many(located, checksums=checksums)
        except TierCacheError as e:
            raise TierCacheError(f"daemon sent an unusable slab descriptor: {e}") from None
        viewed = []
        for (index, item), payload in zip(described, payloads):
            if payload is not None:  # pages unchanged and checksum right
                blocks[index] = Block(self._meta(item.meta), payload)
                viewed.append(item)
        if views and viewed:
            blocks.watch(reader, np.fromiter((p for d in viewed for p in d.pages), dtype=np.int64),
                         np.fromiter((g for d in viewed for g in d.generations), dtype=np.int64))

    def _meta(self, m: pb.BlockMeta) -> BlockMeta:
        """BlockMeta.from_wire, remembered: a worker fetches the same prefix again and again, and a key fixes
        its namespace (it is hashed into the key), hence its dtype and shape for a given size."""
        memo_key = (m.key, m.checksum, m.nbytes, m.parent, m.preview)
        meta = self._metas.get(memo_key)
        if meta is None:
            meta = BlockMeta.from_wire(m)
            if len(self._metas) >= META_MEMO_BLOCKS:
                self._metas.clear()
            self._metas[memo_key] = meta
        return meta
