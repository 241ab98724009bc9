"""Benchmark each tier's put/get throughput against a memcpy and a raw LMDB loop measured in the same run."""

from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import resource
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout without installing

import lmdb  # noqa: E402
import torch  # noqa: E402

from tiercache import codec  # noqa: E402
from tiercache.config import Config, DiskConfig, GpuConfig, HostConfig, MiB  # noqa: E402
from tiercache.keys import Namespace, block_keys  # noqa: E402
from tiercache.layout import BlockLayout, as_uint8, checksum  # noqa: E402
from tiercache.store import TieredStore  # noqa: E402
from tiercache.tiers.base import Block, BlockMeta  # noqa: E402
from tiercache.tiers.disk import BATCH_BYTES, DiskTier  # noqa: E402
from tiercache.tiers.gpu import GpuTier  # noqa: E402
from tiercache.tiers.host import HostTier  # noqa: E402

GiB = float(1 << 30)
PAGE_BYTES = 64 * 1024
# GPT-2 small: 12 layers, 12 heads of 64, one 16-token block in float32 = 1,179,648 bytes.
NS = Namespace(model="gpt2-bench", weights="bench", dtype="float32", num_layers=12, num_kv_heads=12,
               head_dim=64, block_tokens=16)
LAYOUT = BlockLayout.of(NS)
# (row, column, baseline, minimum ratio): the targets of issue 2.
TARGETS = [("host", "get", "memcpy", 0.6), ("disk", "get", "memcpy", 0.5), ("disk", "put", "lmdb", 0.8)]


@dataclass(frozen=True)
class Sample:
    """One timed pass over a set of blocks."""

    seconds: float
    nbytes: int
    faults: int  # minor page faults of the whole process during the pass (writer thread included)

    @property
    def gib_s(self) -> float:
        return self.nbytes / GiB / self.seconds


@dataclass
class Row:
    """One table row: a put and a get sample per repetition (warm-up excluded)."""

    label: str
    put: list[Sample] = field(default_factory=list)
    get: list[Sample] = field(default_factory=list)
    note: str = ""


