"""Protobuf wire bytes framed by hand where the message classes would copy a block's bytes again:
the daemon's Fetch replies (server/records.py) and the client's PutBatch requests."""

from __future__ import annotations

from collections.abc import Sequence

_ONE_BYTE = [bytes((n,)) for n in range(0x80)]


def varint(n: int) -> bytes:
    if n < 0x80:  # indexes, lengths of keys and small messages: the common cases, without a loop
        return _ONE_BYTE[n]
    if n < 0x4000:
        return bytes((n & 0x7F | 0x80, n >> 7))
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field: its tag byte(s), then the payload's length and bytes."""
    return tag + varint(len(payload)) + payload


def put_batch(requests: Sequence[tuple[Sequence[bytes | memoryview], bytes]]) -> bytes:
    """The wire bytes of PutBatchRequest{requests: [PutRequest, ...]}, given per PutRequest its record
    in parts (codec.plain_record_parts: the payload, last, is copied once, straight into the message)
    and its other fields already serialized (protobuf merges fields in any order)."""
    parts: list[bytes | memoryview] = []
    for record_parts, rest in requests:
        size = sum(len(part) for part in record_parts)
        head = b"\x0a" + varint(size)  # PutRequest.record = 1 (bytes)
        parts += (b"\x0a", varint(len(head) + size + len(rest)), head, *record_parts, rest)  # requests = 1
    return b"".join(parts)
