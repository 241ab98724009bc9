"""The block record round-trips every dtype and rejects every malformed, oversized or lying record."""

from __future__ import annotations

import hashlib
import json
import struct

import numpy as np
import pytest
import safetensors.torch
import torch
import xxhash
import zstandard
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tiercache.block import Block, BlockMeta
from tiercache.codec import FORMAT, RecordBuffer, decode_block, decode_run, encode_block, record_meta, record_size
from tiercache.errors import CorruptBlock, InvalidArgument
from tiercache.layout import CHECKSUM_ALG, DTYPES, checksum, legacy_sum64

MiB = 1 << 20
SHAPE = (2, 2, 3, 4, 8)


def make_block(dtype: str = "float32", shape: tuple[int, ...] = SHAPE, seed: int = 0,
               compressible: bool = False) -> Block:
    g = torch.Generator().manual_seed(seed)
    if compressible:  # a few distinct values, like quantised or saturated activations
        values = torch.randint(0, 4, shape, generator=g).to(DTYPES[dtype])
    else:
        values = torch.randn(shape, generator=g).to(DTYPES[dtype])
    payload = values.reshape(-1).view(torch.uint8).clone()
    key = hashlib.blake2b(f"{dtype}/{shape}/{seed}".encode(), digest_size=32).digest()
    meta = BlockMeta(key=key, namespace=bytes(range(32)), num_tokens=shape[3], dtype=dtype, shape=shape,
                     nbytes=payload.numel(), checksum=checksum(payload), parent=bytes(32), tenant="t", preview="héllo")
    return Block(meta, payload)


def split(record: bytes) -> tuple[dict, bytes]:
    n = int.from_bytes(record[:8], "little")
    return json.loads(record[8 : 8 + n]), record[8 + n :]


def join(header: dict, data: bytes) -> bytes:
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + data


def zstd_record(meta: BlockMeta, frame: bytes, raw_size: int | None = None) -> bytes:
    """A compressed record around an arbitrary frame (for bombs and liars)."""
    header = {"__metadata__": {"format": FORMAT, "checksum_alg": CHECKSUM_ALG, "compression": "zstd",
                               "shuffle": "0", "raw_size": str(meta.nbytes if raw_size is None else raw_size),
                               "meta": json.dumps(meta.to_dict())},
              "kv.zst": {"dtype": "U8", "shape": [len(frame)], "data_offsets": [0, len(frame)]}}
    return join(header, frame)


