"""A disk tier's start reads metadata only: the meta db's pages, never a payload page of data.mdb.

Resident pages are measured with mincore(2) in this process after the file's page cache is dropped
with posix_fadvise(DONTNEED) (clean pages of one file, no root needed); Linux only. The sizes a start
needs come from the meta records (stored_bytes), which the other tests here cover.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import sys

import lmdb
import pytest
import torch

from tiercache import codec
from tiercache.block import Block, BlockMeta
from tiercache.config import DiskConfig
from tiercache.layout import checksum
from tiercache.samehost import disk_files
from tiercache.tiers import disk_env
from tiercache.tiers.disk import DiskTier

MiB = 1 << 20
GiB = 1 << 30
# Llama-3-8B fp16, 16 tokens: [num_layers, 2, num_kv_heads, tokens, head_dim] = 2 MiB a block.
SHAPE = (32, 2, 8, 16, 128)
BLOCK_BYTES = 2 * MiB

from benchmarks.pagecache import drop_page_cache, resident_bytes  # noqa: E402

LINUX_ONLY = pytest.mark.skipif(not sys.platform.startswith("linux") or not hasattr(os, "posix_fadvise"),
                                reason="mincore and posix_fadvise(DONTNEED) as Linux has them")


def base_payload() -> torch.Tensor:
    return torch.randint(0, 256, (BLOCK_BYTES,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))


def big_block(i: int, payload: torch.Tensor) -> Block:
    """Block i: `payload` (changed in place) with i in its first 8 bytes."""
    payload[:8] = torch.tensor(list(i.to_bytes(8, "little")), dtype=torch.uint8)
    key = hashlib.blake2b(i.to_bytes(8, "little"), digest_size=32).digest()
    meta = BlockMeta(key=key, namespace=bytes(32), num_tokens=SHAPE[3], dtype="float16", shape=SHAPE,
                     nbytes=payload.numel(), checksum=checksum(payload))
    return Block(meta, payload)


def write_store(path: pathlib.Path, cfg: DiskConfig, num_blocks: int) -> int:
    """A disk tier of num_blocks blocks in the records DiskTier writes (codec.encode_block, meta_record),
    written with py-lmdb straight into the map (writemap: about 3x DiskTier's writer here, whose
    write-through batches cost more than the disk); returns the map bytes the blocks take."""
    path.mkdir()
    env = lmdb.open(str(path), map_size=disk_env.map_size_bytes(cfg), max_dbs=4, sync=False, writemap=True)
    payload, scratch, used = base_payload(), codec.RecordBuffer(), 0
    try:
        blocks_db, meta_db = env.open_db(disk_files.BLOCKS_DB), env.open_db(disk_files.META_DB)
        for first in range(0, num_blocks, 64):
            with env.begin(write=True) as txn:
                for i in range(first, min(first + 64, num_blocks)):
                    block = big_block(i, payload)
                    record = codec.encode_block(block, into=scratch)
                    entry = disk_env.DiskEntry(block.meta, {}, disk_env.stored_bytes(len(record)), 1e9 + i)
                    txn.put(block.meta.key, record, db=blocks_db)
                    txn.put(block.meta.key, disk_env.meta_record(entry), db=meta_db)
                    used += entry.size
        env.sync(True)
        end = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    finally:
        env.close()
    os.truncate(path / "data.mdb", end)  # writemap sized the file to the map; LMDB's writer grows it as it goes
    return used


def meta_db_bytes(path: pathlib.Path) -> int:
    """Bytes of the meta db's pages: what a start must read."""
    env = lmdb.open(str(path), max_dbs=4, readonly=True, lock=False, readahead=False)
    try:
        with env.begin() as txn:
            st = txn.stat(env.open_db(disk_files.META_DB, txn=txn, create=False))
        return (st["branch_pages"] + st["leaf_pages"] + st["overflow_pages"]) * st["psize"]
    finally:
        env.close()


STORE_BYTES = 4 * GiB


