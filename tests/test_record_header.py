"""The record header: the canonical reader agrees with the JSON parser and never accepts more than it."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiercache import codec
from tiercache.block import Block, BlockMeta
from tiercache.codec import decode_block, encode_block, parse_record
from tiercache.errors import CorruptBlock
from tiercache.layout import DTYPES, checksum
from tiercache.record_header import (
    ST_DTYPES,
    build_header,
    canonical_meta,
    meta_json,
    plain_header,
)

KEY, PARENT, NAMESPACE = bytes(range(32)), bytes(range(1, 33)), bytes(32)


def meta_of(dtype: str = "float16", dims: tuple[int, int, int, int] = (2, 2, 4, 8), *, parent: bytes = PARENT,
            tenant: str = "", preview: str = "", check: int = 12345) -> BlockMeta:
    layers, heads, tokens, head_dim = dims
    shape = (layers, 2, heads, tokens, head_dim)
    nbytes = layers * 2 * heads * tokens * head_dim * DTYPES[dtype].itemsize
    return BlockMeta(key=KEY, namespace=NAMESPACE, num_tokens=tokens, dtype=dtype, shape=shape, nbytes=nbytes,
                     checksum=check, parent=parent, tenant=tenant, preview=preview)


def json_meta(head: bytes) -> BlockMeta:
    """What the JSON parser reads from a header."""
    return BlockMeta.from_dict(json.loads(json.loads(head[8:])["__metadata__"]["meta"]))


def full_parse(record: bytes) -> BlockMeta:
    """The strict JSON parser's reading of a whole record, bypassing the canonical reader."""
    return codec._parse_header(record[8 : 8 + int.from_bytes(record[:8], "little")], len(record)).meta


@settings(max_examples=300, deadline=None)
@given(dtype=st.sampled_from(sorted(ST_DTYPES)), dims=st.tuples(*[st.integers(0, 9)] * 4),
       parent=st.sampled_from([b"", PARENT]), tenant=st.text(max_size=12), preview=st.text(max_size=40),
       check=st.integers(0, (1 << 64) - 1))
def test_canonical_reader_agrees_with_the_json_parser(dtype: str, dims: tuple[int, int, int, int], parent: bytes,
                                                      tenant: str, preview: str, check: int) -> None:
    meta = meta_of(dtype, dims, parent=parent, tenant=tenant, preview=preview, check=check)
    head = plain_header(meta)
    assert json_meta(head) == meta
    got = canonical_meta(head[8:])
    plain_ascii = all(" " <= c <= "~" and c not in '"\\' for c in tenant + preview)
    if plain_ascii:  # every header our encoders write for such strings takes the fast path
        assert got == meta
    else:  # escaped strings are left to the JSON parser
        assert got is None or got == meta


@settings(max_examples=200, deadline=None)
@given(dtype=st.sampled_from(sorted(ST_DTYPES)), dims=st.tuples(*[st.integers(0, 9)] * 4),
       parent=st.sampled_from([b"", PARENT]), tenant=st.text(max_size=12), preview=st.text(max_size=40),
       check=st.integers(0, (1 << 64) - 1))
def test_meta_json_writes_what_json_dumps_writes(dtype: str, dims: tuple[int, int, int, int], parent: bytes,
                                                 tenant: str, preview: str, check: int) -> None:
    """meta_json is the header's (and the disk meta record's) JSON of a meta, to the byte."""
    meta = meta_of(dtype, dims, parent=parent, tenant=tenant, preview=preview, check=check)
    assert meta_json(meta) == json.dumps(meta.to_dict(), separators=(",", ":"))
    assert BlockMeta.from_dict(json.loads(meta_json(meta))) == meta


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(edits=st.lists(st.tuples(st.integers(0, 10_000), st.sampled_from(["flip", "insert", "delete"]),
                                st.integers(0, 255)), min_size=1, max_size=3),
       tenant=st.sampled_from(["", "local", "t1"]))
def test_canonical_reader_accepts_nothing_the_parser_refuses(edits: list[tuple[int, str, int]], tenant: str) -> None:
    meta = meta_of(tenant=tenant)
    text = bytearray(plain_header(meta)[8:])
    for at, op, value in edits:
        at %= len(text) + (op == "insert")
        if op == "flip" and at < len(text):
            text[at] = value
        elif op == "insert":
            text.insert(at, value)
        elif at < len(text):
            del text[at]
    got = canonical_meta(bytes(text))
    if got is None:
        return
    record = len(text).to_bytes(8, "little") + bytes(text) + bytes(got.nbytes)
    assert full_parse(record) == got  # the parser reads the same meta, and raises nothing


def test_digits_in_non_json_form_are_left_to_the_parser() -> None:
    head = plain_header(meta_of(check=7))[8:]

    def padded(text: bytes) -> bytes:  # as long as a header may be, so that the pattern is what refuses it
        text = text.rstrip(b" ")
        return text + b" " * (-len(text) % 8)

    for bad in (head.replace(b'\\"checksum\\":7', b'\\"checksum\\":07'),
                head.replace(b'"data_offsets":[0,', b'"data_offsets":[00,'),
                *(padded(head.replace(b"[2,2,2,4,8]", dims, 1))
                  for dims in (b"[2,2,2,4,08]", b"[2,2,2,,8]", b"[2,2,2,4,8,]", b"[,2,2,2,4,8]")),
                head.replace(b'"dtype":"F16"', b'"dtype":"F32"'),
                head.rstrip(b" ") + b" " * 8):
        assert bad != head
        assert canonical_meta(bad) is None


def test_plain_header_is_remembered_by_identity_and_equal_for_equal_metas() -> None:
    meta = meta_of()
    head = plain_header(meta)
    assert plain_header(meta) is head
    twin = meta_of()
    assert twin == meta and twin is not meta
    assert plain_header(twin) == head
    assert head == build_header(meta, "kv", ST_DTYPES[meta.dtype], list(meta.shape), meta.nbytes,
                                {"compression": "none"})


def small_block(seed: int = 0) -> Block:
    payload = torch.randint(0, 256, (meta_of().nbytes,), dtype=torch.uint8,
                            generator=torch.Generator().manual_seed(seed))
    meta = meta_of(check=checksum(payload), tenant="local", preview="hello")
    return Block(meta, payload)


def test_an_encoded_record_is_parsed_without_json(monkeypatch: pytest.MonkeyPatch) -> None:
    block = small_block()
    record = encode_block(block)

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the JSON parser ran on a canonical header")

    monkeypatch.setattr(codec.json, "loads", refuse)
    parsed = parse_record(record)
    assert parsed.meta == block.meta
    out = decode_block(parsed, max_payload_bytes=1 << 20)
    assert out.meta == block.meta and torch.equal(out.payload, block.payload)


def test_a_parsed_record_is_decoded_with_every_check() -> None:
    block = small_block()
    record = bytearray(encode_block(block))
    parsed = parse_record(bytes(record))
    with pytest.raises(CorruptBlock, match="exceeds max_payload_bytes"):
        decode_block(parsed, max_payload_bytes=block.meta.nbytes - 1)
    record[-1] ^= 0xFF
    with pytest.raises(CorruptBlock, match="checksum mismatch"):
        decode_block(parse_record(bytes(record)), max_payload_bytes=1 << 20)
    view = decode_block(parse_record(bytes(record[:-1]) + bytes([record[-1] ^ 0xFF])), max_payload_bytes=1 << 20,
                        copy=False)
    assert torch.equal(view.payload, block.payload)
