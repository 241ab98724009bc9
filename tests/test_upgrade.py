"""A data dir written by tiercache 0.1 (record format v1, checksum sum64) opens with the current code:
every intact block is verified with sum64, rewritten once in format v2 (XXH3-64) and served; a damaged
one is dropped, counted, never served; the second start finds nothing left to upgrade."""

from __future__ import annotations

import hashlib
import json
import logging
import pathlib
import shutil

import lmdb
import pytest

from tiercache import codec
from tiercache.block import BlockMeta
from tiercache.config import Config, DiskConfig, HostConfig
from tiercache.errors import CorruptBlock
from tiercache.layout import checksum, legacy_sum64
from tiercache.record_header import build_header, canonical_meta, plain_header
from tiercache.store import TieredStore
from tiercache.tiers.disk_env import DiskEntry, meta_record

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "datadir-0.1.1"
EXPECTED = json.loads((FIXTURE / "expected.json").read_text())


def copy_fixture(tmp_path: pathlib.Path) -> pathlib.Path:
    data_dir = tmp_path / "data"
    shutil.copytree(FIXTURE, data_dir)
    return data_dir


def open_store(data_dir: pathlib.Path, shm_dir: pathlib.Path) -> TieredStore:
    shm_dir.mkdir(exist_ok=True)
    return TieredStore.open(Config(data_dir=str(data_dir),
                                   host=HostConfig(capacity_bytes=8 << 20, shm_dir=str(shm_dir)),
                                   disk=DiskConfig(capacity_bytes=16 << 20, compression="zstd")))


def raw_records(data_dir: pathlib.Path) -> dict[bytes, tuple[bytes, dict]]:
    """Every block record and meta record of a closed data dir, read with py-lmdb."""
    env = lmdb.open(str(data_dir / "disk"), max_dbs=4, readonly=True, lock=False)
    try:
        with env.begin() as txn:
            blocks, metas = env.open_db(b"blocks", txn=txn), env.open_db(b"meta", txn=txn)
            return {bytes(k): (bytes(v), json.loads(txn.get(k, db=metas))) for k, v in txn.cursor(db=blocks)}
    finally:
        env.close()


def test_the_fixture_is_in_the_old_format() -> None:
    records = raw_records(FIXTURE)
    assert len(records) == len(EXPECTED) == 6
    for item in EXPECTED:
        record, meta_rec = records[bytes.fromhex(item["key"])]
        header = json.loads(record[8 : 8 + int.from_bytes(record[:8], "little")])["__metadata__"]
        assert (header["format"], header["checksum_alg"]) == ("tiercache.block.v1", "sum64")
        assert "format" not in meta_rec and meta_rec["meta"]["checksum"] == item["checksum_sum64"]
        with pytest.raises(CorruptBlock, match="read only when a disk tier written by tiercache 0.1 is upgraded"):
            codec.decode_block(record, max_payload_bytes=1 << 20)  # never on a serving path
        assert legacy_sum64(codec.decode_block(record, max_payload_bytes=1 << 20, legacy=True).payload.numpy()) \
            == item["checksum_sum64"]
    assert {json.loads(r[8 : 8 + int.from_bytes(r[:8], "little")])["__metadata__"]["compression"]
            for r, _ in records.values()} == {"none", "zstd"}


def test_an_old_data_dir_is_upgraded_once_and_served(tmp_path: pathlib.Path, caplog) -> None:
    data_dir = copy_fixture(tmp_path)
    caplog.set_level(logging.WARNING, logger="tiercache.tiers.disk_upgrade")
    store = open_store(data_dir, tmp_path / "shm")
    try:
        assert "upgrading blocks=6" in caplog.text and "blocks=6 rewritten, 0 failed" in caplog.text
        keys = [bytes.fromhex(item["key"]) for item in EXPECTED]
        blocks = list(store.fetch(keys))
        assert len(blocks) == 6
        for block, item in zip(blocks, EXPECTED):
            assert hashlib.blake2b(block.payload.numpy().tobytes(), digest_size=16).hexdigest() == \
                item["payload_blake2b"]
            assert block.meta.checksum == checksum(block.payload) != item["checksum_sum64"]
        report = store.verify()
        assert (report.checked, report.failed) == (12, 0)  # host and disk copies of each
        store.check_integrity()
    finally:
        store.close()
    for key, (record, meta_rec) in raw_records(data_dir).items():
        block = codec.decode_block(record, max_payload_bytes=1 << 20, expected_key=key)  # format v2 now
        assert meta_rec["format"] == codec.FORMAT and meta_rec["meta"]["checksum"] == block.meta.checksum
    caplog.clear()
    store = open_store(data_dir, tmp_path / "shm")  # the second start has nothing to upgrade
    try:
        assert "upgrading" not in caplog.text and len(store.entries()) == 6
        store.check_integrity()
    finally:
        store.close()


def test_a_damaged_old_block_is_dropped_counted_and_never_served(tmp_path: pathlib.Path) -> None:
    data_dir = copy_fixture(tmp_path)
    victim = EXPECTED[1]  # a plain (uncompressed) record: flip one payload byte in place
    record, _ = raw_records(data_dir)[bytes.fromhex(victim["key"])]
    data_mdb = data_dir / "disk" / "data.mdb"
    content = bytearray(data_mdb.read_bytes())
    at = content.find(record)
    assert at >= 0 and content.find(record, at + 1) < 0
    content[at + len(record) - 100] ^= 0x01
    data_mdb.write_bytes(bytes(content))
    store = open_store(data_dir, tmp_path / "shm")
    try:
        present = {e.meta.key for e in store.entries()}
        assert bytes.fromhex(victim["key"]) not in present
        assert present == {bytes.fromhex(item["key"]) for item in EXPECTED} - {bytes.fromhex(victim["key"])}
        assert store.disk.stats().verification_failures == 1
        store.check_integrity()
    finally:
        store.close()


