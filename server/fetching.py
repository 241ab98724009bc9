"""Fetch on the daemon side: records framed from the host slab, slab descriptors, store-key exports."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Sequence

from server.auth import TenantContext
from server.records import PAYLOAD_ALIGN, descriptor_frame, record_frame, slab_field
from tiercache.block import Block, BlockMeta
from tiercache.codec import plain_record_parts
from tiercache.config import Config
from tiercache.errors import CorruptBlock, DeadlineExceeded, NotFound
from tiercache.layout import checksum
from tiercache.record_header import plain_header
from tiercache.store import HostLocation, TieredStore
from tiercache.tiers.host import HostTier
from tiercache.v1 import tiercache_pb2 as pb

HEADER_CACHE_BLOCKS = 1 << 14  # record headers, metas and frames of recently fetched blocks, each
RECORD_MESSAGE_BYTES = 1 << 20  # records are sent a few to a message up to this size (see _batched)
REPLY_MARGIN_BYTES = 64 << 10  # below server.max_message_bytes: what gRPC adds around a reply
DESCRIPTOR_BATCH = 256  # slab descriptors per message, and keys per locate_host call (bounds lock hold time)


def check_deadline(context: TenantContext, done: int, total: int) -> None:
    remaining = context.time_remaining()
    if remaining is not None and remaining <= 0:
        raise DeadlineExceeded(f"deadline passed after {done} of {total} items")


def client_meta(meta: BlockMeta, i: int, keys: Sequence[bytes], scoped: Sequence[bytes]) -> BlockMeta:
    """Block i's meta as the caller knows it: its client key, and its parent when that is key i-1."""
    parent = keys[i - 1] if i and meta.parent == scoped[i - 1] else b""
    return dataclasses.replace(meta, key=keys[i], parent=parent, tenant="")


def _batched(frames: Iterator[bytes]) -> Iterator[bytes]:
    """Record frames joined into messages of at least RECORD_MESSAGE_BYTES (a bigger record alone):
    each message costs a fixed ~0.5 ms in gRPC's Python layers, more than sending 64 KiB. Each
    frame is a whole FetchResponse, so their concatenation is one that holds all their blocks."""
    pending: list[bytes] = []
    size = 0
    for frame in frames:
        if size % PAYLOAD_ALIGN:  # the next frame's payload would lose its alignment: a new message
            yield b"".join(pending)
            pending, size = [], 0
        pending.append(frame)
        size += len(frame)
        if size >= RECORD_MESSAGE_BYTES:
            yield pending[0] if len(pending) == 1 else b"".join(pending)
            pending, size = [], 0
    if pending:
        yield b"".join(pending)


def _disk_path(store: TieredStore) -> str:
    """Where same-host readers find the disk tier (SlabInfo.disk_path): absolute, as their working
    directory may differ from the daemon's."""
    disk = getattr(store, "disk", None)
    return str(disk.path.resolve()) if disk is not None else ""


