"""Put and Fetch on the wire: records framed by hand for Fetch, Put records decoded and checked."""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Sequence

from server.namespaces import FIELDS, check_fields
from server.staging import StagedPayloads
from tiercache.block import Block, BlockMeta
from tiercache.codec import decode_block, header_meta, parse_record
from tiercache.errors import CorruptBlock, InvalidArgument, PermissionDenied
from tiercache.layout import checksum
from tiercache.tenancy import LOCAL_TENANT, scope_key
from tiercache.v1 import tiercache_pb2 as pb
from tiercache.wire import field, varint

MAX_PREVIEW_CHARS = 256
PAYLOAD_ALIGN = 16  # what a bytes object's data is aligned to (CPython: 32 bytes of header, malloc)


def record_frame(index: int, *record_parts: bytes | memoryview) -> bytes:
    """The wire bytes of FetchResponse{blocks: [FetchedBlock{index, pad, record}]}, built by hand:
    the message classes would copy a multi-MiB record twice more (into the message, then out). The
    record may come in parts (codec.plain_record_parts), so its payload (the last part) is copied
    exactly once, and `pad` puts it at a multiple of PAYLOAD_ALIGN bytes into the message."""
    size = sum(len(part) for part in record_parts)
    before_payload = size - len(record_parts[-1]) if record_parts else 0
    head = b"\x08" + varint(index)  # index = 1 (varint)
    pad = b""
    for _ in range(3):  # a longer pad can lengthen a varint; settles within two rounds
        inner = head + pad + b"\x12" + varint(size)  # pad = 4, record = 2 (bytes)
        outer = b"\x12" + varint(len(inner) + size)  # blocks = 2
        misaligned = (len(outer) + len(inner) + before_payload) % PAYLOAD_ALIGN
        if not misaligned:
            break
        width = len(pad) + PAYLOAD_ALIGN - misaligned  # the pad field's bytes, tag and length included
        pad = b"\x22" + varint(max(0, width - 2)) + bytes(max(0, width - 2)) if width >= 2 else \
            b"\x22" + varint(width + PAYLOAD_ALIGN - 2) + bytes(width + PAYLOAD_ALIGN - 2)
    return b"".join((outer, inner, *record_parts))


def lookup_reply(codes: bytes) -> bytes:
    """The wire bytes of LookupResponse{tiers}, given one byte per tier (every Tier value is under
    0x80, so each is a one-byte varint of the packed field). Building the message cost ~4x as much
    as the store's whole lookup of the tiers, per Lookup."""
    return field(b"\x0a", codes) if codes else b""  # tiers = 1 (packed); no tiers: the empty message


def _packed(fmt: str, values: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(values)}{fmt}", *values)


def slab_field(info: pb.SlabInfo) -> bytes:
    """FetchResponse.slab (field 1), serialized: prefixed to the first descriptor message."""
    return field(b"\x0a", info.SerializeToString())


def descriptor_frame(index: int, meta: bytes, pages: Sequence[int], generations: Sequence[int]) -> bytes:
    """One FetchResponse.blocks entry (field 2) holding FetchedBlock{index, slab_block{meta, pages,
    generations}}, built by hand around an already serialized BlockMeta: a message object per block
    cost more than the rest of a Fetch. Frames concatenate into one FetchResponse."""
    slab_block = field(b"\x0a", meta) + field(b"\x12", _packed("I", pages)) + field(b"\x1a", _packed("Q", generations))
    return field(b"\x12", b"\x08" + varint(index) + field(b"\x1a", slab_block))


def described(info: pb.NamespaceInfo, meta: BlockMeta, n: int) -> dict[str, str | int]:
    """The checked fields of a namespace description sent with record n."""
    try:
        fields = check_fields({name: getattr(info, name) for name in FIELDS})
    except InvalidArgument as e:
        raise InvalidArgument(f"records[{n}].{e}") from None
    shape = meta.shape
    for name, value in (("dtype", meta.dtype), ("num_layers", shape[0]), ("num_kv_heads", shape[2]),
                        ("head_dim", shape[4])):
        if fields[name] != value:
            raise InvalidArgument(f"records[{n}].namespace.{name} is {fields[name]!r}, the record's is {value!r}")
    if meta.num_tokens > int(fields["block_tokens"]):
        raise InvalidArgument(f"records[{n}] has {meta.num_tokens} tokens, more than namespace.block_tokens="
                              f"{fields['block_tokens']}")
    return fields


