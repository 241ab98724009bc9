"""The self-describing block record: a one-tensor safetensors file, optionally zstd-compressed."""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import NamedTuple, overload

import numpy as np
import torch
import zstandard

from tiercache.block import Block, BlockMeta
from tiercache.errors import CorruptBlock, InvalidArgument
from tiercache.layout import CHECKSUM_ALG, DTYPES, as_uint8, checksum, legacy_sum64
from tiercache.record_header import (
    FORMAT,
    LEGACY_CHECKSUM_ALG,
    LEGACY_FORMAT,
    ST_DTYPES,
    build_header,
    canonical_meta,
    consistent_plain_header,
    meta_problem,
    plain_header,
)
from tiercache.record_header import meta_json as meta_json  # re-exported: the disk tier's meta records use it

logger = logging.getLogger(__name__)

MAX_HEADER_BYTES = 1 << 20
PARSED_MEMO_HEADERS = 4096  # parsed record headers kept (see _parse), each of at most:
PARSED_MEMO_HEADER_BYTES = 2048  # so at most 8 MiB
COMPRESSIONS = ("none", "zstd")
_PLAIN_KEYS = frozenset({"format", "checksum_alg", "compression", "meta"})
_ZSTD_KEYS = _PLAIN_KEYS | {"shuffle", "raw_size"}
_ENTRY_KEYS = frozenset({"dtype", "shape", "data_offsets"})


class _Record(NamedTuple):
    """A parsed, structurally valid record: where its payload lies and how it is stored."""

    meta: BlockMeta
    start: int
    end: int
    compressed: bool
    shuffle: bool
    legacy: bool = False  # format v1: its checksum is sum64 (read only by tiers/disk_upgrade.py)


def check_block(block: Block) -> None:
    """Raise InvalidArgument unless encode_block can encode `block` (cheap: no pass over the payload)."""
    payload = block.payload
    if not isinstance(payload, torch.Tensor) or payload.dtype != torch.uint8 or payload.dim() != 1:
        raise InvalidArgument("block payload must be a 1-D uint8 tensor")
    if not payload.is_contiguous():
        raise InvalidArgument("block payload must be contiguous")
    if payload.numel() != block.meta.nbytes:
        raise InvalidArgument(f"payload has {payload.numel()} bytes, meta.nbytes={block.meta.nbytes}")
    problem = meta_problem(block.meta)
    if problem:
        raise InvalidArgument(f"block {block.meta.key.hex()[:16]}: {problem}")


def record_size(meta: BlockMeta) -> int:
    """Bytes of the uncompressed record of a block: an upper bound of any record encode_block makes for it."""
    return len(plain_header(meta)) + meta.nbytes


class RecordBuffer:
    """Reusable memory for uncompressed records: a writer that is done with each record before it
    reuses the buffer avoids a fresh allocation (and its page faults) per block."""

    def __init__(self) -> None:
        self._data = np.empty(0, dtype=np.uint8)

    def take(self, nbytes: int) -> np.ndarray:
        """The first nbytes of the buffer, grown if needed; what an earlier take() returned is void."""
        if self._data.size < nbytes:
            self._data = np.empty(nbytes, dtype=np.uint8)
        return self._data[:nbytes]


def _planes(data: np.ndarray, itemsize: int) -> np.ndarray:
    """Byte-plane shuffle: byte i of every element, for i = 0 .. itemsize-1 (one strided copy per plane)."""
    out = np.empty_like(data)
    n = data.size // itemsize
    for i in range(itemsize):
        out[i * n : (i + 1) * n] = data[i::itemsize]
    return out


def _unplanes(planes: np.ndarray, itemsize: int) -> np.ndarray:
    """The inverse of _planes."""
    out = np.empty_like(planes)
    n = planes.size // itemsize
    for i in range(itemsize):
        out[i::itemsize] = planes[i * n : (i + 1) * n]
    return out


def plain_record_parts(block: Block) -> tuple[bytes, memoryview]:
    """The uncompressed record of `block` as (header, payload view): their concatenation equals
    encode_block(block). Lets a caller frame a record with one copy of the payload (the wire path)."""
    check_block(block)
    return plain_header(block.meta), block.payload.detach().cpu().numpy().data.cast("B")


