"""Protobuf wire bytes by hand: framed where the message classes would copy a block's bytes again
(the daemon's Fetch replies in server/records.py, the client's PutBatch requests), walked where
parsing would cost more than the answer (the client's Fetch replies, the daemon's guard against
requests of millions of tiny fields)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

# StagedPayload.file: a same-host client's staging file is named this, then its pid (proto/tiercache/v1).
STAGING_PREFIX = "tiercache-stage-"

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


def read_varint(buf: bytes | memoryview, pos: int) -> tuple[int, int]:
    """The varint at buf[pos:] and the position after it; ValueError if truncated or over 64 bits."""
    result = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("truncated or overlong varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def walk_fields(buf: memoryview) -> Iterator[tuple[int, int | memoryview]]:
    """(field number, value) of each top-level field of a serialized message; length-delimited values
    are zero-copy views, fixed-width ones are skipped (no message walked here has any). ValueError
    where the message is malformed."""
    pos = 0
    while pos < len(buf):
        tag, pos = read_varint(buf, pos)
        wire = tag & 7
        if wire == 0:
            value, pos = read_varint(buf, pos)
            yield tag >> 3, value
        elif wire == 2:
            size, pos = read_varint(buf, pos)
            if pos + size > len(buf):
                raise ValueError(f"field {tag >> 3} runs past the end of the message")
            yield tag >> 3, buf[pos : pos + size]
            pos += size
        elif wire in (1, 5):
            pos += 8 if wire == 1 else 4
        else:
            raise ValueError(f"unsupported wire type {wire}")


def has_more_fields(data: bytes, limit: int) -> bool:
    """Whether the serialized message `data` has more than `limit` top-level fields, found by walking
    its tags and lengths without parsing it (one step per field, however long). Parsing a message of
    millions of empty entries costs 16-48x its size in memory; this costs nothing but time, and only
    for messages longer than `limit` bytes (every field takes at least one). A malformed message
    answers False: the parser then refuses it."""
    if len(data) <= limit:
        return False
    try:
        for count, _ in enumerate(walk_fields(memoryview(data)), 1):
            if count > limit:
                return True
    except ValueError:
        return False
    return False


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
