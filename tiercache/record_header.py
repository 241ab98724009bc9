"""The header of a block record: written by one function, and read back without the JSON parser
when it is exactly what that function writes (as every record our encoders make is)."""

from __future__ import annotations

import binascii
import json
import operator
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from json.encoder import encode_basestring_ascii as _js
from typing import Any

from tiercache.block import META_FIELDS, BlockMeta, Kind
from tiercache.errors import InvalidArgument
from tiercache.layout import CHECKSUM_ALG, DTYPES

FORMAT = "tiercache.block.v2"  # checksum XXH3-64 (layout.CHECKSUM_ALG)
LEGACY_FORMAT = "tiercache.block.v1"  # written by tiercache 0.1: checksum sum64, read only to upgrade
LEGACY_CHECKSUM_ALG = "sum64"
# safetensors' names for our dtypes; a record uses them so any safetensors reader can load it.
ST_DTYPES: dict[str, str] = {"float32": "F32", "float16": "F16", "bfloat16": "BF16",
                             "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}
_HEADER_START = f'{{"__metadata__":{{"format":{_js(FORMAT)},"checksum_alg":{_js(CHECKSUM_ALG)},"meta":'
HEADER_MEMO_ENTRIES = 4096  # built uncompressed headers kept, by meta identity (see plain_header)
# id(meta) -> (meta, header, verdict), least recently used first; see _remember. Keyed by identity,
# not by value: hashing a meta costs more than the lookup saves.
_HEADERS: OrderedDict[int, tuple[BlockMeta, bytes, bool | None]] = OrderedDict()
_HEADERS_LOCK = threading.Lock()


def _ints(values: tuple[int, ...] | list[int]) -> str:
    return ",".join(map(str, values))


def _dims(text: bytes) -> tuple[int, ...]:
    return tuple(map(int, text.split(b",")))


# The uncompressed header exactly as plain_header writes it, fields captured: the meta's fields in
# META_FIELDS' order, each in its kind's form, then the safetensors entry. Strings are limited to
# printable ASCII without '"' and '\\', which both levels of JSON quoting leave as they are, and
# integers to json.dumps' form, so a match reads as json.loads would read it (tests compare the two).
# Each kind: its pattern (one group) inside the meta's JSON, itself a JSON string (so a quote in it
# is \"), and the reader of that group.
_INT = rb"(0|[1-9][0-9]{0,19})"
_TEXT = rb"([ !#-\[\]-~]*)"
_Q = rb'\\"'
_FORMS: dict[Kind, tuple[bytes, Callable[[bytes], Any]]] = {
    Kind.KEY: (_Q + rb"([0-9a-f]{64})" + _Q, binascii.a2b_hex),
    Kind.LINK: (_Q + rb"((?:[0-9a-f]{64})?)" + _Q, binascii.a2b_hex),
    Kind.COUNT: (_INT, int),
    Kind.DTYPE: (_Q + rb"([a-z0-9_]{1,32})" + _Q, bytes.decode),
    # json.dumps' numbers ("01" is not one), at most 128 characters in all (the lookahead).
    Kind.DIMS: (rb"\[((?=[0-9,]{1,128}\])(?:0|[1-9][0-9]*)(?:,(?:0|[1-9][0-9]*))*)\]", _dims),
    Kind.TEXT: (_Q + _TEXT + _Q, bytes.decode),
}
_CANONICAL = re.compile(
    re.escape(_HEADER_START.encode()) + rb'"\{'
    + b",".join(_Q + re.escape(f.name.encode()) + _Q + b":" + _FORMS[f.kind][0] for f in META_FIELDS)
    + rb'\}","compression":"none"\},'
    rb'"kv":\{"dtype":"([A-Z0-9_]{1,16})","shape":\[([0-9,]{1,128})\],"data_offsets":\[0,' + _INT + rb'\]\}\}( {0,7})')
assert _CANONICAL.groups == len(META_FIELDS) + 4, "each kind's pattern captures one group"
_READERS = tuple(_FORMS[f.kind][1] for f in META_FIELDS)
_META_NAMES = tuple(f.name for f in META_FIELDS)
_DTYPE_AT, _SHAPE_AT, _NBYTES_AT = map(_META_NAMES.index, ("dtype", "shape", "nbytes"))  # the kv entry repeats them


def meta_problem(meta: BlockMeta) -> str | None:
    """Why meta is inconsistent with the canonical layout, or None."""
    if meta.dtype not in ST_DTYPES:
        return f"unknown dtype {meta.dtype!r}"
    shape = meta.shape
    if len(shape) != 5 or any(type(d) is not int or d < 0 for d in shape):
        return f"shape {list(shape)} is not [num_layers, 2, num_kv_heads, tokens, head_dim]"
    if shape[1] != 2 or shape[3] != meta.num_tokens:
        return f"shape {list(shape)} does not match [num_layers, 2, num_kv_heads, {meta.num_tokens}, head_dim]"
    size = shape[0] * shape[1] * shape[2] * shape[3] * shape[4] * DTYPES[meta.dtype].itemsize
    if size != meta.nbytes:
        return f"shape {list(shape)} of {meta.dtype} is {size} bytes, meta says nbytes={meta.nbytes}"
    if not 0 <= meta.checksum < 1 << 64:
        return f"checksum {meta.checksum} is not a u64"
    return None


def meta_json(meta: BlockMeta) -> str:
    """json.dumps(meta.to_dict(), separators=(",", ":")), written field by field: five times faster,
    and every read of an uncompressed record compares its header with one built from this. The JSON
    form of each kind (block.py) is that of its values' type, so the type picks it (faster than
    looking up the kind; tests compare the two writers)."""
    parts = []
    for name in _META_NAMES:
        value = getattr(meta, name)
        if type(value) is bytes:
            parts.append(f'"{name}":"{value.hex()}"')
        elif type(value) is int:
            parts.append(f'"{name}":{value}')
        elif type(value) is str:
            parts.append(f'"{name}":{_js(value)}')
        elif type(value) is tuple and all(type(x) is int for x in value):
            parts.append(f'"{name}":[{_ints(value)}]')
        else:  # a type this writer does not know: the generic encoder is always right
            return json.dumps(meta.to_dict(), separators=(",", ":"))
    return "{" + ",".join(parts) + "}"


def build_header(meta: BlockMeta, name: str, dtype: str, shape: list[int], size: int, extra: dict[str, str]) -> bytes:
    # The bytes json.dumps(header, separators=(",", ":")) gives, without building the dicts.
    extra_text = "".join(f",{_js(k)}:{_js(v)}" for k, v in extra.items())
    text = (f'{_HEADER_START}{_js(meta_json(meta))}{extra_text}}},{_js(name)}:{{"dtype":{_js(dtype)},'
            f'"shape":[{_ints(shape)}],"data_offsets":[0,{size}]}}}}').encode()
    text += b" " * (-len(text) % 8)  # safetensors pads so the data starts 8-byte aligned
    return len(text).to_bytes(8, "little") + text


def plain_header(meta: BlockMeta) -> bytes:
    # By identity: one put hands the same meta to record_size (twice: the disk tier's cost) and to
    # encode_block on the writer thread; a fetch, to plain_record_parts. The memo holds the meta,
    # so its id cannot be reused while the entry lives.
    hit = _recall(meta)
    if hit is not None:
        return hit[1]
    head = build_header(meta, "kv", ST_DTYPES[meta.dtype], list(meta.shape), meta.nbytes, {"compression": "none"})
    _remember(meta, head, None)
    return head


def consistent_plain_header(meta: BlockMeta) -> bytes | None:
    """plain_header(meta) when meta_problem(meta) is None, else None; the verdict is remembered with
    the header (a disk tier reads with its index's metas, the same objects every time, and
    meta_problem cost ~8 us a block)."""
    hit = _recall(meta)
    if hit is not None and hit[2] is not None:
        return hit[1] if hit[2] else None
    consistent = meta_problem(meta) is None
    head = plain_header(meta) if consistent else b""
    _remember(meta, head, consistent)
    return head if consistent else None


def _recall(meta: BlockMeta) -> tuple[BlockMeta, bytes, bool | None] | None:
    """What _remember kept for this very meta object (marked recently used), or None."""
    with _HEADERS_LOCK:
        hit = _HEADERS.get(id(meta))
        if hit is None or hit[0] is not meta:
            return None
        _HEADERS.move_to_end(id(meta))
        return hit


def _remember(meta: BlockMeta, head: bytes, consistent: bool | None) -> None:
    """Keep meta's header (and whether meta_problem passed, None: not asked) by identity, the least
    recently used entry leaving past HEADER_MEMO_ENTRIES. The memo holds the meta, so its id cannot
    be reused while the entry lives."""
    with _HEADERS_LOCK:
        _HEADERS[id(meta)] = (meta, head, consistent)
        _HEADERS.move_to_end(id(meta))
        while len(_HEADERS) > HEADER_MEMO_ENTRIES:
            _HEADERS.popitem(last=False)


def canonical_meta(text: bytes) -> BlockMeta | None:
    """The meta of an uncompressed record header (`text`: the JSON after the 8-byte length) that is
    exactly what plain_header writes, read without the JSON parser; None for any other header (the
    full parser then reads it, or names its problem). Accepts nothing the full parser refuses, the
    caller checking that the data bytes number meta.nbytes."""
    if len(text) % 8:
        return None
    match = _CANONICAL.fullmatch(text)
    if match is None:
        return None
    groups = match.groups()
    st_dtype, st_shape, end, _ = groups[len(_READERS):]
    if st_shape != groups[_SHAPE_AT] or end != groups[_NBYTES_AT] \
            or ST_DTYPES.get(groups[_DTYPE_AT].decode()) != st_dtype.decode():
        return None
    try:
        meta = BlockMeta(*map(operator.call, _READERS, groups))  # map stops after the meta's groups
    except (ValueError, InvalidArgument):
        return None
    return meta if meta_problem(meta) is None else None
