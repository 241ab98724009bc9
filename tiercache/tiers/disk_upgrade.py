"""The one-time upgrade of a disk tier written by tiercache 0.1 (records of format v1, checksum sum64)."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path

import lmdb

from tiercache import codec
from tiercache.config import DiskConfig
from tiercache.errors import CorruptBlock
from tiercache.tiers.disk_env import DiskEntry, LoadedIndex, meta_record, stored_bytes

logger = logging.getLogger(__name__)

UPGRADE_BATCH_BYTES = 64 << 20  # payload bytes rewritten per transaction


def upgrade_legacy(path: Path, env: lmdb.Environment, blocks_db: lmdb._Database, meta_db: lmdb._Database,
                   loaded: LoadedIndex, cfg: DiskConfig, max_block_bytes: int) -> None:
    """Rewrite every block of loaded.legacy_keys in the current format, before the tier serves anything.

    Each old record is verified with the checksum it was written with (sum64) and written again with
    XXH3-64, compressed as `cfg` says; its meta record follows. A block that fails verification, or
    that cannot be rewritten (the map or the filesystem is full), leaves the index for
    loaded.bad_keys (deleted at open): nothing of the old format is ever served. Reads every legacy
    payload once; a tier with none (every start after the first) reads nothing here.
    """
    keys = [k for k in loaded.legacy_keys if k in loaded.index]
    if not keys:
        return
    logger.warning("disk tier %s: upgrading blocks=%d written by tiercache 0.1 (checksum sum64) to record format "
                   "%s (XXH3-64); each payload is read and written once", path, len(keys), codec.FORMAT)
    started = time.monotonic()
    num_done = num_failed = 0
    todo = iter(keys)
    try:
        while True:
            batch_bytes, batch = 0, []
            for key in todo:
                batch.append(key)
                batch_bytes += loaded.index[key].meta.nbytes
                if batch_bytes >= UPGRADE_BATCH_BYTES:
                    break
            if not batch:
                break
            rewritten: list[DiskEntry] = []
            with env.begin(write=True, buffers=True) as txn:
                for key in batch:
                    entry = _rewrite(path, txn, blocks_db, meta_db, loaded, key, cfg, max_block_bytes)
                    if entry is not None:
                        rewritten.append(entry)
                    else:
                        num_failed += 1
            # Committed: only now does the index take the new metas (a failed commit rolled them back).
            for entry in rewritten:
                loaded.used_bytes += entry.size - loaded.index[entry.meta.key].size
                loaded.index[entry.meta.key] = entry
                loaded.upgraded.add(entry.meta.key)
            num_done += len(rewritten)
    except lmdb.Error as e:  # full map or filesystem, or damage: the rest cannot be kept
        rest = [k for k in keys if k in loaded.index and k not in loaded.upgraded]
        logger.error("disk tier %s: the upgrade stopped (%s); dropping the blocks=%d not yet rewritten", path, e,
                     len(rest))
        for key in rest:
            _drop(loaded, key)
    logger.warning("disk tier %s: upgrade done: blocks=%d rewritten, %d failed verification and were dropped, "
                   "s=%.1f", path, num_done, num_failed, time.monotonic() - started)


def _rewrite(path: Path, txn: lmdb.Transaction, blocks_db: lmdb._Database, meta_db: lmdb._Database,
             loaded: LoadedIndex, key: bytes, cfg: DiskConfig, max_block_bytes: int) -> DiskEntry | None:
    """One legacy block verified and rewritten in `txn`: its new index entry, for the caller to take
    once `txn` commits; None (and dropped) when it fails verification."""
    entry = loaded.index[key]
    try:
        record = txn.get(key, db=blocks_db)
        if record is None:
            raise CorruptBlock(f"block {key.hex()} is indexed but missing from the blocks db")
        block = codec.decode_block(record, max_payload_bytes=max_block_bytes, expected_key=key,
                                   expected_meta=entry.meta, legacy=True)
    except CorruptBlock as e:
        logger.warning("disk tier %s: dropping block %s written by 0.1: %s", path, key.hex(), e)
        _drop(loaded, key)
        loaded.num_bad_meta += 1  # counted as a verification failure
        return None
    new = codec.encode_block(block, compression=cfg.compression, level=cfg.zstd_level, shuffle=cfg.shuffle,
                             min_ratio=cfg.min_compress_ratio)
    txn.put(key, new, db=blocks_db)
    upgraded = replace(entry, meta=block.meta, size=stored_bytes(len(new), loaded.page_bytes))
    txn.put(key, meta_record(upgraded), db=meta_db)
    return upgraded


def _drop(loaded: LoadedIndex, key: bytes) -> None:
    entry = loaded.index.pop(key)
    loaded.used_bytes -= entry.size
    loaded.bad_keys.add(key)
