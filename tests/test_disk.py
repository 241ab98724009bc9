"""The LMDB disk tier on a real environment: durability, capacity, locking, crashes and damaged media."""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
import pathlib
import random
import subprocess
import sys
import threading
import time

import lmdb
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiercache import codec
from tiercache.block import Block, BlockMeta
from tiercache.codec import record_size
from tiercache.config import DiskConfig
from tiercache.errors import (
    AlreadyRunning,
    CapacityExceeded,
    CorruptBlock,
    DeadlineExceeded,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from tiercache.layout import checksum
from tiercache.tiers.disk import DiskTier
from tiercache.tiers.disk_env import stored_bytes

MiB = 1 << 20
SHAPE = (2, 2, 4, 16, 32)  # float16: 16 KiB, large enough to live in LMDB overflow pages
MAX_BLOCK = 4 * MiB
REPO = pathlib.Path(__file__).resolve().parent.parent
CHILD_ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def make_block(seed: int, compressible: bool = False) -> Block:
    """A deterministic block whose key encodes its seed, so any stored block can be checked."""
    g = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 3, SHAPE, generator=g) if compressible else torch.randn(SHAPE, generator=g)
    payload = values.to(torch.float16).reshape(-1).view(torch.uint8).clone()
    key = seed.to_bytes(8, "little") + hashlib.blake2b(seed.to_bytes(8, "little"), digest_size=24).digest()
    meta = BlockMeta(key=key, namespace=bytes(32), num_tokens=SHAPE[3], dtype="float16", shape=SHAPE,
                     nbytes=payload.numel(), checksum=checksum(payload))
    return Block(meta, payload)


def seed_of(key: bytes) -> int:
    return int.from_bytes(key[:8], "little")


COST = stored_bytes(record_size(make_block(0).meta))  # a record over half a page: whole map pages


def disk_cfg(**kw: object) -> DiskConfig:
    return DiskConfig(**{"capacity_bytes": 64 * MiB, **kw})  # type: ignore[arg-type]


def open_tier(path: pathlib.Path, **kw: object) -> DiskTier:
    return DiskTier(path, disk_cfg(**kw), max_block_bytes=MAX_BLOCK)


