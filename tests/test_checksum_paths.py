"""The block checksum sees what a paged pool's failures look like: two swapped pages, two swapped
words, two flips of bit 63 that cancel in a word sum, and truncation, on every path a block takes:
a record (the byte stream and the disk both carry records), the disk tier, the slab copied out by a
same-host client, the slab as views, and the daemon's byte stream. Each damaged block is caught:
never handed to a caller, counted, and (where another copy exists) served from the intact copy."""

from __future__ import annotations

import pathlib

import grpc
import lmdb
import pytest
import torch

from benchmarks.daemons import chain, cleanup, running_server, short_dir, small_config, tokens
from benchmarks.reliability import intact, slab_pages
from tiercache import codec
from tiercache.block import Block
from tiercache.client import CHANNEL_OPTIONS, Client, parse_fetch_response
from tiercache.config import DiskConfig
from tiercache.errors import CorruptBlock
from tiercache.keys import Namespace
from tiercache.layout import BlockLayout, legacy_sum64
from tiercache.tiers.disk import DiskTier
from tiercache.v1 import tiercache_pb2 as pb

PAGE = 4096
# 4 pages of 4 KiB a block (16 KiB of float16): big enough to swap pages within one block.
BIG = Namespace(model="checksum-test", weights="w", dtype="float16", num_layers=8, num_kv_heads=2, head_dim=16,
                block_tokens=16)


def swap_pages(data: bytearray, at: int = 0) -> None:
    first, second = data[at : at + PAGE], data[at + PAGE : at + 2 * PAGE]
    data[at : at + PAGE], data[at + PAGE : at + 2 * PAGE] = second, first


def swap_words(data: bytearray, at: int = 0) -> None:
    data[at : at + 8], data[at + 8 : at + 16] = data[at + 8 : at + 16], data[at : at + 8]


def flip_bit63_twice(data: bytearray, at: int = 0) -> None:
    data[at + 7] ^= 0x80
    data[at + 15] ^= 0x80


MUTATIONS = {"swapped pages": swap_pages, "swapped words": swap_words, "two bit-63 flips": flip_bit63_twice}


def mutated_payload(block, mutate) -> bytearray:  # type: ignore[no-untyped-def]
    data = bytearray(block.payload.numpy().tobytes())
    mutate(data)
    assert data != block.payload.numpy().tobytes() and legacy_sum64(data) == legacy_sum64(block.payload.numpy()), \
        "the mutation must be one a word sum cannot see"
    return data


def damaged_records(block) -> dict[str, bytes]:  # type: ignore[no-untyped-def]
    """The block's record with each mutation applied to its payload, and truncated."""
    record = bytes(codec.encode_block(block))
    head = len(record) - block.meta.nbytes
    out = {name: record[:head] + bytes(mutated_payload(block, mutate)) for name, mutate in MUTATIONS.items()}
    out["truncated"] = record[:-8]
    return out


def test_a_record_with_any_such_damage_is_refused_alone_and_in_a_run() -> None:
    blocks = chain(tokens(71, 3), ns=BIG)
    for name, bad in damaged_records(blocks[1]).items():
        with pytest.raises(CorruptBlock):
            codec.decode_block(bad, max_payload_bytes=1 << 20, expected_key=blocks[1].meta.key)
        records = [bytes(codec.encode_block(blocks[0])), bad, bytes(codec.encode_block(blocks[2]))]
        got, error = codec.decode_run(records, max_payload_bytes=1 << 20, expected_keys=[b.meta.key for b in blocks])
        assert len(got) == 1 and isinstance(error, CorruptBlock), name
        assert intact(got)