def make_blocks(n: int, seed: int = 0) -> tuple[list[Block], torch.Tensor]:
    """n distinct blocks of a real key chain, payloads normal floats (KV-like) in one source pool."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn((n, LAYOUT.nbytes() // 4), generator=gen, dtype=torch.float32).view(torch.uint8)
    keys = block_keys(NS, list(range(n * LAYOUT.block_tokens)))
    digest = NS.digest()
    blocks = []
    for i, key in enumerate(keys):
        payload = pool[i]
        meta = BlockMeta(key=key, namespace=digest, num_tokens=LAYOUT.block_tokens, dtype=LAYOUT.dtype,
                         shape=LAYOUT.shape(), nbytes=LAYOUT.nbytes(), checksum=checksum(payload),
                         parent=keys[i - 1] if i else b"")
        blocks.append(Block(meta, payload))
    return blocks, pool


def timed(fn: Callable[[], object], num_blocks: int, sync: bool = False) -> Sample:
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.perf_counter()
    fn()
    if sync:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return Sample(seconds, num_blocks * LAYOUT.nbytes(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)


def fresh_dir(root: str, name: str) -> str:
    path = os.path.join(root, name)
    shutil.rmtree(path, ignore_errors=True)
    return path


def disk_cfg(n: int, compression: str) -> DiskConfig:
    # An explicit map size so the raw LMDB loop opens its environment with exactly the same one.
    capacity = 2 * n * (LAYOUT.nbytes() + 4096) + 64 * MiB
    return DiskConfig(capacity_bytes=capacity, map_size_bytes=2 * capacity, compression=compression)


def open_raw_env(path: str, map_size: int) -> tuple[lmdb.Environment, object]:
    """The environment as DiskTier._open_env opens it (same flags), with the same blocks sub-db."""
    env = lmdb.open(path, map_size=map_size, max_dbs=4, lock=True, subdir=True)
    return env, env.open_db(b"blocks")


def raw_lmdb_rep(path: str, map_size: int, records: list[tuple[bytes, bytes]]) -> tuple[Sample, Sample]:
    """Put the encoded records in transactions of BATCH_BYTES like the disk writer, then get each back
    (buffers=True plus one copy out, one read transaction per get like DiskTier.get), warm."""
    env, db = open_raw_env(path, map_size)

    def put() -> None:
        i = 0
        while i < len(records):
            size = 0
            with env.begin(write=True) as txn:
                while i < len(records) and size < BATCH_BYTES:
                    txn.put(records[i][0], records[i][1], db=db)
                    size += len(records[i][1])
                    i += 1

    def get() -> None:
        for key, _ in records:
            with env.begin(db=db, buffers=True) as txn:
                buf = txn.get(key)
                out = torch.empty(len(buf), dtype=torch.uint8)
                out.copy_(as_uint8(buf))

    try:
        put_sample = timed(put, len(records))
        get()  # warm: map the freshly written pages, as a long-running daemon has
        return put_sample, timed(get, len(records))
    finally:
        env.close()
        shutil.rmtree(path, ignore_errors=True)


def disk_rep(path: str, blocks: list[Block], compression: str) -> tuple[Sample, Sample, float]:
    """DiskTier put of every block including the commit (flush), then warm gets; also stored/raw bytes."""
    tier = DiskTier(path, disk_cfg(len(blocks), compression), max_block_bytes=LAYOUT.nbytes())
    try:
        def put() -> None:
            for b in blocks:
                tier.put(b)
            tier.flush()

        def get() -> None:
            for b in blocks:
                tier.get(b.meta.key)

        put_sample = timed(put, len(blocks))
        get()
        return put_sample, timed(get, len(blocks)), tier.used_bytes / (len(blocks) * LAYOUT.nbytes())
    finally:
        tier.close()
        shutil.rmtree(path, ignore_errors=True)


def pooled_rep(put_one: Callable[[Block], object], get_one: Callable[[bytes], object],
               remove: Callable[[list[bytes]], object], blocks: list[Block], sync: bool = False) -> tuple[Sample, Sample]:
    """Put every block, get every block (each result dropped at once, as a consumer that copies it
    onward would), then remove them all untimed so the next repetition starts from the same state."""
    keys = [b.meta.key for b in blocks]
    put_sample = timed(lambda: [put_one(b) for b in blocks], len(blocks), sync)
    get_sample = timed(lambda: [get_one(k) for k in keys], len(blocks), sync)
    remove(keys)
    return put_sample, get_sample


def run(n: int, repeat: int, work_dir: str, shm_dir: str) -> dict:
    blocks, src = make_blocks(n)
    zstd_blocks = blocks[: max(1, n // 4)]  # zstd is slow; an information row needs fewer bytes
    records = [(b.meta.key, codec.encode_block(b)) for b in blocks]  # prepared outside the timed loop
    # Two plain copies of the same bytes; the baseline is the faster one in each repetition.
    dst = torch.zeros_like(src)  # zeros, not empty: its pages are faulted in before timing
    one = torch.zeros(LAYOUT.nbytes(), dtype=torch.uint8)  # one destination that stays in cache
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev_dst = torch.zeros_like(src, device=device) if device.type == "cuda" else None
    pool_bytes = n * -(-LAYOUT.nbytes() // PAGE_BYTES) * PAGE_BYTES
    host = HostTier(HostConfig(capacity_bytes=pool_bytes, page_bytes=PAGE_BYTES, shm_dir=shm_dir))
    gpu = GpuTier(GpuConfig(capacity_bytes=pool_bytes, page_bytes=PAGE_BYTES), device=device)
    # The store's host tier gets headroom above its high watermark so no put triggers eviction.
    store_host = int(pool_bytes / 0.9) // PAGE_BYTES * PAGE_BYTES + PAGE_BYTES
    store_cfg = Config(data_dir=work_dir, host=HostConfig(capacity_bytes=store_host, page_bytes=PAGE_BYTES,
                                                          shm_dir=shm_dir), disk=DiskConfig(enabled=False))
    store = TieredStore(store_cfg, host=HostTier(store_cfg.host))
    gpu_label = "gpu (GpuTier, CPU tensor pool)" if device.type == "cpu" else f"gpu (GpuTier, {device})"
    rows = {name: Row(label) for name, label in [
        ("memcpy", "memcpy baseline (faster of next two)"),
        ("memcpy_distinct", "  memcpy -> distinct dst blocks"), ("memcpy_hot", "  memcpy -> one reused dst block"),
        ("lmdb", "raw LMDB loop (py-lmdb)"), ("host", "host (HostTier)"), ("gpu", gpu_label),
        ("disk", "disk (DiskTier, uncompressed)"), ("disk_zstd", "disk (DiskTier, zstd-3 shuffle) [info]"),
        ("store", "store (TieredStore via host)")]}
    if dev_dst is not None:
        rows["memcpy_dev"] = Row(f"torch copy host<->{device} (gpu baseline)")
    stored_ratio = 1.0
    map_size = disk_cfg(n, "none").map_size_bytes
    try:
        for rep in range(repeat + 1):  # repetition 0 is the warm-up and is discarded
            res: dict[str, tuple[Sample, Sample]] = {}
            spread = timed(lambda: [dst[i].copy_(src[i]) for i in range(n)], n)
            hot = timed(lambda: [one.copy_(src[i]) for i in range(n)], n)
            res["memcpy_distinct"], res["memcpy_hot"] = (spread, spread), (hot, hot)
            best = min(spread, hot, key=lambda x: x.seconds)
            res["memcpy"] = (best, best)
            if dev_dst is not None:
                res["memcpy_dev"] = (timed(lambda: [dev_dst[i].copy_(src[i]) for i in range(n)], n, True),
                                     timed(lambda: [dst[i].copy_(dev_dst[i]) for i in range(n)], n, True))
            res["host"] = pooled_rep(host.put, host.get, lambda ks: [host.remove(k) for k in ks], blocks)
            res["gpu"] = pooled_rep(gpu.put, gpu.get, lambda ks: [gpu.remove(k) for k in ks], blocks,
                                    sync=device.type == "cuda")
            res["store"] = pooled_rep(store.put, store.get, store.remove, blocks)
            # Alternate which of the pair goes first, so neither always inherits the other's state.
            for name in (("lmdb", "disk") if rep % 2 else ("disk", "lmdb")) + ("disk_zstd",):
                os.sync()  # start every timed commit with no one else's dirty pages queued
                if name == "lmdb":
                    res[name] = raw_lmdb_rep(fresh_dir(work_dir, "raw"), map_size, records)
                elif name == "disk":
                    res[name] = disk_rep(fresh_dir(work_dir, name), blocks, "none")[:2]
                else:
                    put_sample, get_sample, stored_ratio = disk_rep(fresh_dir(work_dir, name), zstd_blocks, "zstd")
                    res[name] = (put_sample, get_sample)
            if rep:
                for name, (put_sample, get_sample) in res.items():
                    rows[name].put.append(put_sample)
                    rows[name].get.append(get_sample)
    finally:
        store.close()
        host.close()
        gpu.close()
    rows["disk_zstd"].note = f"{len(zstd_blocks)} blocks, stored {stored_ratio:.2f} of raw bytes"
    return summarize(rows, n, repeat, device)


def summarize(rows: dict[str, Row], n: int, repeat: int, device: torch.device) -> dict:
    """Median GiB/s per row and median per-repetition ratios (each repetition measures tier and
    baseline close together, so a load spike from another process skews both sides of a ratio)."""
    def ratio(name: str, col: str, base: str) -> float:
        pairs = zip(getattr(rows[name], col), getattr(rows[base], col))
        return statistics.median(mine.gib_s / theirs.gib_s for mine, theirs in pairs)

    gpu_base = "memcpy_dev" if "memcpy_dev" in rows else "memcpy"
    out_rows = []
    for name, row in rows.items():
        base = gpu_base if name == "gpu" else "memcpy"
        entry = {"row": name, "label": row.label, "note": row.note,
                 "put_gib_s": statistics.median(s.gib_s for s in row.put),
                 "get_gib_s": statistics.median(s.gib_s for s in row.get),
                 "put_vs_memcpy": ratio(name, "put", base), "get_vs_memcpy": ratio(name, "get", base),
                 "put_faults_per_block": statistics.median(s.faults * LAYOUT.nbytes() / s.nbytes for s in row.put),
                 "get_faults_per_block": statistics.median(s.faults * LAYOUT.nbytes() / s.nbytes for s in row.get),
                 "put_s": [s.seconds for s in row.put], "get_s": [s.seconds for s in row.get]}
        if name.startswith("disk") or name == "lmdb":
            entry.update(put_vs_lmdb=ratio(name, "put", "lmdb"), get_vs_lmdb=ratio(name, "get", "lmdb"))
        out_rows.append(entry)
    by_name = {r["row"]: r for r in out_rows}
    targets = []
    for name, col, base, minimum in TARGETS:
        measured = by_name[name][f"{col}_vs_{base}"]
        targets.append({"target": f"{name} {col} >= {minimum:.2f}x {'raw LMDB' if base == 'lmdb' else base}",
                        "ratio": measured, "minimum": minimum, "pass": measured >= minimum})
    return {"blocks": n, "block_bytes": LAYOUT.nbytes(), "total_bytes": n * LAYOUT.nbytes(), "repeat": repeat,
            "device": str(device), "torch_threads": torch.get_num_threads(), "rows": out_rows, "targets": targets}


def render(result: dict) -> str:
    n, size = result["blocks"], result["block_bytes"]
    lines = [f"bench_store: {n} blocks x {size:,} B (GPT-2 small: 12 layers, 12 kv heads, head_dim 64, "
             f"16 tokens, float32) = {result['total_bytes'] / MiB:.1f} MiB per pass; "
             f"median of {result['repeat']} after 1 warm-up; torch threads={result['torch_threads']}",
             "", f"{'row':<40} {'put GiB/s':>9} {'get GiB/s':>9} {'put/memcpy':>10} {'get/memcpy':>10} "
             f"{'put/LMDB':>8} {'get/LMDB':>8} {'faults/blk put,get':>18}"]
    for r in result["rows"]:
        def fmt(key: str, width: int) -> str:
            return f"{r[key]:>{width - 1}.2f}x" if key in r else f"{'-':>{width}}"
        faults = f"{r['put_faults_per_block']:.0f},{r['get_faults_per_block']:.0f}"
        lines.append(f"{r['label']:<40} {r['put_gib_s']:>9.2f} {r['get_gib_s']:>9.2f} {fmt('put_vs_memcpy', 10)} "
                     f"{fmt('get_vs_memcpy', 10)} {fmt('put_vs_lmdb', 8)} {fmt('get_vs_lmdb', 8)} {faults:>18}"
                     + (f"  ({r['note']})" if r["note"] else ""))
    lines += ["", "targets (issue 2):"]
    lines += [f"  {t['target']:<34} measured {t['ratio']:.2f}x  {'PASS' if t['pass'] else 'MISS'}"
              for t in result["targets"]]
    lines += ["", "put = put every block (disk: including the commit, flush()); get = get every block back "
              "(disk: page cache warm). memcpy = torch copy_ of each block from a pool of distinct source blocks "
              "into distinct preallocated blocks or into one reused block, whichever is faster; raw LMDB = the "
              "same records, env flags and write batching, get with buffers=True plus one copy out. Ratios are "
              "medians of per-repetition ratios; faults = minor page faults per block (a 4 KiB page each)."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--blocks", type=int, default=128, help="blocks per pass (default 128 = 144 MiB)")
    parser.add_argument("--repeat", type=int, default=5, help="timed repetitions after one warm-up (default 5)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH ('-': stdout only)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads for every row (default 1: LMDB copies are single-threaded, "
                             "and a parallel copy on a shared 2-core box mostly waits for a descheduled thread)")
    parser.add_argument("--dir", default=None, help="where the LMDB environments go (default: a temp dir)")
    parser.add_argument("--shm-dir", default="/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir(),
                        help="where the host slabs go (default /dev/shm)")
    args = parser.parse_args(argv)
    if args.blocks < 1 or args.repeat < 1 or args.threads < 1:
        parser.error(f"--blocks, --repeat and --threads must be >= 1, got {args.blocks}, {args.repeat}, {args.threads}")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    work = tempfile.mkdtemp(prefix="tiercache-bench-", dir=args.dir)
    try:
        result = run(args.blocks, args.repeat, work, args.shm_dir)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json == "-":
        json.dump(result, sys.stdout, indent=1)
        print()
        return 0
    print(render(result))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