@overload
def encode_block(block: Block, *, compression: str = "none", level: int = 3, shuffle: bool = True,
                 min_ratio: float = 1.1, into: None = None) -> bytes: ...


@overload
def encode_block(block: Block, *, compression: str = "none", level: int = 3, shuffle: bool = True,
                 min_ratio: float = 1.1, into: RecordBuffer) -> bytes | memoryview: ...


def encode_block(block: Block, *, compression: str = "none", level: int = 3, shuffle: bool = True,
                 min_ratio: float = 1.1, into: RecordBuffer | None = None) -> bytes | memoryview:
    """The record of `block`. With zstd, `shuffle` groups the bytes of each element by significance
    first (all low bytes, then the next, ...); the block stays uncompressed unless
    compressed_size * min_ratio <= raw size and the compressed record is not longer.
    Without `into` the record is bytes; with it, an uncompressed record is written into that buffer
    and returned as a memoryview that the next use of the buffer overwrites."""
    check_block(block)
    if compression not in COMPRESSIONS:
        raise InvalidArgument(f"unknown compression {compression!r}; expected one of {', '.join(COMPRESSIONS)}")
    if not 1 <= level <= 22:
        raise InvalidArgument(f"zstd level must be between 1 and 22, got {level}")
    if min_ratio <= 0:
        raise InvalidArgument(f"min_ratio must be > 0, got {min_ratio}")
    meta = block.meta
    payload = block.payload.detach().cpu().numpy()
    plain = plain_header(meta)
    if compression == "zstd" and meta.nbytes:
        itemsize = DTYPES[meta.dtype].itemsize
        shuffled = shuffle and itemsize > 1
        source = _planes(payload, itemsize) if shuffled else payload
        frame = zstandard.ZstdCompressor(level=level, write_content_size=True).compress(source.data)
        if len(frame) * min_ratio <= meta.nbytes:
            head = build_header(meta, "kv.zst", "U8", [len(frame)], len(frame),
                           {"compression": "zstd", "shuffle": "1" if shuffled else "0", "raw_size": str(meta.nbytes)})
            if len(head) + len(frame) <= len(plain) + meta.nbytes:
                return head + frame
    if into is None:
        # One copy of the payload: join reads the tensor's memory through the buffer protocol.
        return b"".join((plain, payload.data))
    out = into.take(len(plain) + meta.nbytes).data  # memoryview slices copy with one memcpy each, unlike numpy's
    out[: len(plain)] = plain
    out[len(plain) :] = payload.data
    return out


def _fail(why: str) -> CorruptBlock:
    return CorruptBlock(f"block record: {why}")


def _is_int_list(value: object, length: int | None = None) -> bool:
    return (isinstance(value, list) and (length is None or len(value) == length)
            and all(type(x) is int for x in value))


def _parse(data: bytes | bytearray | memoryview) -> tuple[memoryview, _Record]:
    """Validate everything but the payload bytes; CorruptBlock naming the first problem."""
    try:
        view = memoryview(data).cast("B")
    except (TypeError, ValueError) as e:
        raise _fail(f"not a contiguous bytes-like object ({e})") from None
    total = len(view)
    if total < 8:
        raise _fail(f"{total} bytes is shorter than the 8-byte header length")
    header_len = int.from_bytes(view[:8], "little")
    if header_len > MAX_HEADER_BYTES:
        raise _fail(f"header length {header_len} exceeds the {MAX_HEADER_BYTES}-byte limit")
    if 8 + header_len > total:
        raise _fail(f"truncated: header length {header_len} but only {total - 8} bytes follow")
    header = bytes(view[8 : 8 + header_len])
    if header_len > PARSED_MEMO_HEADER_BYTES:  # not worth remembering (and bounds the memo's memory)
        return view, _parse_header(header, total)
    return view, _parse_remembered(header, total)


# The same header and length parse the same: a reader that sees a block again (a worker's prefix,
# fetched again and again) skips even the regex. lru_cache is bounded, thread-safe, and remembers
# only headers that parse (an exception is not cached).
@functools.lru_cache(maxsize=PARSED_MEMO_HEADERS)
def _parse_remembered(header: bytes, total: int) -> _Record:
    # The canonical header of an uncompressed record (what our encoders write) is read without
    # JSON (which costs more than checksumming a 64 KiB payload); any other gets the full parse.
    meta = canonical_meta(header)
    if meta is not None and total - 8 - len(header) == meta.nbytes:
        return _Record(meta, 8 + len(header), total, compressed=False, shuffle=False)
    return _parse_header(header, total)