def child(body: str, *args: str) -> subprocess.Popen:
    """A fresh interpreter running `body` with this module's block helpers (without importing pytest)."""
    prelude = "\n".join([
        "from __future__ import annotations", "import hashlib, sys", "import torch",
        "from tiercache.config import DiskConfig", "from tiercache.layout import checksum",
        "from tiercache.block import Block, BlockMeta", "from tiercache.tiers.disk import DiskTier",
        f"MiB, SHAPE, MAX_BLOCK = {MiB}, {SHAPE!r}, {MAX_BLOCK}",
        *(inspect.getsource(f) for f in (make_block, disk_cfg, open_tier))])
    return subprocess.Popen([sys.executable, "-c", prelude + body, *args], env=CHILD_ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def assert_same(block: Block, expected: Block) -> None:
    assert block.meta == expected.meta
    assert torch.equal(block.payload, expected.payload)


@pytest.fixture
def tier(tmp_path: pathlib.Path):  # type: ignore[no-untyped-def]
    t = open_tier(tmp_path / "disk")
    yield t
    t.close()


def test_round_trip_is_bit_identical_queued_and_committed(tier: DiskTier) -> None:
    blocks = [make_block(i) for i in range(6)]
    for b in blocks:
        assert tier.put(b)
        tier.check_integrity()
    assert_same(tier.get(blocks[0].meta.key), blocks[0])  # possibly still queued
    assert not tier.put(blocks[1]), "a present key is a no-op"
    tier.flush()
    tier.check_integrity()
    for b in blocks:
        assert tier.contains(b.meta.key)
        assert_same(tier.get(b.meta.key), b)
    assert tier.used_bytes == 6 * COST
    stats = tier.stats()
    assert (stats.name, stats.num_blocks, stats.puts, stats.hits, stats.used_bytes) == ("disk", 6, 6, 7, 6 * COST)
    with pytest.raises(NotFound):
        tier.get(make_block(99).meta.key)
    assert tier.stats().misses == 1


def test_bad_puts_are_refused_precisely(tier: DiskTier) -> None:
    block = make_block(1)
    with pytest.raises(InvalidArgument, match="payload has"):
        tier.put(Block(block.meta, block.payload[:-2]))
    with pytest.raises(InvalidArgument, match="JSON-able"):
        tier.put(block, {"when": object()})
    small = DiskTier(tier.path.parent / "small", disk_cfg(), max_block_bytes=1024)
    try:
        with pytest.raises(InvalidArgument, match="exceeds max_block_bytes"):
            small.put(block)
    finally:
        small.close()
    with pytest.raises(NotFound):
        tier.set_attrs(block.meta.key, {"a": 1})
    assert list(tier.lru_keys()) == [] and tier.used_bytes == 0


def test_reopen_serves_everything_with_attrs_and_lru_order(tmp_path: pathlib.Path) -> None:
    tier = open_tier(tmp_path / "disk")
    blocks = [make_block(i) for i in range(5)]
    for i, b in enumerate(blocks):
        tier.put(b, {"hits": i})
    tier.set_attrs(blocks[1].meta.key, {"pinned": True})
    tier.get(blocks[0].meta.key)  # now most recently used
    tier.remove(blocks[2].meta.key)
    order = list(tier.lru_keys())
    tier.close()
    tier.close()  # idempotent
    tier = open_tier(tmp_path / "disk")
    try:
        assert list(tier.lru_keys()) == order
        attrs = {m.key: a for m, a in tier.records()}
        assert attrs[blocks[1].meta.key] == {"hits": 1, "pinned": True}
        assert attrs[blocks[4].meta.key] == {"hits": 4}
        assert blocks[2].meta.key not in attrs
        for b in blocks[:2] + blocks[3:]:
            assert_same(tier.get(b.meta.key), b)
        tier.check_integrity()
    finally:
        tier.close()


def test_capacity_bounds_the_map_pages_the_blocks_take(tmp_path: pathlib.Path) -> None:
    # A record over half a page gets whole overflow pages: counted at its length, a full tier used
    # more of LMDB's map than its capacity (a tier of 4 KiB blocks twice as much), and a map sized
    # near the capacity filled up long before the tier did, dropping writes.
    tier = open_tier(tmp_path / "disk", capacity_bytes=10 * COST)
    try:
        for i in range(10):
            tier.put(make_block(i))
        with pytest.raises(CapacityExceeded, match="capacity_bytes"):
            tier.put(make_block(10))
        tier.flush()
        with tier._env.begin() as txn:
            st = txn.stat(tier._blocks)
        # Each record: its overflow pages, and a node (key, header, page number) in a leaf page.
        in_map = st["overflow_pages"] * st["psize"] + 48 * st["entries"]
        assert in_map <= tier.used_bytes == tier.capacity_bytes, (in_map, tier.capacity_bytes)
        tier.check_integrity()
    finally:
        tier.close()


def test_capacity_bound_refuses_without_changing_anything(tmp_path: pathlib.Path) -> None:
    tier = open_tier(tmp_path / "disk", capacity_bytes=3 * COST + 100)
    try:
        for i in range(3):
            tier.put(make_block(i))
        with pytest.raises(CapacityExceeded, match="capacity_bytes"):
            tier.put(make_block(3))
        assert not tier.contains(make_block(3).meta.key) and tier.used_bytes == 3 * COST
        assert tier.evict(next(tier.lru_keys()))
        assert tier.put(make_block(3))
        tier.flush()
        tier.check_integrity()
        assert tier.stats().evictions == 1
    finally:
        tier.close()
    tier = open_tier(tmp_path / "disk", capacity_bytes=2 * COST)  # capacity shrank: the LRU block goes
    try:
        assert [seed_of(k) for k in tier.lru_keys()] == [2, 3]
        tier.flush()
        tier.check_integrity()
    finally:
        tier.close()


def test_remove_and_evict_take_effect_at_once(tier: DiskTier) -> None:
    a, b, c = make_block(1), make_block(2), make_block(3)
    tier.put(a)
    tier.put(b)
    tier.flush()
    tier.put(c)  # queued
    assert tier.remove(a.meta.key) and tier.evict(c.meta.key)
    assert not tier.remove(a.meta.key) and not tier.evict(make_block(9).meta.key)
    assert not tier.contains(a.meta.key) and not tier.contains(c.meta.key)
    assert tier.used_bytes == COST
    with pytest.raises(NotFound):
        tier.get(c.meta.key)
    tier.check_integrity()
    tier.flush()
    tier.check_integrity()
    stats = tier.stats()
    assert (stats.removals, stats.evictions, stats.num_blocks) == (1, 1, 1)


def test_flush_deadline_and_writer_backlog(tier: DiskTier, monkeypatch: pytest.MonkeyPatch) -> None:
    import tiercache.tiers.disk as disk

    monkeypatch.setattr(disk, "MAX_PENDING_BYTES", 2 * COST)
    monkeypatch.setattr(disk, "BACKLOG_WAIT_S", 0.2)
    with tier._commit_lock:  # hold the writer between batches
        tier.put(make_block(1))
        tier.put(make_block(2))
        with pytest.raises(DeadlineExceeded, match="still queued"):
            tier.flush(timeout_s=0.1)
        with pytest.raises(CapacityExceeded, match="disk writer backlog"):
            tier.put(make_block(3))
        assert not tier.contains(make_block(3).meta.key)
    tier.flush(timeout_s=10)
    assert tier.put(make_block(3))
    tier.flush()
    tier.check_integrity()


def test_writes_queued_together_share_one_commit_that_a_flush_does_not_wait_for(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tiercache.tiers.disk_writer as disk_writer

    monkeypatch.setattr(disk_writer, "WRITE_GATHER_S", 1.0)  # long, so that the test cannot race it
    tier = open_tier(tmp_path / "disk")
    try:
        first = tier._env.info()["last_txnid"]
        tier.put(make_block(1))
        time.sleep(0.05)
        tier.put(make_block(2))
        started = time.monotonic()
        tier.flush(timeout_s=10)
        assert time.monotonic() - started < 0.5, "flush waited for the gather window"
        assert tier._env.info()["last_txnid"] == first + 1, "two puts queued together took two commits"
        tier.put(make_block(3))  # with no flush, the write still commits once the window has passed
        deadline = time.monotonic() + 10
        while tier._env.info()["last_txnid"] == first + 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert tier._env.info()["last_txnid"] == first + 2
    finally:
        tier.close()
    tier = open_tier(tmp_path / "disk")
    try:
        for seed in (1, 2, 3):
            assert_same(tier.get(make_block(seed).meta.key), make_block(seed))
    finally:
        tier.close()


def test_a_big_block_is_encoded_on_the_encoder_thread(tier: DiskTier, monkeypatch: pytest.MonkeyPatch) -> None:
    import tiercache.tiers.disk_writer as disk_writer

    threads: list[str] = []
    encode = codec.encode_block

    def spy(*args: object, **kwargs: object) -> object:
        threads.append(threading.current_thread().name)
        return encode(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(codec, "encode_block", spy)
    monkeypatch.setattr(disk_writer, "INLINE_ENCODE_BYTES", make_block(0).meta.nbytes + 1)
    tier.put(make_block(1))
    tier.flush()
    monkeypatch.setattr(disk_writer, "INLINE_ENCODE_BYTES", make_block(0).meta.nbytes)
    tier.put(make_block(2))
    tier.flush()
    assert [name.split(":")[0] for name in threads] == ["tiercache-disk-writer", "tiercache-disk-encoder"]
    for seed in (1, 2):
        assert_same(tier.get(make_block(seed).meta.key), make_block(seed))


def test_compressed_blocks_round_trip_through_the_tier(tmp_path: pathlib.Path) -> None:
    tier = open_tier(tmp_path / "disk", compression="zstd", zstd_level=3)
    blocks = [make_block(i, compressible=True) for i in range(4)]
    for b in blocks:
        tier.put(b)
    tier.flush()
    assert tier.used_bytes < 4 * COST // 2, "compressible blocks are stored compressed"
    tier.check_integrity()
    tier.close()
    tier = open_tier(tmp_path / "disk")  # a reader without compression configured still decodes them
    try:
        for b in blocks:
            assert_same(tier.get(b.meta.key), b)
        assert tier.verify() == (4, [])
    finally:
        tier.close()


def test_second_owner_is_refused_and_fork_is_detected(tier: DiskTier) -> None:
    with pytest.raises(AlreadyRunning, match=str(tier.path)):
        open_tier(tier.path)
    tier.put(make_block(1))
    pid = os.fork()
    if pid == 0:  # the child must be refused, and its close must not release the parent's lock
        try:
            tier.contains(make_block(1).meta.key)
            code = 1
        except Unavailable:
            code = 0
        tier.close()
        os._exit(code)
    assert os.waitpid(pid, 0)[1] == 0
    body = ("\nfrom tiercache.errors import AlreadyRunning\n"
            f"try:\n    open_tier({str(tier.path)!r})\nexcept AlreadyRunning as e:\n    print(e)\n    sys.exit(3)\n")
    proc = child(body)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 3, err
    assert str(tier.path) in out
    assert_same(tier.get(make_block(1).meta.key), make_block(1))


def test_damaged_environment_is_moved_aside(tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "disk"
    path.mkdir()
    garbage = random.Random(0).randbytes(64 * 1024)
    (path / "data.mdb").write_bytes(garbage)
    with caplog.at_level(logging.WARNING, logger="tiercache.tiers.disk"):
        tier = open_tier(path)
    try:
        aside = list(tmp_path.glob("disk.corrupt-*"))
        assert len(aside) == 1 and (aside[0] / "data.mdb").read_bytes() == garbage
        assert str(path) in caplog.text and str(aside[0]) in caplog.text
        assert list(tier.lru_keys()) == []
        tier.put(make_block(1))
        tier.flush()
        tier.check_integrity()
    finally:
        tier.close()
    tier = open_tier(path)
    try:
        assert_same(tier.get(make_block(1).meta.key), make_block(1))
        assert len(list(tmp_path.glob("disk.corrupt-*"))) == 1
    finally:
        tier.close()


PROBED_CHILD = """
import logging
logging.basicConfig(level=logging.WARNING)
tier = open_tier(sys.argv[1])
print(len(list(tier.lru_keys())), flush=True)
tier.put(make_block(100))
tier.flush()
tier.check_integrity()
tier.close()
"""


def test_damaged_free_list_is_moved_aside_before_lmdb_can_abort(tmp_path: pathlib.Path) -> None:
    """Regression (reliability bug 1): a damaged free-list page made LMDB abort() the process at its first
    commit, every start. The tier runs in a child so that a regression fails this test, not pytest."""
    from benchmarks.reliability import flip, free_db_root

    path = tmp_path / "disk"
    tier = open_tier(path)
    for i in range(4):  # one transaction each, so the free list holds records
        tier.put(make_block(i))
        tier.flush()
    tier.close()
    flip(path / "data.mdb", free_db_root(path / "data.mdb") * 4096 + 12, 1 << 2)  # mp_lower of its root page
    proc = child(PROBED_CHILD, str(path))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, f"the tier's process died (rc={proc.returncode}): {err[-2000:]}"
    assert out == "0\n", "the damaged environment should have been replaced by an empty one"
    assert "a probe process died with SIGABRT" in err and "moved it aside" in err, err
    assert len(list(tmp_path.glob("disk.corrupt-*"))) == 1
    tier = open_tier(path)  # the fresh environment is probed clean and kept
    try:
        assert_same(tier.get(make_block(100).meta.key), make_block(100))
    finally:
        tier.close()


def test_free_pages_past_the_end_of_data_mdb_are_not_a_truncation(tmp_path: pathlib.Path) -> None:
    """Regression: LMDB never writes pages a transaction allocated and freed again, so data.mdb can end
    before its last page when those pages are free (seen after commits failed on a full filesystem).
    The truncation check took that for a truncated file and moved an intact environment aside."""
    path = tmp_path / "disk"
    tier = open_tier(path)
    for i in range(3):
        tier.put(make_block(i))
    tier.close()
    env = lmdb.open(str(path), max_dbs=4)
    with env.begin(write=True) as txn:  # its overflow pages come from the end of the file and stay free
        txn.put(b"x" * 32, b"0" * 100_000, db=env.open_db(b"blocks", txn=txn))
        txn.delete(b"x" * 32, db=env.open_db(b"blocks", txn=txn))
    env.close()
    head = (path / "data.mdb").read_bytes()[:8192]
    meta = max((head[:152], head[4096:4248]), key=lambda m: int.from_bytes(m[144:], "little"))  # the newer
    assert (path / "data.mdb").stat().st_size < int.from_bytes(meta[136:144], "little") * 4096, "no free tail"
    tier = open_tier(path)
    try:
        assert not list(tmp_path.glob("disk.corrupt-*")), "an intact environment was moved aside"
        for i in range(3):
            assert_same(tier.get(make_block(i).meta.key), make_block(i))
        tier.put(make_block(3))  # LMDB reuses the free pages past the end: it writes them, never reads them
        tier.flush()
        tier.check_integrity()
    finally:
        tier.close()


def test_commit_meeting_a_damaged_page_marks_the_tier_damaged(tmp_path: pathlib.Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """A page damaged while the tier runs (a stray write, a failing disk) is damage, not a full disk: disk
    puts are refused for the rest of the run and the next start moves the environment aside."""
    from benchmarks.reliability import sub_db_root

    path = tmp_path / "disk"
    tier = open_tier(path)
    try:
        tier.put(make_block(1))
        tier.flush()
        with open(path / "data.mdb", "r+b") as f:  # the blocks db's root page: flags 0, neither branch nor leaf
            f.seek(sub_db_root(path / "data.mdb", b"blocks") * 4096 + 10)
            f.write(b"\0\0")
        with caplog.at_level(logging.WARNING, logger="tiercache.tiers"):
            tier.put(make_block(2))
            tier.flush()
        assert tier.write_failures == 1 and not tier.contains(make_block(2).meta.key)
        assert any(r.levelno == logging.ERROR and "is damaged" in r.getMessage() for r in caplog.records), caplog.text
        assert "MDB_CORRUPTED" in (path / "DAMAGED").read_text()
        with pytest.raises(CapacityExceeded, match="is damaged"):
            tier.put(make_block(3))
        tier.remove(make_block(1).meta.key)  # still answered in memory; the delete is not attempted
        tier.flush()
    finally:
        tier.close()
    with caplog.at_level(logging.WARNING, logger="tiercache.tiers"):
        tier = open_tier(path)
    try:
        assert "marked it damaged" in caplog.text and len(list(tmp_path.glob("disk.corrupt-*"))) == 1
        assert list(tier.lru_keys()) == []
        tier.put(make_block(3))
        tier.flush()
        assert_same(tier.get(make_block(3).meta.key), make_block(3))
        tier.check_integrity()
    finally:
        tier.close()


def test_bad_meta_record_drops_only_that_block(tmp_path: pathlib.Path) -> None:
    tier = open_tier(tmp_path / "disk")
    for i in range(3):
        tier.put(make_block(i))
    tier.close()
    env = lmdb.open(str(tmp_path / "disk"), max_dbs=4)
    with env.begin(write=True) as txn:
        txn.put(make_block(1).meta.key, b'{"meta": 7}', db=env.open_db(b"meta", txn=txn))
    env.close()
    tier = open_tier(tmp_path / "disk")
    try:
        assert sorted(seed_of(k) for k in tier.lru_keys()) == [0, 2]
        assert tier.stats().verification_failures == 1
        tier.flush()
        tier.check_integrity()
    finally:
        tier.close()


def test_meta_record_disagreeing_with_the_block_record_is_corrupt(tmp_path: pathlib.Path) -> None:
    """Reads check the record against the index's meta, so a meta db that lies is caught, not served."""
    tier = open_tier(tmp_path / "disk")
    a, b = make_block(1), make_block(2)
    tier.put(a)
    tier.put(b)
    tier.close()
    env = lmdb.open(str(tmp_path / "disk"), max_dbs=4)
    with env.begin(write=True) as txn:
        meta_db = env.open_db(b"meta", txn=txn)
        rec = json.loads(txn.get(a.meta.key, db=meta_db))
        rec["meta"]["preview"] = "not what the record says"
        txn.put(a.meta.key, json.dumps(rec).encode(), db=meta_db)
    env.close()
    tier = open_tier(tmp_path / "disk")
    try:
        with pytest.raises(CorruptBlock, match="does not match the expected metadata"):
            tier.get(a.meta.key)
        assert not tier.contains(a.meta.key) and tier.stats().verification_failures == 1
        assert_same(tier.get(b.meta.key), b)
        tier.flush()
        tier.check_integrity()
    finally:
        tier.close()


def test_encoding_failure_drops_only_that_block(tier: DiskTier, monkeypatch: pytest.MonkeyPatch) -> None:
    encode = codec.encode_block
    bad = make_block(2)

    def fail_one(block: Block, **kw: object) -> object:
        if block.meta.key == bad.meta.key:
            raise RuntimeError("simulated encoder failure")
        return encode(block, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(codec, "encode_block", fail_one)
    blocks = [make_block(i) for i in range(5)]
    with tier._commit_lock:  # one batch, so the failure lands between records of the same transaction
        for blk in blocks:
            tier.put(blk)
    tier.flush()
    assert tier.write_failures == 1 and not tier.contains(bad.meta.key)
    for blk in blocks:
        if blk is not blocks[2]:
            assert_same(tier.get(blk.meta.key), blk)
    tier.check_integrity()


def test_write_failure_keeps_the_writer_alive(tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import tiercache.tiers.disk as disk

    monkeypatch.setattr(disk, "DISK_FULL_RETRY_S", 600.0)  # no expiry during a slow test run
    tier = open_tier(tmp_path / "disk", map_size_bytes=MiB)  # a map far smaller than our own bound
    try:
        with caplog.at_level(logging.WARNING, logger="tiercache.tiers.disk"):
            for i in range(200):  # one block per transaction until LMDB's map is full
                tier.put(make_block(i))
                tier.flush()
                if tier.write_failures:
                    break
        assert tier.write_failures == 1 and "could not be written" in caplog.text
        assert not tier.contains(make_block(i).meta.key), "the failed block is dropped"
        with pytest.raises(CapacityExceeded, match="disk is full"):
            tier.put(make_block(1000))
        tier.check_integrity()
        kept = list(tier.lru_keys())
        assert len(kept) == i, "blocks committed before the failure stay"
        for key in kept[:4]:  # one transaction each: LMDB reuses freed pages two commits later
            tier.evict(key)
            tier.flush()
        assert tier.put(make_block(1000)), "freeing space lets puts try again"
        tier.flush()
        assert tier.contains(make_block(1000).meta.key)
        tier.check_integrity()
        for key in list(tier.lru_keys())[:3]:
            assert_same(tier.get(key), make_block(seed_of(key)))
    finally:
        tier.close()


CHILD = """
tier = open_tier(sys.argv[1])
print("ready", flush=True)
seed = int(sys.argv[2])
while True:
    batch = [make_block(seed + i) for i in range(3)]
    for b in batch:
        tier.put(b)
    tier.flush()
    print("\\n".join(b.meta.key.hex() for b in batch), flush=True)
    seed += 3
"""


def test_sigkill_during_writes_loses_nothing_flushed(tmp_path: pathlib.Path) -> None:
    path, rng, flushed = tmp_path / "disk", random.Random(7), set()
    for cycle in range(4):
        proc = child(CHILD, str(path), str(cycle * 100_000))
        watchdog = threading.Timer(120, proc.kill)
        watchdog.start()
        try:
            assert proc.stdout.readline() == "ready\n", proc.stderr.read()
            for _ in range(rng.randint(10, 60)):
                line = proc.stdout.readline()
                assert line, proc.stderr.read()
                flushed.add(bytes.fromhex(line))
            threading.Event().wait(rng.uniform(0, 0.03))  # land the kill anywhere in the next batch
            proc.kill()
            rest = proc.stdout.read()  # through the same buffer readline() filled, not communicate()
            proc.wait()
        finally:
            watchdog.cancel()
        flushed.update(bytes.fromhex(line) for line in rest.split())
        tier = open_tier(path)
        try:
            present = set(tier.lru_keys())
            assert flushed <= present, f"cycle {cycle}: {len(flushed - present)} flushed blocks lost"
            for key in present:
                assert_same(tier.get(key), make_block(seed_of(key)))
            tier.check_integrity()
        finally:
            tier.close()


GRACEFUL_CHILD = """
import signal, threading
from tiercache.errors import Unavailable
tier = open_tier(sys.argv[1], capacity_bytes=1 << 30)
closer = threading.Thread(target=tier.close)
signal.signal(signal.SIGTERM, lambda *_: closer.start())  # the daemon's shape: the handler starts shutdown
print("ready", flush=True)
seed = 0
while True:
    try:
        tier.put(make_block(seed))
    except Unavailable:
        break
    print(make_block(seed).meta.key.hex(), flush=True)
    seed += 1
closer.join()
"""


def test_sigterm_close_commits_every_accepted_put(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "disk"
    proc = child(GRACEFUL_CHILD, str(path))
    watchdog = threading.Timer(120, proc.kill)
    watchdog.start()
    try:
        assert proc.stdout.readline() == "ready\n", proc.stderr.read()
        accepted = [bytes.fromhex(proc.stdout.readline()) for _ in range(40)]
        proc.terminate()
        rest, err = proc.stdout.read(), proc.stderr.read()  # through readline()'s buffer
        proc.wait(timeout=60)
    finally:
        watchdog.cancel()
        proc.kill()
    assert proc.returncode == 0, err
    accepted += [bytes.fromhex(line) for line in rest.split()]
    tier = open_tier(path, capacity_bytes=1 << 30)
    try:
        assert set(tier.lru_keys()) == set(accepted), "close() must commit every put it accepted, and nothing else"
        for key in accepted[-5:]:
            assert_same(tier.get(key), make_block(seed_of(key)))
        tier.check_integrity()
    finally:
        tier.close()


def test_flipped_bytes_in_data_mdb_are_caught(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "disk"
    tier = open_tier(path)
    a, b, c = make_block(1), make_block(2), make_block(3)
    for blk in (a, b, c):
        tier.put(blk)
    tier.close()
    data_file = path / "data.mdb"
    content = data_file.read_bytes()
    with open(data_file, "r+b") as f:
        for blk in (a, b):
            needle = blk.payload[4096:4160].numpy().tobytes()
            at = content.find(needle)
            assert at > 0 and content.find(needle, at + 1) == -1, "payload pattern must be unique in the file"
            f.seek(at + 16)  # payload bytes 4112..4114: one u64 word, so sum64 must change
            f.write(bytes(x ^ 0xFF for x in content[at + 16 : at + 19]))
    tier = open_tier(path)
    try:
        with pytest.raises(CorruptBlock, match="checksum mismatch"):
            tier.get(a.meta.key)
        assert not tier.contains(a.meta.key) and tier.stats().verification_failures == 1
        with pytest.raises(NotFound):
            tier.get(a.meta.key)
        assert tier.verify() == (2, [b.meta.key])
        assert tier.stats().verification_failures == 2
        assert_same(tier.get(c.meta.key), c)
        tier.flush()
        tier.check_integrity()
    finally:
        tier.close()
    tier = open_tier(path)
    try:
        assert list(tier.lru_keys()) == [c.meta.key]
    finally:
        tier.close()


OPS = st.lists(st.tuples(st.sampled_from(["put", "get", "remove", "evict", "attrs", "flush", "reopen"]),
                         st.integers(0, 5)), max_size=25)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS)
def test_random_operations_match_a_dict_model(tmp_path_factory: pytest.TempPathFactory, ops: list) -> None:
    path = tmp_path_factory.mktemp("model") / "disk"
    tier = open_tier(path, capacity_bytes=4 * COST)
    model: dict[int, dict] = {}  # seed -> attrs, in LRU order
    try:
        for kind, seed in ops:
            key = make_block(seed).meta.key
            if kind == "put":
                if seed in model:
                    assert not tier.put(make_block(seed))
                elif len(model) == 4:
                    with pytest.raises(CapacityExceeded):
                        tier.put(make_block(seed))
                else:
                    assert tier.put(make_block(seed), {"seed": seed})
                    model[seed] = {"seed": seed}
            elif kind == "get":
                if seed in model:
                    assert_same(tier.get(key), make_block(seed))
                    model[seed] = model.pop(seed)
                else:
                    with pytest.raises(NotFound):
                        tier.get(key)
            elif kind in ("remove", "evict"):
                assert getattr(tier, kind)(key) == (model.pop(seed, None) is not None)
            elif kind == "attrs" and seed in model:
                tier.set_attrs(key, {"n": len(ops)})
                model[seed]["n"] = len(ops)
            elif kind == "flush":
                tier.flush()
            elif kind == "reopen":
                tier.close()
                tier = open_tier(path, capacity_bytes=4 * COST)
            tier.check_integrity()
            assert [seed_of(k) for k in tier.lru_keys()] == list(model)
            assert {seed_of(m.key): a for m, a in tier.records()} == model
            assert tier.used_bytes == len(model) * COST
    finally:
        tier.close()


def test_snapshot_reads_are_views_and_a_record_replaced_meanwhile_is_read_afresh(tier: DiskTier) -> None:
    """snapshot_reads serves committed blocks as views of one read transaction; a block deleted and
    put again (another meta) after the snapshot began is read afresh, not dropped as damaged."""
    import dataclasses

    blocks = [make_block(i) for i in range(4)]
    for block in blocks:
        tier.put(block)
    tier.flush()
    replaced = Block(dataclasses.replace(blocks[0].meta, preview="put again"), blocks[0].payload.clone())
    with tier.snapshot_reads():
        for block in blocks[1:]:
            got = tier.get(block.meta.key)
            assert_same(got, block)
            assert not got.payload.is_inference() and got.payload.data_ptr() != block.payload.data_ptr()
        tier.remove(blocks[0].meta.key)
        tier.flush()
        tier.put(replaced)
        tier.flush()  # committed after the snapshot began: the snapshot still holds the old record
        got = tier.get(replaced.meta.key)
        assert got.meta == replaced.meta
        assert torch.equal(got.payload, replaced.payload)
    assert tier.stats().verification_failures == 0
    assert_same(tier.get(replaced.meta.key), replaced)