@LINUX_ONLY
@pytest.mark.slow
def test_start_reads_metadata_only(tmp_path: pathlib.Path) -> None:
    """4 GiB of 2 MiB blocks (2048), written in about 12 s (py-lmdb, ~350 MB/s with two busy cores)
    with room to spare on /tmp (skipped below 8 GiB free). The old start read the whole file (8222
    of 8222 MiB resident after it, at 8 GiB); after the page cache of data.mdb is dropped, a reopen
    by the real DiskTier may leave resident only the meta db's pages plus 2 MiB (LMDB's meta pages,
    main db, free list, the probe's commit), under 0.1% of the payload. No timing is asserted:
    scripts/bench_restart.py reports the start time."""
    vfs = os.statvfs(tmp_path)
    if vfs.f_bavail * vfs.f_frsize < STORE_BYTES + 4 * GiB:
        pytest.skip(f"needs {STORE_BYTES + 4 * GiB} bytes free in {tmp_path}")
    path = tmp_path / "disk"
    cfg = DiskConfig(capacity_bytes=STORE_BYTES + GiB)
    num_blocks = STORE_BYTES // BLOCK_BYTES
    used = write_store(path, cfg, num_blocks)
    data = path / "data.mdb"
    bound = meta_db_bytes(path) + 2 * MiB
    drop_page_cache(data)

    tier = DiskTier(path, cfg, max_block_bytes=4 * MiB)
    try:
        resident = resident_bytes(data)
        assert resident <= bound, f"a start read {resident / MiB:.1f} MiB of data.mdb, bound {bound / MiB:.1f} MiB"
        assert resident < STORE_BYTES // 1000
        tier.check_integrity()  # the daemon's periodic check reads metadata only, as the start does
        resident = resident_bytes(data)
        assert resident <= bound, \
            f"check_integrity read {resident / MiB:.1f} MiB of data.mdb, bound {bound / MiB:.1f} MiB"
        assert tier.stats().num_blocks == num_blocks and tier.used_bytes == used
        payload = base_payload()
        for i in (0, num_blocks // 2, num_blocks - 1):  # and it serves them, verified
            block = big_block(i, payload)
            assert torch.equal(tier.get(block.meta.key).payload, block.payload)
    finally:
        tier.close()


SMALL_SHAPE = (2, 2, 4, 16, 32)  # float16: 16 KiB, in overflow pages


def small_block(i: int) -> Block:
    """A 16 KiB block; zstd compresses it (values 0, 1, 2)."""
    payload = torch.randint(0, 3, SMALL_SHAPE, generator=torch.Generator().manual_seed(i)).to(torch.float16)
    payload = payload.reshape(-1).view(torch.uint8).clone()
    meta = BlockMeta(key=hashlib.blake2b(bytes([i]), digest_size=32).digest(), namespace=bytes(32),
                     num_tokens=SMALL_SHAPE[3], dtype="float16", shape=SMALL_SHAPE, nbytes=payload.numel(),
                     checksum=checksum(payload))
    return Block(meta, payload)


def small_tier(path: pathlib.Path, **kw: object) -> DiskTier:
    return DiskTier(path, DiskConfig(capacity_bytes=64 * MiB, **kw), max_block_bytes=4 * MiB)  # type: ignore[arg-type]


def edit_meta(path: pathlib.Path, change) -> None:  # noqa: ANN001 - change(dict) -> dict | None (None: delete)
    env = lmdb.open(str(path), max_dbs=4)
    try:
        with env.begin(write=True) as txn:
            meta_db = env.open_db(disk_files.META_DB, txn=txn)
            for key, value in list(txn.cursor(db=meta_db)):
                rec = change(json.loads(value))
                if rec is None:
                    txn.delete(key, db=meta_db)
                else:
                    txn.put(key, json.dumps(rec).encode(), db=meta_db)
    finally:
        env.close()


def meta_records(path: pathlib.Path) -> list[dict]:
    env = lmdb.open(str(path), max_dbs=4, readonly=True, lock=False)
    try:
        with env.begin() as txn:
            return [json.loads(v) for _, v in txn.cursor(db=env.open_db(disk_files.META_DB, txn=txn, create=False))]
    finally:
        env.close()


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_meta_records_carry_the_stored_bytes_of_their_record(tmp_path: pathlib.Path, compression: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Sizes at a restart come from the meta records (compressed records too: known only once encoded),
    and no block record is read for them."""
    path = tmp_path / "disk"
    tier = small_tier(path, compression=compression)
    blocks = [small_block(i) for i in range(6)]
    try:
        for block in blocks:
            tier.put(block, {"n": 1})
        tier.flush()
        tier.set_attrs(blocks[0].meta.key, {"n": 2})  # a meta rewrite keeps the size
        tier.touch(blocks[1].meta.key)
        tier.flush()
        sizes = {k: tier._index[k].size for k in tier.lru_keys()}
        used = tier.used_bytes
    finally:
        tier.close()
    assert sorted(r["stored_bytes"] for r in meta_records(path)) == sorted(sizes.values())
    if compression == "zstd":
        assert any(size < disk_env.stored_bytes(len(b.payload)) for b, size in zip(blocks, sizes.values()))

    def no_record_reads(*args: object) -> dict:
        raise AssertionError("a start read block records")

    monkeypatch.setattr(disk_env, "record_lengths", no_record_reads)
    tier = small_tier(path, compression=compression)
    try:
        assert {k: tier._index[k].size for k in tier.lru_keys()} == sizes and tier.used_bytes == used
        assert tier.records() and dict(tier.records())[blocks[0].meta] == {"n": 2}
        for block in blocks:
            assert torch.equal(tier.get(block.meta.key).payload, block.payload)
        tier.check_integrity()
    finally:
        tier.close()


def test_meta_records_without_stored_bytes_are_sized_once_and_rewritten(tmp_path: pathlib.Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A tier written by 0.2.0 (meta records without stored_bytes): the first start reads those
    records for their sizes and writes their meta records again; the next start reads none."""
    path = tmp_path / "disk"
    tier = small_tier(path)
    blocks = [small_block(i) for i in range(5)]
    try:
        for block in blocks:
            tier.put(block)
        tier.flush()
        sizes = {k: tier._index[k].size for k in tier.lru_keys()}
        order = list(tier.lru_keys())
    finally:
        tier.close()
    edit_meta(path, lambda rec: {k: v for k, v in rec.items() if k != "stored_bytes"})
    assert all("stored_bytes" not in r for r in meta_records(path))

    tier = small_tier(path)
    try:
        assert {k: tier._index[k].size for k in tier.lru_keys()} == sizes and list(tier.lru_keys()) == order
        tier.check_integrity()  # the rewrites are queued: allowed to differ until they commit
        tier.flush()
        tier.check_integrity()
    finally:
        tier.close()
    assert sorted(r["stored_bytes"] for r in meta_records(path)) == sorted(sizes.values())

    monkeypatch.setattr(disk_env, "record_lengths", lambda *a: pytest.fail("a start read block records"))
    tier = small_tier(path)
    try:
        assert {k: tier._index[k].size for k in tier.lru_keys()} == sizes
        assert torch.equal(tier.get(blocks[2].meta.key).payload, blocks[2].payload)
    finally:
        tier.close()


def test_bad_stored_bytes_drops_only_that_block(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "disk"
    tier = small_tier(path)
    blocks = [small_block(i) for i in range(3)]
    try:
        for block in blocks:
            tier.put(block)
    finally:
        tier.close()
    bad = blocks[1].meta.key.hex()
    edit_meta(path, lambda rec: {**rec, "stored_bytes": "8192"} if rec["meta"]["key"] == bad else rec)
    tier = small_tier(path)
    try:
        assert set(tier.lru_keys()) == {blocks[0].meta.key, blocks[2].meta.key}
        assert tier.stats().verification_failures == 1
        tier.flush()
        tier.check_integrity()
    finally:
        tier.close()


def test_records_in_one_db_only_are_found_when_the_counts_differ(tmp_path: pathlib.Path) -> None:
    """A start compares the two dbs' entry counts instead of walking the blocks db; when they differ
    it walks the keys and deletes what is in one db only."""
    path = tmp_path / "disk"
    tier = small_tier(path)
    blocks = [small_block(i) for i in range(4)]
    try:
        for block in blocks:
            tier.put(block)
    finally:
        tier.close()
    gone = blocks[3].meta.key.hex()
    edit_meta(path, lambda rec: None if rec["meta"]["key"] == gone else rec)  # a block record without meta
    tier = small_tier(path)
    try:
        assert set(tier.lru_keys()) == {b.meta.key for b in blocks[:3]}
        tier.flush()
        tier.check_integrity()  # the orphan record was deleted
        assert torch.equal(tier.get(blocks[0].meta.key).payload, blocks[0].payload)
    finally:
        tier.close()
