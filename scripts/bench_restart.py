"""Benchmark a disk tier's start with a cold page cache: its time and the part of data.mdb it reads,
against a cold sequential read of the whole file measured in the same run.

A store of --store-gib of --block-mib blocks is written in the records DiskTier writes (py-lmdb straight
into the map: several times faster than the tier's write-through writer), its page cache is dropped
(posix_fadvise DONTNEED after fsync, no root needed), and DiskTier opens it; resident pages are counted
with mincore(2). Linux only. The tiercache imported is the first on sys.path: set PYTHONPATH to a
checkout (a git worktree of an older commit) to measure that code.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import pathlib
import shutil
import sys
import tempfile
import time
from statistics import median

sys.path.append(str(pathlib.Path(__file__).resolve().parent.parent))  # after PYTHONPATH: see the docstring

import lmdb  # noqa: E402
import torch  # noqa: E402

import tiercache  # noqa: E402
from benchmarks.pagecache import drop_page_cache, resident_bytes  # noqa: E402
from benchmarks.record import recorded  # noqa: E402
from tiercache import codec  # noqa: E402
from tiercache.block import Block, BlockMeta  # noqa: E402
from tiercache.config import DiskConfig  # noqa: E402
from tiercache.layout import checksum  # noqa: E402
from tiercache.samehost import disk_files  # noqa: E402
from tiercache.tiers import disk_env  # noqa: E402
from tiercache.tiers.disk import DiskTier  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30
HEAD_DIM = 64  # blocks of [num_layers, 2, heads, 16 tokens, 64] float32; --block-mib 1.125 is GPT-2 small's


def write_store(path: pathlib.Path, cfg: DiskConfig, num_blocks: int, block_bytes: int) -> None:
    """num_blocks distinct blocks: one random payload with the block's number in its first 8 bytes."""
    heads = block_bytes // (2 * 16 * HEAD_DIM * 4)
    shape = (1, 2, heads, 16, HEAD_DIM)
    payload = torch.randint(0, 256, (block_bytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    path.mkdir(parents=True)
    env = lmdb.open(str(path), map_size=disk_env.map_size_bytes(cfg), max_dbs=4, sync=False, writemap=True)
    try:
        blocks_db, meta_db = env.open_db(disk_files.BLOCKS_DB), env.open_db(disk_files.META_DB)
        for first in range(0, num_blocks, 64):
            with env.begin(write=True) as txn:
                for i in range(first, min(first + 64, num_blocks)):
                    payload[:8] = torch.tensor(list(i.to_bytes(8, "little")), dtype=torch.uint8)
                    key = hashlib.blake2b(i.to_bytes(8, "little"), digest_size=32).digest()
                    meta = BlockMeta(key=key, namespace=bytes(32), num_tokens=16, dtype="float32", shape=shape,
                                     nbytes=block_bytes, checksum=checksum(payload))
                    record = codec.encode_block(Block(meta, payload))
                    entry = disk_env.DiskEntry(meta, {}, disk_env.stored_bytes(len(record)), 1e9 + i)
                    txn.put(key, record, db=blocks_db)
                    txn.put(key, disk_env.meta_record(entry), db=meta_db)
        env.sync(True)
        end = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    finally:
        env.close()
    os.truncate(path / "data.mdb", end)  # writemap sized the file to the map; LMDB's writer grows it as it goes


def cold_start(path: pathlib.Path, cfg: DiskConfig, block_bytes: int) -> tuple[float, int, int]:
    """(seconds to open, bytes of data.mdb resident after, blocks indexed), from a dropped page cache."""
    data = path / "data.mdb"
    drop_page_cache(data)
    started = time.perf_counter()
    tier = DiskTier(path, cfg, max_block_bytes=block_bytes)
    seconds = time.perf_counter() - started
    try:
        return seconds, resident_bytes(data), tier.stats().num_blocks
    finally:
        tier.close()


def cold_read(data: pathlib.Path) -> float:
    """Seconds to read the whole file sequentially from a dropped page cache: the baseline."""
    drop_page_cache(data)
    started = time.perf_counter()
    with open(data, "rb", buffering=0) as f:
        while f.read(8 * MiB):
            pass
    seconds = time.perf_counter() - started
    drop_page_cache(data)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store-gib", type=float, default=8.0, help="payload bytes of the store, GiB")
    parser.add_argument("--block-mib", type=float, default=1.125, help="bytes of one block, MiB (GPT-2 small)")
    parser.add_argument("--repeat", type=int, default=3, help="cold starts measured (the median is shown)")
    parser.add_argument("--dir", default=None, help="where to write the store (default: a temporary directory)")
    parser.add_argument("--markdown", metavar="PATH",
                        help="also write the output as a page (docs/benchmarks/restart.md)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if not sys.platform.startswith("linux"):
        sys.exit("mincore and posix_fadvise(DONTNEED) as Linux has them are needed")
    unit = 2 * 16 * HEAD_DIM * 4  # one head of a block
    block_bytes = max(1, round(args.block_mib * MiB / unit)) * unit
    num_blocks = int(args.store_gib * GiB) // block_bytes
    cfg = DiskConfig(capacity_bytes=int(args.store_gib * GiB * 1.1) + GiB)
    base = pathlib.Path(tempfile.mkdtemp(prefix="bench-restart-", dir=args.dir))
    try:
        path = base / "disk"
        started = time.perf_counter()
        write_store(path, cfg, num_blocks, block_bytes)
        written_s = time.perf_counter() - started
        data = path / "data.mdb"
        size = data.stat().st_size
        runs = [cold_start(path, cfg, block_bytes) for _ in range(args.repeat)]
        read_s = cold_read(data)
        start_s, resident = median(r[0] for r in runs), median(r[1] for r in runs)
        with recorded(args.markdown, "A disk tier's cold start"):
            report(args, num_blocks, block_bytes, size, written_s, runs, read_s, start_s, resident)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def report(args: argparse.Namespace, num_blocks: int, block_bytes: int, size: int, written_s: float,
           runs: list, read_s: float, start_s: float, resident: float) -> None:
    """The table main measured."""
    print(f"tiercache: {pathlib.Path(tiercache.__file__).parent}")
    print(f"store: blocks={num_blocks} of {block_bytes / MiB:.3f} MiB, data.mdb {size / MiB:.1f} MiB "
          f"(written in {written_s:.1f} s); cold starts: {args.repeat}, indexed {runs[0][2]} blocks")
    print(f"{'measure':<34}{'value':>12}{'ratio':>10}")
    print(f"{'cold read of data.mdb (baseline) s':<34}{read_s:>12.3f}{1:>10.3f}")
    print(f"{'cold start of the disk tier s':<34}{start_s:>12.3f}{start_s / read_s:>10.3f}")
    print(f"{'data.mdb resident after start MiB':<34}{resident / MiB:>12.1f}{resident / size:>10.4f}")


if __name__ == "__main__":
    main()