def decode_put(req: pb.PutRequest, n: int, tenant: str, max_block_bytes: int,
               staging: StagedPayloads | None = None) -> Block:
    """The block of PutRequest n as the store will hold it: keys scoped to `tenant` (the caller), or,
    for an import (caller "local" only), kept as the store keys of import_tenant. Checks everything
    but the namespace description (see described). `staging` reads staged payloads: None for a
    caller who may not stage (not on the Unix socket, or no host tier)."""
    if req.import_tenant:
        # Anyone else could plant blocks under another tenant's store keys.
        if tenant != LOCAL_TENANT:
            raise PermissionDenied("only tenant 'local' (the operator) may import blocks under store keys")
        if len(req.import_tenant) > MAX_PREVIEW_CHARS:
            raise InvalidArgument(f"records[{n}].import_tenant is longer than {MAX_PREVIEW_CHARS} characters")
        tenant = req.import_tenant
    limit = max_block_bytes
    staged = req.HasField("staged")
    if staged and staging is None:
        raise InvalidArgument(f"records[{n}].staged: a staged Put needs a caller on the daemon's Unix socket "
                              "and a host tier")
    try:
        # The header is parsed once, here.
        parsed = None if staged else parse_record(req.record)
        meta = header_meta(req.record) if parsed is None else parsed.meta
    except CorruptBlock as e:  # malformed structure: the caller's bug, not damaged data
        raise InvalidArgument(f"records[{n}]: {e}") from None
    if meta.nbytes > limit:
        raise InvalidArgument(f"records[{n}] declares {meta.nbytes} payload bytes; "
                              f"store.max_block_bytes is {limit}")
    preview = req.preview or meta.preview
    if len(preview) > MAX_PREVIEW_CHARS:
        raise InvalidArgument(f"records[{n}] preview has {len(preview)} characters; the limit is {MAX_PREVIEW_CHARS}")
    if parsed is None:
        assert staging is not None  # a staged record without it was refused above
        # One copy into the daemon's memory, verified there: the caller may change its file meanwhile.
        payload = staging.read(req.staged.file, req.staged.offset, meta.nbytes, f"records[{n}].staged")
        if checksum(payload) != meta.checksum:
            raise CorruptBlock(f"records[{n}]: checksum mismatch for key {meta.key.hex()}: the staged payload "
                               "bytes are damaged")
        block = Block(meta, payload)
    else:
        try:
            # No copy: the payload is a read-only view of the request message, which this Put owns;
            # the host tier and the disk writer copy out of it.
            block = decode_block(parsed, max_payload_bytes=limit, copy=False)
        except CorruptBlock as e:
            raise CorruptBlock(f"records[{n}]: {e}") from None
    if req.import_tenant:
        meta = dataclasses.replace(meta, tenant=tenant, preview=preview)
    else:
        meta = dataclasses.replace(meta, key=scope_key(tenant, meta.key), tenant=tenant, preview=preview,
                                   parent=scope_key(tenant, meta.parent) if meta.parent else b"")
    return Block(meta, block.payload)


def chunks(items: list[tuple[Block, float | None, bool]], chunk_bytes: int) -> list[tuple[int, int]]:
    """Runs of items with the same ttl and pin, each at most chunk_bytes (or one block)."""
    runs: list[tuple[int, int]] = []
    start, size = 0, 0
    for i, (block, ttl, pin) in enumerate(items):
        if i > start and (size + block.meta.nbytes > chunk_bytes or (ttl, pin) != items[start][1:]):
            runs.append((start, i))
            start, size = i, 0
        size += block.meta.nbytes
    if items:
        runs.append((start, len(items)))
    return runs
