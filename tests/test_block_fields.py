"""BlockMeta's one table of fields (block.META_FIELDS) against each encoding of a meta: the record
header (its JSON and the canonical reader's regex), the disk meta record, the shared-index slot and
the proto. Each carries exactly the fields the table gives it and reads them back; a field added to
the table that one encoding leaves out fails here, naming the encoding and the field."""

from __future__ import annotations

import dataclasses
import inspect
import json
import mmap
import pathlib
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from tiercache.block import DEFAULTS, META_FIELDS, Block, BlockMeta, Kind
from tiercache.codec import decode_block, encode_block
from tiercache.config import DiskConfig
from tiercache.layout import checksum
from tiercache.record_header import _CANONICAL, canonical_meta, meta_json, plain_header
from tiercache.samehost.index import (
    DTYPE_CODES,
    SLOT,
    HostIndex,
    index_size,
    slot_metas,
)
from tiercache.tiers.disk import DiskTier
from tiercache.tiers.disk_env import DiskEntry, meta_record
from tiercache.v1 import tiercache_pb2 as pb

NAMES = [f.name for f in META_FIELDS]
IN_SLOT = [f.name for f in META_FIELDS if f.slot is not None]
FROM_SLOT = [f.name for f in META_FIELDS if f.from_slot]
ON_WIRE = [f.name for f in META_FIELDS if f.wire is not None]


def same_fields(encoding: str, got: list[str], want: list[str]) -> None:
    """`got` (an encoding's fields) are `want` (the table's for it), in order; else say which differ."""
    missing, extra = [n for n in want if n not in got], [n for n in got if n not in want]
    assert got == want, f"{encoding}: lacks {missing}, has {extra} the table does not give it, in order {got}"


def full_meta(payload: torch.Tensor | None = None) -> BlockMeta:
    """A meta whose every field differs from its default and from the other fields of its kind, so
    that an encoding that drops or swaps one shows it."""
    shape = (2, 2, 4, 3, 8)
    nbytes = 2 * 2 * 4 * 3 * 8 * 2
    return BlockMeta(key=bytes(range(32)), namespace=bytes(range(100, 132)), num_tokens=3, dtype="bfloat16",
                     shape=shape, nbytes=nbytes, checksum=(1 << 64) - 12345 if payload is None else checksum(payload),
                     parent=bytes(range(50, 82)), tenant="tenant-a", preview="a preview")


def without_off(meta: BlockMeta, kept: list[str]) -> BlockMeta:
    """meta with the fields not in `kept` at their defaults: what an encoding that leaves them out reads."""
    return dataclasses.replace(meta, **{name: DEFAULTS[name] for name in NAMES if name not in kept})


def test_the_table_is_blockmeta_field_for_field() -> None:
    assert NAMES == [f.name for f in dataclasses.fields(BlockMeta)]
    meta = full_meta()
    at_default = [name for name, default in DEFAULTS.items() if getattr(meta, name) == default]
    assert not at_default, f"full_meta() must give {at_default} values other than their defaults"


def test_every_field_an_encoding_leaves_out_says_why() -> None:
    unexplained = [f.name for f in META_FIELDS if (f.slot is None or not f.from_slot or f.wire is None) and not f.why]
    assert not unexplained, f"fields left out of an encoding (or taken from elsewhere) without a why: {unexplained}"
    assert all(f.from_slot <= (f.slot is not None) for f in META_FIELDS), "from_slot needs a slot type"


# ---- the record header: its JSON, the canonical reader's regex -------------------------------------


def test_the_record_header_carries_every_field() -> None:
    meta = full_meta()
    same_fields("meta_json", list(json.loads(meta_json(meta))), NAMES)
    header = json.loads(plain_header(meta)[8:])["__metadata__"]["meta"]
    same_fields("plain_header's meta", list(json.loads(header)), NAMES)
    # The regex names each field it captures as \"name\": inside the meta's JSON string.
    same_fields("canonical regex", [m.decode() for m in re.findall(rb'\\\\"(\w+)\\\\":', _CANONICAL.pattern)], NAMES)


def test_the_record_header_reads_back_every_field() -> None:
    payload = torch.arange(full_meta().nbytes, dtype=torch.int64).remainder(7).to(torch.uint8)
    meta = full_meta(payload)
    assert canonical_meta(plain_header(meta)[8:]) == meta
    assert BlockMeta.from_dict(json.loads(meta_json(meta))) == meta
    for compression in ("none", "zstd"):  # the whole record, through the codec's readers
        record = bytes(encode_block(Block(meta, payload), compression=compression))
        assert (b'"compression":"zstd"' in record) == (compression == "zstd")
        assert decode_block(record, max_payload_bytes=1 << 20).meta == meta


def test_meta_json_writes_what_the_generic_encoder_writes() -> None:
    meta = full_meta()
    assert meta_json(meta) == json.dumps(meta.to_dict(), separators=(",", ":"))
    # A bool is an int to mypy and to __post_init__, not to meta_json: the generic encoder writes it.
    odd = dataclasses.replace(meta, num_tokens=True, preview="é \" \\ \n")
    assert meta_json(odd) == json.dumps(odd.to_dict(), separators=(",", ":"))