def test_an_upgrade_that_fails_midway_keeps_the_tier_consistent(tmp_path: pathlib.Path, monkeypatch, caplog) -> None:
    """A full map or disk in the middle of the upgrade: what committed is served, what did not is
    dropped, and the index never claims a rewrite that was rolled back."""
    import lmdb

    from tiercache.tiers import disk_upgrade

    monkeypatch.setattr(disk_upgrade, "UPGRADE_BATCH_BYTES", 3 * 4096)  # batches of three blocks
    real, calls = disk_upgrade.meta_record, []

    def failing(entry):  # type: ignore[no-untyped-def]
        calls.append(entry.meta.key)
        if len(calls) == 5:  # inside the second batch, after its first two rewrites
            raise lmdb.MapFullError("mdb_put: MDB_MAP_FULL")
        return real(entry)

    monkeypatch.setattr(disk_upgrade, "meta_record", failing)
    data_dir = copy_fixture(tmp_path)
    caplog.set_level(logging.WARNING, logger="tiercache.tiers.disk_upgrade")
    store = open_store(data_dir, tmp_path / "shm")
    try:
        assert "dropping the blocks=3 not yet rewritten" in caplog.text and "blocks=3 rewritten" in caplog.text
        store.check_integrity()
        kept = calls[:3]  # the first batch, committed
        assert {e.meta.key for e in store.entries()} == set(kept)
        assert len(list(store.fetch(kept))) == 3
        report = store.verify()
        assert report.failed == 0
    finally:
        store.close()
    assert set(raw_records(data_dir)) == set(kept)


# A data dir written by tiercache 0.2.0 (tests/fixtures/datadir-0.2.0/README.md): the formats of
# today, which the current code must read and write byte for byte as that version did.
FIXTURE_02 = pathlib.Path(__file__).parent / "fixtures" / "datadir-0.2.0"
EXPECTED_02 = json.loads((FIXTURE_02 / "expected.json").read_text())


def raw_values(data_dir: pathlib.Path) -> dict[bytes, tuple[bytes, bytes]]:
    """Every block record and meta record of a closed data dir, as the bytes LMDB holds."""
    env = lmdb.open(str(data_dir / "disk"), max_dbs=4, readonly=True, lock=False)
    try:
        with env.begin() as txn:
            blocks, metas = env.open_db(b"blocks", txn=txn), env.open_db(b"meta", txn=txn)
            return {bytes(k): (bytes(v), bytes(txn.get(k, db=metas) or b"")) for k, v in txn.cursor(db=blocks)}
    finally:
        env.close()


def test_records_written_by_0_2_read_back_and_are_written_again_byte_for_byte() -> None:
    values = raw_values(FIXTURE_02)
    assert len(values) == len(EXPECTED_02) == 3
    compressions = set()
    for item in EXPECTED_02:
        meta = BlockMeta.from_dict(item["meta"])
        record, meta_value = values[meta.key]
        header = record[: 8 + int.from_bytes(record[:8], "little")]
        metadata = json.loads(header[8:])["__metadata__"]
        compressions.add(metadata["compression"])
        assert codec.record_meta(record) == meta
        if metadata["compression"] == "none":
            assert plain_header(meta) == header and canonical_meta(header[8:]) == meta
        else:
            size = json.loads(header[8:])["kv.zst"]["shape"][0]
            extra = {name: metadata[name] for name in ("compression", "shuffle", "raw_size")}
            assert build_header(meta, "kv.zst", "U8", [size], size, extra) == header
        block = codec.decode_block(record, max_payload_bytes=1 << 20, expected_key=meta.key)
        assert hashlib.blake2b(block.payload.numpy().tobytes(), digest_size=16).hexdigest() == item["payload_blake2b"]
        # The meta record: its meta read back, and the whole record written again as 0.2.0 wrote it.
        rec = json.loads(meta_value)
        assert BlockMeta.from_dict(rec["meta"]) == meta and rec["format"] == codec.FORMAT
        assert codec.meta_json(meta).encode() in meta_value
        assert meta_record(DiskEntry(meta, rec["attrs"], rec["stored_bytes"], rec["last_access"])) == meta_value
    assert compressions == {"none", "zstd"}
    assert {m["tenant"] for m in (item["meta"] for item in EXPECTED_02)} == {"t1"}
    assert any(item["meta"]["preview"] for item in EXPECTED_02)


def test_a_0_2_data_dir_opens_and_serves_every_block(tmp_path: pathlib.Path, caplog) -> None:
    data_dir = tmp_path / "data"
    shutil.copytree(FIXTURE_02, data_dir)
    caplog.set_level(logging.WARNING)
    store = open_store(data_dir, tmp_path / "shm")
    try:
        assert "upgrading" not in caplog.text and "dropping" not in caplog.text and "older version" not in caplog.text
        metas = [BlockMeta.from_dict(item["meta"]) for item in EXPECTED_02]
        assert sorted((e.meta for e in store.entries()), key=lambda m: m.key) == sorted(metas, key=lambda m: m.key)
        blocks = list(store.fetch([m.key for m in metas]))
        assert [b.meta for b in blocks] == metas
        for block, item in zip(blocks, EXPECTED_02):
            assert hashlib.blake2b(block.payload.numpy().tobytes(), digest_size=16).hexdigest() == \
                item["payload_blake2b"]
        report = store.verify()
        assert (report.checked, report.failed) == (6, 0)  # host and disk copies of each
        store.check_integrity()
    finally:
        store.close()