def _parse_header(text: bytes, total: int) -> _Record:
    """_parse's checks of the header (`text`, after its 8-byte length) against itself and the record's length."""
    header_len = len(text)
    try:
        header = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise _fail(f"header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise _fail("header is not a JSON object")
    metadata = header.get("__metadata__")
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _fail("__metadata__ is missing or not a table of strings")
    names = [k for k in header if k != "__metadata__"]
    if len(names) != 1:
        raise _fail(f"expected exactly one tensor, found {len(names)}")
    legacy = metadata.get("format") == LEGACY_FORMAT
    if metadata.get("format") != FORMAT and not legacy:
        raise _fail(f"format {metadata.get('format')!r} is not {FORMAT!r}")
    alg = LEGACY_CHECKSUM_ALG if legacy else CHECKSUM_ALG
    if metadata.get("checksum_alg") != alg:
        raise _fail(f"checksum_alg {metadata.get('checksum_alg')!r} is not {alg!r} (format {metadata['format']!r})")
    compression = metadata.get("compression")
    if compression not in COMPRESSIONS:
        raise _fail(f"unknown compression {compression!r}")
    expected_keys = _ZSTD_KEYS if compression == "zstd" else _PLAIN_KEYS
    if set(metadata) != expected_keys:
        raise _fail(f"metadata fields {sorted(metadata)} are not {sorted(expected_keys)}")
    try:
        meta = BlockMeta.from_dict(json.loads(metadata["meta"]))
    except Exception as e:  # noqa: BLE001 - any malformed field (KeyError, TypeError, ValueError, ...) is corruption
        raise _fail(f"meta is malformed ({type(e).__name__}: {e})") from None
    problem = meta_problem(meta)
    if problem:
        raise _fail(problem)
    name = names[0]
    entry = header[name]
    if not isinstance(entry, dict) or set(entry) != _ENTRY_KEYS:
        raise _fail(f"tensor entry {name!r} must have exactly dtype, shape and data_offsets")
    start, data_len = 8 + header_len, total - 8 - header_len
    offsets = entry["data_offsets"]
    if not _is_int_list(offsets, 2) or offsets[0] != 0 or offsets[1] != data_len:
        raise _fail(f"data_offsets {offsets!r} do not cover the {data_len} data bytes exactly")
    if compression == "none":
        if name != "kv" or entry["dtype"] != ST_DTYPES[meta.dtype] or entry["shape"] != list(meta.shape) \
                or not _is_int_list(entry["shape"]):
            raise _fail(f"tensor {name!r} {entry['dtype']!r} {entry['shape']!r} does not match "
                        f"meta ({meta.dtype}, {list(meta.shape)})")
        if data_len != meta.nbytes:
            raise _fail(f"length mismatch: {data_len} data bytes, meta.nbytes={meta.nbytes}")
        return _Record(meta, start, total, compressed=False, shuffle=False, legacy=legacy)
    if name != "kv.zst" or entry["dtype"] != "U8" or entry["shape"] != [data_len] or not _is_int_list(entry["shape"]):
        raise _fail(f"compressed tensor {name!r} {entry['dtype']!r} {entry['shape']!r} is not U8 [{data_len}]")
    if metadata["raw_size"] != str(meta.nbytes) or meta.nbytes == 0:
        raise _fail(f"raw_size {metadata['raw_size']!r} does not match meta.nbytes={meta.nbytes}")
    if metadata["shuffle"] not in ("0", "1"):
        raise _fail(f"shuffle {metadata['shuffle']!r} is not '0' or '1'")
    return _Record(meta, start, total, compressed=True, shuffle=metadata["shuffle"] == "1", legacy=legacy)


class ParsedRecord(NamedTuple):
    """A record whose header has been validated (parse_record): decode_block takes it as its data."""

    view: memoryview
    layout: _Record

    @property
    def meta(self) -> BlockMeta:
        return self.layout.meta


def parse_record(data: bytes | bytearray | memoryview) -> ParsedRecord:
    """A record after validating its header (no payload copy, no checksum); CorruptBlock if malformed.
    Lets a reader check the metadata before decode_block, without parsing the header twice."""
    return ParsedRecord(*_parse(data))


def header_meta(header: bytes | bytearray | memoryview) -> BlockMeta:
    """The metadata of a record's header alone (a staged Put's record: everything before the
    payload), which must be the uncompressed header encode_block writes; CorruptBlock otherwise."""
    head = bytes(header)
    if len(head) < 8 or int.from_bytes(head[:8], "little") != len(head) - 8:
        raise _fail(f"a header of {len(head)} bytes does not hold its own length")
    meta = canonical_meta(head[8:])
    if meta is None or plain_header(meta) != head:
        raise _fail("not the header of an uncompressed record as encode_block writes it")
    return meta


def record_meta(data: bytes | bytearray | memoryview) -> BlockMeta:
    """The metadata of a record after validating its header (no payload copy, no checksum)."""
    return _parse(data)[1].meta


def _decompress(frame: memoryview, raw_size: int) -> bytes:
    try:
        declared = zstandard.frame_content_size(frame)
    except zstandard.ZstdError as e:
        raise _fail(f"zstd frame header is invalid ({e})") from None
    if declared != raw_size:
        shown = "absent" if declared == -1 else str(declared)
        raise _fail(f"zstd frame content size {shown} does not match raw_size={raw_size}")
    try:
        # max_output_size bounds the expansion even if the frame lies about its content size.
        raw = zstandard.ZstdDecompressor().decompress(frame, max_output_size=raw_size, allow_extra_data=False)
    except zstandard.ZstdError as e:
        raise _fail(f"zstd frame does not decompress ({e})") from None
    if len(raw) != raw_size:
        raise _fail(f"zstd frame expanded to {len(raw)} bytes, expected {raw_size}")
    return raw


def _match_plain(view: memoryview, meta: BlockMeta) -> _Record | None:
    """The record's layout if it is exactly the uncompressed record encode_block writes for `meta`
    (its header bytes equal, so everything _parse checks holds), else None."""
    head = consistent_plain_header(meta)
    if head is None:
        return None
    n = len(head)
    if len(view) != n + meta.nbytes or bytes(view[:n]) != head:
        return None
    return _Record(meta, n, len(view), compressed=False, shuffle=False)


def _checked(data: bytes | bytearray | memoryview | ParsedRecord, max_payload_bytes: int,
             expected_key: bytes | None, expected_meta: BlockMeta | None = None,
             legacy: bool = False) -> tuple[memoryview, _Record]:
    """decode_block's checks of everything but the payload bytes."""
    rec: _Record | None = None
    if isinstance(data, ParsedRecord):
        view, rec = data
    else:
        if expected_meta is not None:
            try:
                view = memoryview(data).cast("B")
            except (TypeError, ValueError) as e:
                raise _fail(f"not a contiguous bytes-like object ({e})") from None
            rec = _match_plain(view, expected_meta)
        if rec is None:  # anything else gets the strict parse and its precise error
            view, rec = _parse(data)
    meta = rec.meta
    if rec.legacy and not legacy:
        raise _fail(f"format {LEGACY_FORMAT!r} (checksum {LEGACY_CHECKSUM_ALG}) is read only when a disk tier "
                    f"written by tiercache 0.1 is upgraded; expected {FORMAT!r}")
    num_stored = rec.end - rec.start
    if meta.nbytes > max_payload_bytes or num_stored > max_payload_bytes:
        raise _fail(f"payload of {max(meta.nbytes, num_stored)} bytes exceeds max_payload_bytes={max_payload_bytes}")
    if expected_key is not None and meta.key != expected_key:
        raise _fail(f"key {meta.key.hex()} does not match the expected key {bytes(expected_key).hex()}")
    if expected_meta is not None and meta is not expected_meta and meta != expected_meta:
        raise _fail(f"metadata of block {meta.key.hex()} does not match the expected metadata")
    return view, rec


def decode_run(records: Sequence[bytes | bytearray | memoryview], *, max_payload_bytes: int,
               expected_keys: list[bytes]) -> tuple[list[Block], CorruptBlock | None]:
    """decode_block of each record in order, up to the first that fails: the blocks before it and
    its error (None when all pass). The uncompressed payloads are copied into one buffer (each
    block's payload is a slice of it) instead of an allocation and a copy each, and checksummed
    there while the copy is hot in cache. Compressed ones are decoded one by one."""
    checked: list[tuple[memoryview, _Record]] = []
    error = None
    for record, key in zip(records, expected_keys):
        try:
            checked.append(_checked(record, max_payload_bytes, key))
        except CorruptBlock as e:
            error = e
            break
    batched = [not rec.compressed and 0 < rec.end - rec.start == rec.meta.nbytes for _, rec in checked]
    sizes = [rec.end - rec.start if b else 0 for (_, rec), b in zip(checked, batched)]
    # numpy's allocation, not torch.empty: glibc reuses freed heap for it, while torch's allocator
    # maps multi-MiB buffers afresh and faults on every page (8 MB: 0.13 against 0.5-4 ms here).
    flat = np.empty(sum(sizes), dtype=np.uint8)
    buffer = torch.from_numpy(flat)
    offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    sums = []
    for (view, rec), start, size in zip(checked, offsets.tolist(), sizes):
        if size:
            flat[start : start + size] = np.frombuffer(view[rec.start : rec.end], dtype=np.uint8)  # the one copy
            sums.append(checksum(flat[start : start + size]))
    blocks: list[Block] = []
    batch_sums = iter(sums)
    payloads = torch.split(buffer, sizes)  # one call for every view (slicing one by one costs ~2 us each)
    for (view, rec), in_batch, payload in zip(checked, batched, payloads):
        if in_batch:
            if next(batch_sums) != rec.meta.checksum:
                return blocks, _fail(f"checksum mismatch for key {rec.meta.key.hex()}: the payload bytes are damaged")
            blocks.append(Block(rec.meta, payload))
            continue
        try:
            blocks.append(decode_block(ParsedRecord(view, rec), max_payload_bytes=max_payload_bytes))
        except CorruptBlock as e:
            return blocks, e
    return blocks, error


def decode_block(data: bytes | bytearray | memoryview | ParsedRecord, *, max_payload_bytes: int,
                 expected_key: bytes | None = None, expected_meta: BlockMeta | None = None,
                 copy: bool = True, legacy: bool = False) -> Block:
    """The block in a record, verified: structure, sizes (before any allocation), key and checksum.

    `data` is the record's bytes, or what parse_record made of them.
    The payload is a fresh contiguous 1-D uint8 tensor; `data` may be released afterwards. With
    copy=False an uncompressed payload is a read-only view of `data` instead (which it keeps alive):
    for a reader that owns the received message and only reads the block.
    Every problem raises CorruptBlock, a payload over max_payload_bytes included. With
    `expected_meta` (a reader that knows the block's metadata), a record whose metadata differs is
    corrupt too, and an uncompressed record whose header is byte-identical to the one encode_block
    writes for it skips the JSON parse.
    A format v1 record (checksum sum64) is refused unless `legacy` (the disk tier's upgrade): then it
    is verified with sum64, and the block returned carries the XXH3-64 checksum of its payload.
    """
    view, rec = _checked(data, max_payload_bytes, expected_key, expected_meta, legacy)
    meta = rec.meta
    stored = view[rec.start : rec.end]
    raw: bytearray | memoryview
    if not rec.compressed and not copy:
        raw, payload = stored, as_uint8(stored)
    elif not rec.compressed:
        # The one copy out of `data` (measured faster than numpy's copy); the tensor owns the bytearray.
        raw = bytearray(stored)
        payload = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    else:
        frame = np.frombuffer(_decompress(stored, meta.nbytes), dtype=np.uint8)
        itemsize = DTYPES[meta.dtype].itemsize
        array = _unplanes(frame, itemsize) if rec.shuffle and itemsize > 1 else frame.copy()
        payload, raw = torch.from_numpy(array), array.data
    # Over the buffer, not the tensor: the copy is still hot in cache, and no tensor views are made.
    if (legacy_sum64(raw) if rec.legacy else checksum(raw)) != meta.checksum:
        raise _fail(f"checksum mismatch for key {meta.key.hex()}: the payload bytes are damaged")
    if rec.legacy:
        meta = replace(meta, checksum=checksum(raw))
    return Block(meta, payload)