# ---- the disk meta record ----------------------------------------------------------------------------


def test_the_disk_meta_record_carries_every_field() -> None:
    meta = full_meta()
    record = json.loads(meta_record(DiskEntry(meta, {"hits": 2}, 8192, 1.5)))
    same_fields("disk meta record", list(record["meta"]), NAMES)
    assert BlockMeta.from_dict(record["meta"]) == meta


def test_the_disk_meta_record_reads_back_every_field_after_a_restart(tmp_path: pathlib.Path) -> None:
    payload = torch.arange(full_meta().nbytes, dtype=torch.int64).remainder(7).to(torch.uint8)
    meta = full_meta(payload)
    cfg = DiskConfig(capacity_bytes=16 << 20)
    tier = DiskTier(tmp_path / "disk", cfg, max_block_bytes=1 << 20)
    assert tier.put(Block(meta, payload))
    tier.close()
    tier = DiskTier(tmp_path / "disk", cfg, max_block_bytes=1 << 20)  # a start reads the meta records alone
    try:
        assert list(tier.metas()) == [meta]
    finally:
        tier.close()


# ---- the shared-index slot ---------------------------------------------------------------------------


def slot_of(meta: BlockMeta) -> np.ndarray:
    """The slot HostIndex.publish writes for meta (one SLOT record)."""
    index = HostIndex(mmap.mmap(-1, index_size(16)[1]), 16)
    assert index.publish(meta, [3, 4, 7])
    slot = index._slots[index._where[meta.key]].copy()
    index.close()
    return slot


# What a slot holds for a field of each kind, and what publish should have written there.
SLOT_VALUE: dict[Kind, Callable[[Any], Any]] = {Kind.KEY: bytes, Kind.LINK: bytes, Kind.COUNT: int, Kind.DTYPE: int,
                                                Kind.DIMS: lambda v: tuple(v.tolist())}
SLOT_FORM: dict[Kind, Callable[[Any], Any]] = {Kind.DTYPE: DTYPE_CODES.__getitem__,
                                               Kind.LINK: lambda v: v.ljust(32, b"\0")}
SLOT_FIELDS = dict(SLOT.fields or {})


def test_the_slot_carries_every_field_the_table_gives_it() -> None:
    same_fields("SLOT", sorted(name for name in SLOT_FIELDS if name in NAMES), sorted(IN_SLOT))
    for f in META_FIELDS:
        if f.slot is not None:
            want = np.dtype((f.slot[0], f.slot[1])) if isinstance(f.slot, tuple) else np.dtype(f.slot)
            assert SLOT_FIELDS[f.name][0] == want, f"slot type of {f.name}"
    meta = full_meta()
    slot = slot_of(meta)
    for f in META_FIELDS:  # publish wrote every slotted field (key and parent: the store's), in its slot form
        if f.slot is not None:
            written = SLOT_VALUE[f.kind](slot[f.name])
            assert written == SLOT_FORM.get(f.kind, lambda v: v)(getattr(meta, f.name)), f"publish: {f.name}"


def test_the_slot_reads_back_every_field_the_table_gives_it() -> None:
    meta = full_meta()
    client_key, client_parent = bytes(range(200, 232)), bytes(range(150, 182))  # what the reader knows them by
    read = slot_metas(slot_of(meta).reshape(1), [client_key], [client_parent])
    assert read == [dataclasses.replace(without_off(meta, IN_SLOT), key=client_key, parent=client_parent)]
    same_fields("slot_metas", list(vars(read[0])), NAMES)


# ---- the proto ---------------------------------------------------------------------------------------


def test_the_proto_carries_every_field_the_table_gives_it() -> None:
    proto = [f.name for f in sorted(pb.BlockMeta.DESCRIPTOR.fields, key=lambda f: f.number)]
    same_fields("proto BlockMeta", proto, [f.wire for f in META_FIELDS if f.wire is not None])
    message = full_meta().to_wire(pb.BlockMeta)
    same_fields("to_wire", [f.name for f, _ in message.ListFields()], proto)


def test_the_proto_reads_back_every_field_the_table_gives_it() -> None:
    meta = full_meta()
    sent = pb.BlockMeta.FromString(meta.to_wire(pb.BlockMeta).SerializeToString())
    assert BlockMeta.from_wire(sent) == without_off(meta, ON_WIRE)


def test_a_client_meta_made_without_checks_has_every_field() -> None:
    """checked_already's parameters are the fields on the wire, in the table's order."""
    meta = without_off(full_meta(), ON_WIRE)
    same_fields("checked_already", list(inspect.signature(BlockMeta.checked_already).parameters), ON_WIRE)
    made = BlockMeta.checked_already(*(getattr(meta, name) for name in ON_WIRE))
    assert made == meta and list(vars(made)) == NAMES
    columns = BlockMeta.checked_already_columns({name: [getattr(meta, name)] * 2 for name in ON_WIRE})
    assert columns == [meta, meta] and list(vars(columns[0])) == NAMES
    with pytest.raises(KeyError):
        BlockMeta.checked_already_columns({"key": [meta.key]})  # a field without a default must be given