def reject(record: bytes | bytearray, match: str, **kw: object) -> None:
    kw.setdefault("max_payload_bytes", 64 * MiB)
    with pytest.raises(CorruptBlock, match=match):
        decode_block(record, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("compression,shuffle", [("none", False), ("zstd", True), ("zstd", False)])
def test_round_trip_is_bit_identical(dtype: str, compression: str, shuffle: bool) -> None:
    block = make_block(dtype, compressible=True)
    record = encode_block(block, compression=compression, shuffle=shuffle)
    header, _ = split(record)
    assert header["__metadata__"]["compression"] == compression
    if compression == "zstd":
        assert header["__metadata__"]["shuffle"] == ("1" if shuffle else "0")
        assert len(record) < record_size(block.meta)
    for data in (record, bytearray(record), memoryview(record)):
        out = decode_block(data, max_payload_bytes=MiB, expected_key=block.meta.key)
        assert out.meta == block.meta
        assert torch.equal(out.payload, block.payload)
    assert record_meta(record) == block.meta


def test_uncompressed_record_is_a_safetensors_file_with_the_real_dtype_and_shape() -> None:
    block = make_block("bfloat16")
    record = encode_block(block)
    assert len(record) == record_size(block.meta)
    assert (len(record) - block.meta.nbytes) % 8 == 0, "tensor data must start 8-byte aligned"
    loaded = safetensors.torch.load(record)
    assert list(loaded) == ["kv"]
    assert loaded["kv"].dtype == torch.bfloat16 and tuple(loaded["kv"].shape) == SHAPE
    assert torch.equal(loaded["kv"].reshape(-1).view(torch.uint8), block.payload)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_shuffle_groups_low_bytes_then_high_bytes(dtype: str) -> None:
    block = make_block(dtype, compressible=True)
    _, frame = split(encode_block(block, compression="zstd", shuffle=True))
    planes = zstandard.ZstdDecompressor().decompress(frame)
    raw = block.payload.numpy().tobytes()
    itemsize = DTYPES[dtype].itemsize
    assert planes == b"".join(raw[i::itemsize] for i in range(itemsize))


def test_incompressible_block_stays_uncompressed() -> None:
    block = make_block("float32", shape=(4, 2, 4, 16, 16))
    payload = torch.randint(0, 256, (block.meta.nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    block = Block(BlockMeta(**{**block.meta.__dict__, "checksum": checksum(payload)}), payload)
    record = encode_block(block, compression="zstd")
    assert split(record)[0]["__metadata__"]["compression"] == "none"
    assert len(record) == record_size(block.meta)
    assert torch.equal(decode_block(record, max_payload_bytes=MiB).payload, payload)


def test_decoded_payload_is_a_fresh_contiguous_copy() -> None:
    block = make_block()
    for compression in ("none", "zstd"):
        data = bytearray(encode_block(make_block(compressible=True) if compression == "zstd" else block,
                                      compression=compression))
        out = decode_block(data, max_payload_bytes=MiB)
        before = out.payload.clone()
        data[-block.meta.nbytes // 2 :] = bytes(block.meta.nbytes // 2)
        assert out.payload.dtype == torch.uint8 and out.payload.dim() == 1 and out.payload.is_contiguous()
        assert torch.equal(out.payload, before), "payload must not alias the record buffer"


def test_a_run_decodes_like_block_by_block_and_stops_at_the_first_bad_record() -> None:
    blocks = [make_block("float16", seed=1), make_block("float32", seed=2, compressible=True),
              make_block("float8_e4m3fn", shape=(1, 2, 1, 3, 1), seed=3),  # 6 bytes: not whole words
              make_block("float32", seed=4), make_block("float32", seed=5)]
    records = [encode_block(blocks[0]), encode_block(blocks[1], compression="zstd"), encode_block(blocks[2]),
               encode_block(blocks[3]), encode_block(blocks[4])]
    assert split(records[1])[0]["__metadata__"]["compression"] == "zstd"  # decoded one by one
    keys = [b.meta.key for b in blocks]
    decoded, error = decode_run(records, max_payload_bytes=MiB, expected_keys=keys)
    assert error is None and [d.meta for d in decoded] == [b.meta for b in blocks]
    assert all(torch.equal(d.payload, b.payload) for d, b in zip(decoded, blocks))
    # A flipped payload byte in the middle: the blocks before it, and its error; never its bytes.
    damaged = bytearray(records[3])
    damaged[-5] ^= 0x10
    decoded, error = decode_run(records[:3] + [bytes(damaged)] + records[4:], max_payload_bytes=MiB,
                                expected_keys=keys)
    assert isinstance(error, CorruptBlock) and "checksum mismatch" in str(error)
    assert [d.meta.key for d in decoded] == keys[:3]
    # A record under the wrong key ends the run there too, before any copy.
    decoded, error = decode_run(records, max_payload_bytes=MiB, expected_keys=keys[:1] + keys[2:] + keys[:1])
    assert isinstance(error, CorruptBlock) and "does not match the expected key" in str(error) and len(decoded) == 1


def test_empty_block_round_trips() -> None:
    block = make_block(shape=(2, 2, 3, 0, 8))
    for compression in ("none", "zstd"):
        out = decode_block(encode_block(block, compression=compression), max_payload_bytes=0)
        assert out.meta == block.meta and out.payload.numel() == 0


def test_encode_rejects_inconsistent_blocks() -> None:
    block = make_block()
    with pytest.raises(InvalidArgument, match="payload has"):
        encode_block(Block(block.meta, block.payload[:-1]))
    with pytest.raises(InvalidArgument, match="does not match"):
        encode_block(Block(BlockMeta(**{**block.meta.__dict__, "num_tokens": 5}), block.payload))
    with pytest.raises(InvalidArgument, match="bytes, meta says"):
        encode_block(Block(BlockMeta(**{**block.meta.__dict__, "dtype": "float16"}), block.payload))
    with pytest.raises(InvalidArgument, match="unknown compression"):
        encode_block(block, compression="lz4")


def test_header_is_canonical_json_of_the_meta() -> None:
    """The header is written by hand for speed: it must be exactly what json.dumps would write."""
    block = make_block()
    odd = BlockMeta(**{**block.meta.__dict__, "tenant": 'a"b\\c\n\x01', "preview": "héllo 🙂 </s>"})
    for b in (block, Block(odd, block.payload), make_block(shape=(2, 2, 3, 0, 8))):
        for compression in ("none", "zstd"):
            record = bytes(encode_block(b, compression=compression))
            n = int.from_bytes(record[:8], "little")
            header = json.loads(record[8 : 8 + n])
            assert record[8 : 8 + n].rstrip(b" ") == json.dumps(header, separators=(",", ":")).encode()
            assert header["__metadata__"]["meta"] == json.dumps(b.meta.to_dict(), separators=(",", ":"))


def test_encode_into_a_record_buffer_reuses_its_memory() -> None:
    small, big = make_block(seed=1), make_block(shape=(2, 2, 3, 8, 8), seed=2)
    buf = RecordBuffer()
    first = encode_block(small, into=buf)
    assert bytes(first) == encode_block(small)
    address = np.frombuffer(first, dtype=np.uint8).ctypes.data
    second = encode_block(make_block(seed=3), into=buf)
    assert np.frombuffer(second, dtype=np.uint8).ctypes.data == address, "the buffer is reused, not reallocated"
    assert bytes(encode_block(big, into=buf)) == encode_block(big)  # grows for a larger record
    packed = encode_block(make_block(compressible=True), compression="zstd", into=buf)
    assert isinstance(packed, bytes) and split(packed)[0]["__metadata__"]["compression"] == "zstd"


def test_checksum_is_xxh3_64_of_the_bytes_in_memory_order() -> None:
    # XXH3-64 with seed 0: the published value for the empty input, then the library on random data.
    assert checksum(b"") == 0x2D06800538D394C2
    rng = np.random.default_rng(0)
    for n in (0, 1, 7, 8, 9, 4095, 4101):
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
        for form in (data, bytearray(data), memoryview(data), tensor, np.frombuffer(data, dtype=np.uint8)):
            assert checksum(form) == xxhash.xxh3_64_intdigest(data), (n, type(form))
        assert checksum(tensor[1::2]) == xxhash.xxh3_64_intdigest(data[1::2])  # non-contiguous tensors are accepted
    values = torch.randn(3, 5, dtype=torch.bfloat16, requires_grad=True)
    assert checksum(values) == xxhash.xxh3_64_intdigest(values.detach().view(torch.uint8).numpy().tobytes())
    assert checksum(values.t()) == xxhash.xxh3_64_intdigest(values.detach().t().contiguous().view(torch.uint8)
                                                          .numpy().tobytes())


def test_checksum_sees_what_a_word_sum_missed() -> None:
    """The mutations a wrapping sum of u64 words (sum64, format v1) cannot see: each changes XXH3-64."""
    data = bytearray(np.random.default_rng(1).integers(0, 256, 256 << 10, dtype=np.uint8).tobytes())
    page = 64 << 10
    swapped_pages = data[page : 2 * page] + data[:page] + data[2 * page :]
    swapped_words = data[8:16] + data[:8] + data[16:]
    flipped = bytearray(data)
    flipped[7] ^= 0x80  # bit 63 of word 0
    flipped[15] ^= 0x80  # and of word 1: together they add 2**64
    for mutated in (swapped_pages, swapped_words, flipped):
        assert mutated != data and legacy_sum64(mutated) == legacy_sum64(data)  # what sum64 missed
        assert checksum(mutated) != checksum(data)
    assert checksum(data[:-8]) != checksum(data) and checksum(data + bytes(8)) != checksum(data)


# ---- rejections ---------------------------------------------------------------------------------
@pytest.fixture
def record() -> bytes:
    return encode_block(make_block())


def edit(record: bytes, change) -> bytes:  # type: ignore[no-untyped-def]
    header, data = split(record)
    change(header)
    return join(header, data)


def test_rejects_short_and_oversized_headers(record: bytes) -> None:
    reject(record[:5], "shorter than the 8-byte header")
    reject((2 * MiB).to_bytes(8, "little") + record[8:], "exceeds the 1048576-byte limit")
    reject(record[:8] + record[8:40], "truncated: header length")
    reject((4).to_bytes(8, "little") + b"{{{{" + record[12:], "not valid JSON")
    reject((4).to_bytes(8, "little") + b"[1] ", "not a JSON object")
    reject((4000).to_bytes(8, "little") + b"[" * 4000, "not valid JSON")


def test_rejects_wrong_tensor_count_format_and_metadata(record: bytes) -> None:
    extra = {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}
    reject(edit(record, lambda h: h.update(other=extra)), "exactly one tensor, found 2")
    reject(edit(record, lambda h: h.pop("kv")), "exactly one tensor, found 0")
    reject(edit(record, lambda h: h["__metadata__"].update(format="other.v9")), "format 'other.v9'")
    reject(edit(record, lambda h: h["__metadata__"].update(checksum_alg="crc32")), "checksum_alg 'crc32'")
    reject(edit(record, lambda h: h["__metadata__"].update(compression="lz4")), "unknown compression 'lz4'")
    reject(edit(record, lambda h: h["__metadata__"].update(note="x")), "metadata fields")
    reject(edit(record, lambda h: h["__metadata__"].update(meta="{not json")), "meta is malformed")
    reject(edit(record, lambda h: h["__metadata__"].update(meta='{"key": "00"}')), "meta is malformed")
    reject(edit(record, lambda h: h.update(__metadata__={"format": 1})), "table of strings")


def test_rejects_dtype_shape_and_offsets_inconsistent_with_meta(record: bytes) -> None:
    reject(edit(record, lambda h: h["kv"].update(dtype="F16")), "does not match meta")
    reject(edit(record, lambda h: h["kv"].update(shape=[2, 2, 3, 8, 4])), "does not match meta")
    reject(edit(record, lambda h: h["kv"].update(data_offsets=[0, 10])), "data_offsets")
    reject(edit(record, lambda h: h["kv"].update(data_offsets=[8, 776])), "data_offsets")
    reject(edit(record, lambda h: h["kv"].update(extra=1)), "exactly dtype, shape and data_offsets")

    def lie_about_tokens(h: dict) -> None:
        meta = json.loads(h["__metadata__"]["meta"])
        meta["num_tokens"] = 5
        h["__metadata__"]["meta"] = json.dumps(meta)
    reject(edit(record, lie_about_tokens), "does not match")


def test_rejects_truncated_and_oversized_records(record: bytes) -> None:
    reject(record[:-1], "data_offsets")
    reject(record + b"\0", "data_offsets")
    reject(record[: len(record) // 2], "data_offsets|truncated")


def test_rejects_payload_over_the_limit_before_copying(record: bytes) -> None:
    nbytes = record_meta(record).nbytes
    reject(record, "exceeds max_payload_bytes", max_payload_bytes=nbytes - 1)
    assert decode_block(record, max_payload_bytes=nbytes).meta.nbytes == nbytes


def test_rejects_checksum_mismatch_and_wrong_key(record: bytes) -> None:
    damaged = bytearray(record)
    damaged[-3] ^= 0x10
    reject(damaged, "checksum mismatch")
    assert record_meta(damaged) == record_meta(record), "record_meta reads only the header"
    reject(record, "does not match the expected key", expected_key=bytes(32))


def test_a_remembered_header_still_gets_every_payload_check(record: bytes) -> None:
    # The first decode remembers the parsed header; what follows reuses it and must still fail.
    assert decode_block(record, max_payload_bytes=MiB).meta == record_meta(record)
    reject(record[:-8], "data_offsets")
    reject(record + bytes(8), "data_offsets")
    damaged = bytearray(record)
    damaged[-1] ^= 0x01
    reject(damaged, "checksum mismatch")
    reject(record, "exceeds max_payload_bytes", max_payload_bytes=record_meta(record).nbytes - 1)
    assert decode_block(record, max_payload_bytes=MiB).meta == record_meta(record)


def test_expected_meta_takes_the_fast_path_and_keeps_every_check(record: bytes) -> None:
    meta = record_meta(record)
    out = decode_block(record, max_payload_bytes=MiB, expected_meta=meta)
    assert out.meta == meta and checksum(out.payload) == meta.checksum
    other = BlockMeta(**{**meta.__dict__, "preview": "another"})
    reject(record, "does not match the expected metadata", expected_meta=other)
    # A valid header that is not byte-identical to ours (spaces, key order) still decodes, via the parse.
    header, data = split(record)
    assert decode_block(join(header, data), max_payload_bytes=MiB, expected_meta=meta).meta == meta
    # Damage gets the same precise error with or without the expected meta.
    for damaged, match in [(edit(record, lambda h: h["kv"].update(data_offsets=[0, 10])), "data_offsets"),
                           (record[:-1], "data_offsets"), (record[:5], "shorter than"),
                           (record[:8] + record[9:], "not valid JSON|data_offsets")]:
        reject(damaged, match)
        reject(damaged, match, expected_meta=meta)
    flipped = bytearray(record)
    flipped[-3] ^= 0x10
    reject(flipped, "checksum mismatch", expected_meta=meta)
    reject(record, "exceeds max_payload_bytes", expected_meta=meta, max_payload_bytes=meta.nbytes - 1)
    packed = encode_block(make_block(compressible=True), compression="zstd")
    assert decode_block(packed, max_payload_bytes=MiB, expected_meta=record_meta(packed)).meta == record_meta(packed)


def test_rejects_compressed_records_with_bad_sizes() -> None:
    block = make_block(compressible=True)
    record = encode_block(block, compression="zstd")
    header, frame = split(record)
    reject(zstd_record(block.meta, frame, raw_size=block.meta.nbytes + 1), "raw_size")
    reject(zstd_record(block.meta, frame + b"\0"), "does not decompress")
    reject(zstd_record(block.meta, b"\0" * 16), "frame header is invalid")
    other = zstandard.ZstdCompressor().compress(bytes(block.meta.nbytes * 2))
    reject(zstd_record(block.meta, other), f"content size {2 * block.meta.nbytes} does not match")
    reject(record, "exceeds", max_payload_bytes=block.meta.nbytes - 1)
    damaged = bytearray(record)
    damaged[-len(frame) // 2] ^= 0xFF
    with pytest.raises(CorruptBlock):
        decode_block(damaged, max_payload_bytes=MiB)


def bomb_meta(nbytes: int) -> BlockMeta:
    shape = (nbytes // (2 * 16 * 16 * 16 * 4), 2, 16, 16, 16)  # float32, canonical layout
    return BlockMeta(key=bytes(32), namespace=bytes(32), num_tokens=16, dtype="float32", shape=shape,
                     nbytes=nbytes, checksum=0)


def test_zstd_bomb_is_refused_without_expanding() -> None:
    frame = zstandard.ZstdCompressor(level=19).compress(bytes(64 * MiB))
    assert len(frame) < 64 * 1024
    # An honest frame whose declared size is far over the limit: refused from the header alone.
    reject(zstd_record(bomb_meta(64 * MiB), frame), "exceeds max_payload_bytes", max_payload_bytes=MiB)
    # A small record whose frame declares 64 MiB: refused before decompressing.
    reject(zstd_record(bomb_meta(MiB), frame), "content size 67108864 does not match raw_size=1048576")
    # A frame with no content size at all.
    hidden = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(64 * MiB))
    reject(zstd_record(bomb_meta(MiB), hidden), "content size absent")
    # A frame that lies: it declares 1 MiB but expands to 64 MiB; the output bound stops it.
    descriptor = hidden[4]
    assert descriptor & 0xE3 == 0, "expected no content size, no single segment, no dictionary"
    liar = hidden[:4] + bytes([descriptor | 0x80]) + hidden[5:6] + struct.pack("<I", MiB) + hidden[6:]
    assert zstandard.frame_content_size(liar) == MiB
    reject(zstd_record(bomb_meta(MiB), liar), "does not decompress")


# ---- fuzz ---------------------------------------------------------------------------------------
SMALL = make_block("float16", shape=(1, 2, 2, 4, 8), compressible=True)
SAMPLES = [encode_block(SMALL), encode_block(SMALL, compression="zstd")]


_PAYLOAD_AT = len(SAMPLES[0]) - SMALL.meta.nbytes


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# Bit 63 of two payload words flipped: they cancel in a word sum, which let this record through.
@example(which=0, cut=0, tail=b"", flips=[(_PAYLOAD_AT + 7, 0x80), (_PAYLOAD_AT + 15, 0x80)], junk=b"", at=0,
         knows_meta=True)
@given(which=st.integers(0, 1), cut=st.integers(0, 2000), tail=st.binary(max_size=16),
       flips=st.lists(st.tuples(st.integers(0, 2000), st.integers(1, 255)), max_size=4),
       junk=st.binary(max_size=64), at=st.integers(0, 2000), knows_meta=st.booleans())
def test_fuzzed_records_raise_only_corrupt_block(which: int, cut: int, tail: bytes, flips: list[tuple[int, int]],
                                                 junk: bytes, at: int, knows_meta: bool) -> None:
    original = SAMPLES[which]
    data = bytearray(original)
    for pos, mask in flips:
        data[pos % len(data)] ^= mask
    if junk:
        data[at % len(data) : at % len(data) + len(junk)] = junk
    data = data[: cut % (len(data) + 1)] + tail if cut % 3 else data
    try:
        out = decode_block(bytes(data), max_payload_bytes=4096, expected_key=SMALL.meta.key,
                           expected_meta=SMALL.meta if knows_meta else None)
    except CorruptBlock:
        return
    # A mutation that survives must have left the key and every payload byte intact (e.g. header whitespace).
    assert out.meta.key == SMALL.meta.key and torch.equal(out.payload, SMALL.payload)
    assert out.meta == SMALL.meta or not knows_meta


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=600))
def test_random_bytes_raise_only_corrupt_block(data: bytes) -> None:
    with pytest.raises(CorruptBlock):
        decode_block(data, max_payload_bytes=4096)
    with pytest.raises(CorruptBlock):
        decode_block(len(data).to_bytes(8, "little") + data, max_payload_bytes=4096)