class Fetcher:
    """The Fetch and FetchShared paths over the store, with the per-block caches that keep them cheap.
    Callers have validated and scoped the keys."""

    def __init__(self, store: TieredStore, config: Config) -> None:
        self._store = store
        self._cfg = config
        self._host: HostTier | None = getattr(store, "host", None)
        self._headers: dict[tuple, bytes] = {}  # see _host_frame
        self._meta_cache: dict[tuple[BlockMeta, bytes, bytes], bytes] = {}  # see _meta_bytes
        self._frames: dict[tuple, bytes] = {}  # see _described
        if self._host is not None:
            self.slab_info = pb.SlabInfo(path=self._host.slab_path, page_bytes=self._host.page_bytes,
                                          header_bytes=self._host.header_bytes, num_pages=self._host.num_pages,
                                          index_path=getattr(self._host, "index_path", ""),
                                          disk_path=_disk_path(store),
                                          staging_dir=os.path.dirname(self._host.slab_path),
                                          remote=getattr(store, "remote", None) is not None)

    def records(self, keys: list[bytes], scoped: list[bytes], context: TenantContext) -> Iterator[bytes]:
        """The byte-stream Fetch: the records of the cached prefix, verified, a few to a message."""
        host = self._host
        if host is None or getattr(self._store, "gpu", None) is not None:
            # With a gpu tier the store's get reads (and promotes) there: keep its full policy.
            return _batched(self._records_via_store(keys, scoped, context))
        return _batched(self._host_records(host, keys, scoped, context))

    def _host_records(self, host: HostTier, keys: list[bytes], scoped: list[bytes],
                      context: TenantContext) -> Iterator[bytes]:
        for start in range(0, len(scoped), DESCRIPTOR_BATCH):
            check_deadline(context, start, len(keys))
            chunk = scoped[start : start + DESCRIPTOR_BATCH]
            located = self._store.locate_host(chunk)  # hits, promotions and LRU as a get would
            for i, loc in enumerate(located, start):
                if i > start:
                    check_deadline(context, i, len(keys))
                if not context.is_active():
                    return
                frame = self._host_frame(host, i, loc, keys, scoped) if loc.block is None else None
                if frame is None:
                    block = loc.block or self._get_verified(scoped[i])
                    if block is None:
                        return
                    frame = record_frame(i, self._record_header(i, loc.meta, keys, scoped), block.payload.numpy().data)
                yield frame
            if len(located) < len(chunk):
                return

    def _host_frame(self, host: HostTier, i: int, loc: HostLocation, keys: Sequence[bytes],
                    scoped: Sequence[bytes]) -> bytes | None:
        """Block i's frame built straight from its slab pages (the payload's one copy), without the
        store lock: None when a page changed meanwhile (the seqlock) or the bytes fail their checksum;
        the caller then reads the block through the store, which drops and counts a damaged copy."""
        meta = loc.meta
        payload = host.payload_view(loc.pages, meta.nbytes)
        frame = record_frame(i, self._record_header(i, meta, keys, scoped), payload.numpy().data)
        # Checksummed in the frame, right after the copy (still in cache, and 16-byte aligned there:
        # record_frame pads for it); the generations checked after prove the slab held these bytes.
        ok = checksum(memoryview(frame)[len(frame) - meta.nbytes :]) == meta.checksum
        if not host.still_valid(loc.pages, loc.generations) or not ok:
            return None
        return frame

    def _record_header(self, i: int, meta: BlockMeta, keys: Sequence[bytes], scoped: Sequence[bytes]) -> bytes:
        """Block i's record header (its client meta as JSON), kept: it costs more to build than
        copying a 64 KiB payload, and a worker asks for the same chain again and again."""
        parent = keys[i - 1] if i and meta.parent == scoped[i - 1] else b""
        cache_key = (meta.key, meta.checksum, meta.nbytes, meta.dtype, meta.shape, meta.preview, keys[i], parent)
        header = self._headers.get(cache_key)
        if header is None:
            header = plain_header(client_meta(meta, i, keys, scoped))
            if len(self._headers) >= HEADER_CACHE_BLOCKS:
                self._headers.clear()
            self._headers[cache_key] = header
        return header

    def _get_verified(self, key: bytes) -> Block | None:
        try:
            block = self._store.get(key)
        except (NotFound, CorruptBlock):  # evicted meanwhile, or dropped as damaged: the prefix ends
            return None
        return block if checksum(block.payload) == block.meta.checksum else None

    def _records_via_store(self, keys: list[bytes], scoped: list[bytes], context: TenantContext) -> Iterator[bytes]:
        with contextlib.closing(self._store.fetch(scoped)) as blocks:
            for i, block in enumerate(blocks):
                check_deadline(context, i, len(keys))
                if not context.is_active():
                    return
                meta = client_meta(block.meta, i, keys, scoped)
                yield record_frame(i, *plain_record_parts(Block(meta, block.payload)))

    def store_keys(self, store_keys: list[bytes], owned: set[bytes], context: TenantContext) -> Iterator[bytes]:
        """Records of the caller's blocks named by store keys (`owned`: the caller's; another
        tenant's store key is treated as absent), in request order, absent ones skipped."""
        for i, key in enumerate(store_keys):
            check_deadline(context, i, len(store_keys))
            if not context.is_active():
                return
            if key not in owned:
                continue
            try:
                block = self._store.get(key)
            except (NotFound, CorruptBlock):  # evicted meanwhile, or dropped as damaged: skipped
                continue
            yield record_frame(i, *plain_record_parts(Block(dataclasses.replace(block.meta, tenant=""), block.payload)))

    def descriptors(self, keys: list[bytes], scoped: list[bytes], context: TenantContext) -> Iterator[bytes]:
        """The shared-memory Fetch stream: the slab first, then descriptors in batches; a record
        (a block the host tier had no room for) travels in a message of its own."""
        pending = [slab_field(self.slab_info)]
        for is_record, frame in self._described(keys, scoped, context):
            if is_record:
                yield b"".join(pending)
                pending = []
                yield frame
            else:
                pending.append(frame)
                if len(pending) >= DESCRIPTOR_BATCH:
                    yield b"".join(pending)
                    pending = []
        if pending:
            yield b"".join(pending)

    def _described(self, keys: list[bytes], scoped: list[bytes],
                   context: TenantContext) -> Iterator[tuple[bool, bytes]]:
        """(is_record, frame) per block of the cached prefix, located in batches (one store lock
        hold each): a slab descriptor, or a record when the host tier had no room for the block."""
        for start in range(0, len(scoped), DESCRIPTOR_BATCH):
            check_deadline(context, start, len(keys))
            chunk = scoped[start : start + DESCRIPTOR_BATCH]
            located = self._store.locate_host(chunk)
            for i, loc in enumerate(located, start):
                if loc.block is not None:  # no room in host for it
                    yield True, record_frame(i, self._record_header(i, loc.meta, keys, scoped),
                                             loc.block.payload.numpy().data)
                else:
                    # The same block (store key and page generations) asked for at the same place of
                    # the same chain makes the same frame: kept, as a worker asks for its prefix again and again.
                    frame_key = (loc.meta.key, loc.pages, loc.generations, i, keys[i], i and keys[i - 1])
                    frame = self._frames.get(frame_key)
                    if frame is None:
                        frame = descriptor_frame(i, self._meta_bytes(i, loc.meta, keys, scoped), loc.pages,
                                                 loc.generations)
                        if len(self._frames) >= HEADER_CACHE_BLOCKS:
                            self._frames.clear()
                        self._frames[frame_key] = frame
                    yield False, frame
            if len(located) < len(chunk) or not context.is_active():
                return

    def _meta_bytes(self, i: int, meta: BlockMeta, keys: Sequence[bytes], scoped: Sequence[bytes]) -> bytes:
        """Block i's client BlockMeta, serialized; kept per block like the record headers (_host_frame)."""
        parent = keys[i - 1] if i and meta.parent == scoped[i - 1] else b""
        cache_key = (meta, keys[i], parent)
        data = self._meta_cache.get(cache_key)
        if data is None:
            data = client_meta(meta, i, keys, scoped).to_wire(pb.BlockMeta).SerializeToString()
            if len(self._meta_cache) >= HEADER_CACHE_BLOCKS:
                self._meta_cache.clear()
            self._meta_cache[cache_key] = data
        return data

    def shared(self, keys: list[bytes], scoped: list[bytes], context: TenantContext) -> bytes:
        """FetchShared's reply: the slab and the frames of the cached prefix that fit the message budget."""
        parts = [slab_field(self.slab_info)]
        size, budget = len(parts[0]), self._cfg.server.max_message_bytes - REPLY_MARGIN_BYTES
        for _, frame in self._described(keys, scoped, context):
            if size + len(frame) > budget:
                break  # the prefix ends here, as at a miss; the caller computes the rest
            parts.append(frame)
            size += len(frame)
        return b"".join(parts)