def test_the_disk_tier_drops_and_counts_every_damaged_record(tmp_path: pathlib.Path) -> None:
    blocks = chain(tokens(72, 5), ns=BIG)
    cfg = DiskConfig(capacity_bytes=64 << 20)
    tier = DiskTier(tmp_path / "disk", cfg, max_block_bytes=1 << 20)
    for block in blocks:
        tier.put(block)
    tier.close()
    damage = dict(zip([b.meta.key for b in blocks], damaged_records(blocks[0]).items()))  # 4 kinds
    env = lmdb.open(str(tmp_path / "disk"), max_dbs=4)
    with env.begin(write=True) as txn:
        db = env.open_db(b"blocks", txn=txn)
        for block in blocks[:4]:
            name, _ = damage[block.meta.key]
            record = damaged_records(block)[name]
            txn.put(block.meta.key, record, db=db)
    env.close()
    tier = DiskTier(tmp_path / "disk", cfg, max_block_bytes=1 << 20)
    try:
        for block in blocks[:4]:
            with pytest.raises(CorruptBlock):
                tier.get(block.meta.key)
            assert not tier.contains(block.meta.key)
        assert intact([tier.get(blocks[4].meta.key)])
        assert tier.stats().verification_failures == 4
        tier.flush()
        tier.check_integrity()
    finally:
        tier.close()


def damage_in_slab(address: str, keys: list[bytes], index: int, mutate) -> None:  # type: ignore[no-untyped-def]
    """Apply `mutate` to the bytes of block `index` where they lie in the daemon's host slab."""
    path, header_bytes, page_bytes, pages = slab_pages(address, keys)
    assert page_bytes == PAGE and len(pages[index]) == 4
    with open(path, "r+b") as f:
        spans = [header_bytes + p * page_bytes for p in pages[index][:2]]
        data = bytearray()
        for at in spans:
            f.seek(at)
            data += f.read(page_bytes)
        mutate(data)
        for i, at in enumerate(spans):
            f.seek(at)
            f.write(data[i * page_bytes : (i + 1) * page_bytes])


def fetched_into(client: Client, keys: list[bytes]) -> list[Block]:
    """Client.fetch_into into fresh tensors, as blocks."""
    nbytes = BlockLayout.of(BIG).nbytes()
    outs = [torch.empty(nbytes, dtype=torch.uint8) for _ in keys]
    return [Block(meta, out) for meta, out in zip(client.fetch_into(keys, outs), outs)]


def raw_fetch(address: str, keys: list[bytes]) -> list[bytes]:
    """The daemon's byte stream as a caller without checksums of its own reads it."""
    channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    try:
        call = channel.unary_stream("/tiercache.v1.TierCache/Fetch",
                                    request_serializer=pb.FetchRequest.SerializeToString)
        return [body for data in call(pb.FetchRequest(keys=keys), timeout=30)
                for _, body in parse_fetch_response(data)[1]]
    finally:
        channel.close()


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_damage_in_the_slab_is_caught_on_every_read_path(mutation: str) -> None:
    """One chain per path, its block 2 damaged in the slab: the same-host copy, the views, the copy
    into the caller's tensors, the client's byte stream and a raw caller's byte stream each get the
    intact disk copy, never the damaged bytes, and each catch is counted."""
    mutate = MUTATIONS[mutation]
    base = short_dir()
    try:
        config = small_config(base, host_pages=256)
        with running_server(config) as (store, address), Client(address) as client:
            paths = {
                "same-host copy": lambda keys: client.fetch(keys, shared_memory=True),
                "views": lambda keys: list(client.fetch_views(keys)),
                "into the caller's tensors": lambda keys: fetched_into(client, keys),
                "byte stream": lambda keys: client.fetch(keys, shared_memory=False),
                "raw byte stream": lambda keys: [codec.decode_block(r, max_payload_bytes=1 << 20, expected_key=k)
                                                 for r, k in zip(raw_fetch(address, keys), keys)],
            }
            for n, (path, read) in enumerate(paths.items()):
                blocks = chain(tokens(80 + n, 4), ns=BIG)
                keys = [b.meta.key for b in blocks]
                client.put(blocks, durable=True)  # the disk copy exists before the slab is damaged
                assert len(client.fetch_views(keys)) == 4  # maps the slab and its index
                before = store.snapshot_counters().get("verification_failures", 0)
                damage_in_slab(address, keys, 2, mutate)
                try:
                    got = read(keys)
                except CorruptBlock as e:
                    pytest.fail(f"{path}: the daemon sent a damaged record ({e})")
                assert len(got) == 4 and intact(got), f"{path}: a damaged slab block reached the caller"
                assert store.snapshot_counters().get("verification_failures", 0) == before + 1, path
            assert client.health() == "SERVING"
            store.check_integrity()
    finally:
        cleanup(base)
