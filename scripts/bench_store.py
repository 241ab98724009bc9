"""Benchmark each tier's put/get throughput against a memcpy and a raw LMDB loop measured in the same run."""

from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import resource
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from statistics import median

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout without installing

import lmdb  # noqa: E402
import torch  # noqa: E402

from benchmarks.record import recorded  # noqa: E402
from tiercache import codec  # noqa: E402
from tiercache.block import Block, BlockMeta  # noqa: E402
from tiercache.config import Config, DiskConfig, GpuConfig, HostConfig, MiB  # noqa: E402
from tiercache.keys import Namespace, block_keys  # noqa: E402
from tiercache.layout import BlockLayout, as_uint8, checksum  # noqa: E402
from tiercache.store import TieredStore  # noqa: E402
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


# One pass of a row: put, get, and the baseline passes timed just before the put and the get.
Pass = tuple[Sample, Sample, Sample, Sample]


@dataclass
class Row:
    """One table row: its passes, one per timed repetition."""

    label: str
    passes: list[Pass] = field(default_factory=list)
    note: str = ""


def timed(fn: Callable[[], object], num_blocks: int, sync: bool = False) -> Sample:
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.perf_counter()
    fn()
    if sync:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return Sample(seconds, num_blocks * LAYOUT.nbytes(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)


def copy_each(src: torch.Tensor, dst: torch.Tensor) -> None:
    """The plain copy: one torch copy_ per block, row i of src into row i of dst."""
    for i in range(src.shape[0]):
        dst[i].copy_(src[i])


class Memcpy:
    """The memcpy baseline, timed just before every tier pass so that both see the same machine load.

    Two plain copies of the same bytes out of the pool of distinct source blocks: into distinct
    preallocated blocks, and into one reused block that stays in cache. The faster is the baseline.
    """

    def __init__(self, src: torch.Tensor) -> None:
        self.src = src
        self.spread = torch.zeros_like(src)  # zeros, not empty: faulted in before any timing
        self.one = torch.zeros(src.shape[1], dtype=torch.uint8).expand(src.shape[0], -1)
        self.samples: list[tuple[Sample, Sample]] = []

    def __call__(self) -> Sample:
        n = self.src.shape[0]
        pair = timed(lambda: copy_each(self.src, self.spread), n), timed(lambda: copy_each(self.src, self.one), n)
        self.samples.append(pair)
        return min(pair, key=lambda s: s.seconds)


def make_blocks(n: int, seed: int = 0) -> tuple[list[Block], torch.Tensor]:
    """n distinct blocks of a real key chain, payloads normal floats (KV-like) in one source pool."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn((n, LAYOUT.nbytes() // 4), generator=gen, dtype=torch.float32).view(torch.uint8)
    keys = block_keys(NS, list(range(n * LAYOUT.block_tokens)))
    return [Block(BlockMeta(key=key, namespace=NS.digest(), num_tokens=LAYOUT.block_tokens, dtype=LAYOUT.dtype,
                            shape=LAYOUT.shape(), nbytes=LAYOUT.nbytes(), checksum=checksum(pool[i]),
                            parent=keys[i - 1] if i else b""), pool[i])
            for i, key in enumerate(keys)], pool


def fresh_dir(root: str, name: str) -> str:
    path = os.path.join(root, name)
    shutil.rmtree(path, ignore_errors=True)
    os.sync()  # every timed commit starts with no one else's dirty pages queued
    return path


def disk_cfg(n: int, compression: str) -> DiskConfig:
    # An explicit map size, so the raw LMDB loop opens its environment with exactly the same one.
    capacity = 2 * n * (LAYOUT.nbytes() + 4096) + 64 * MiB
    return DiskConfig(capacity_bytes=capacity, map_size_bytes=2 * capacity, compression=compression)


def put_then_get(put: Callable[[], object], get: Callable[[], object], num_blocks: int,
                 put_base: Callable[[], Sample], get_base: Callable[[], Sample], *, warm: bool = False,
                 sync: bool = False) -> Pass:
    """Time put() then get(), each just after its baseline pass; with warm, one untimed get() first."""
    before_put = put_base()
    put_sample = timed(put, num_blocks, sync)
    if warm:
        get()
    before_get = get_base()
    return put_sample, timed(get, num_blocks, sync), before_put, before_get


def raw_lmdb_pass(path: str, records: list[tuple[bytes, bytes]], base: Memcpy) -> Pass:
    """Put the encoded records in transactions of BATCH_BYTES as the disk writer does, into an
    environment opened with DiskTier's flags and sub-db; then get each back warm (buffers=True plus
    one copy out, one read transaction per get as in DiskTier.get)."""
    env = lmdb.open(path, map_size=disk_cfg(len(records), "none").map_size_bytes, max_dbs=4, lock=True, subdir=True)
    db = env.open_db(b"blocks")

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
                torch.empty(len(buf), dtype=torch.uint8).copy_(as_uint8(buf))

    try:  # warm: the written pages get mapped, as in a long-running daemon
        return put_then_get(put, get, len(records), base, base, warm=True)
    finally:
        env.close()
        shutil.rmtree(path, ignore_errors=True)


def disk_pass(path: str, blocks: list[Block], compression: str, base: Memcpy) -> tuple[Pass, float]:
    """DiskTier put of every block including the commit (flush()), then warm gets; and stored/raw bytes."""
    tier = DiskTier(path, disk_cfg(len(blocks), compression), max_block_bytes=LAYOUT.nbytes())

    def put() -> None:
        for b in blocks:
            tier.put(b)
        tier.flush()

    def get() -> None:
        for b in blocks:
            tier.get(b.meta.key)

    try:
        one_pass = put_then_get(put, get, len(blocks), base, base, warm=True)
        return one_pass, tier.used_bytes / (len(blocks) * LAYOUT.nbytes())
    finally:
        tier.close()
        shutil.rmtree(path, ignore_errors=True)


def pooled_pass(tier: HostTier | GpuTier | TieredStore, blocks: list[Block], put_base: Callable[[], Sample],
                get_base: Callable[[], Sample], sync: bool = False) -> Pass:
    """Put every block, get every block (each copy dropped at once, as the service does when it
    streams a block out), then remove them all untimed so the next repetition starts alike."""
    def put() -> None:
        for b in blocks:
            tier.put(b)

    def get() -> None:
        for b in blocks:
            tier.get(b.meta.key)  # not into a list: holding every copy at once is another workload

    one_pass = put_then_get(put, get, len(blocks), put_base, get_base, sync=sync)
    for b in blocks:
        tier.remove([b.meta.key] if isinstance(tier, TieredStore) else b.meta.key)  # type: ignore[arg-type]
    return one_pass


def run(n: int, repeat: int, work_dir: str, shm_dir: str) -> dict:
    blocks, src = make_blocks(n)
    zstd_blocks = blocks[: max(1, n // 4)]  # zstd is slow; an information row needs fewer bytes
    records = [(b.meta.key, codec.encode_block(b)) for b in blocks]  # encoded outside the timed loop
    memcpy = Memcpy(src)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    pool_bytes = n * -(-LAYOUT.nbytes() // PAGE_BYTES) * PAGE_BYTES
    host = HostTier(HostConfig(capacity_bytes=pool_bytes, page_bytes=PAGE_BYTES, shm_dir=shm_dir))
    gpu = GpuTier(GpuConfig(capacity_bytes=pool_bytes, page_bytes=PAGE_BYTES), device=device)
    # The store's host tier has headroom above its high watermark, so no put evicts.
    store_host = HostConfig(capacity_bytes=(int(pool_bytes / 0.9) // PAGE_BYTES + 1) * PAGE_BYTES,
                            page_bytes=PAGE_BYTES, shm_dir=shm_dir)
    store_cfg = Config(data_dir=work_dir, host=store_host, disk=DiskConfig(enabled=False))
    store = TieredStore(store_cfg, host=HostTier(store_cfg.host))
    gpu_put_base = gpu_get_base = memcpy
    gpu_label = "gpu (GpuTier, CPU tensor pool)"
    if device.type == "cuda":  # the gpu row is compared with plain host<->device copies instead
        dev_dst = torch.zeros_like(src, device=device)
        gpu_put_base = lambda: timed(lambda: copy_each(src, dev_dst), n, True)  # noqa: E731
        gpu_get_base = lambda: timed(lambda: copy_each(dev_dst, memcpy.spread), n, True)  # noqa: E731
        gpu_label = f"gpu (GpuTier on {device}; vs H2D/D2H)"
    rows = {name: Row(label) for name, label in [
        ("memcpy", "memcpy baseline (faster of next two)"), ("memcpy_distinct", "  memcpy -> distinct dst blocks"),
        ("memcpy_hot", "  memcpy -> one reused dst block"), ("lmdb", "raw LMDB loop (py-lmdb)"),
        ("host", "host (HostTier)"), ("gpu", gpu_label), ("disk", "disk (DiskTier, uncompressed)"),
        ("disk_zstd", "disk (DiskTier, zstd-3 shuffle) [info]"), ("store", "store (TieredStore via host)")]}
    stored_ratio = 1.0
    try:
        for rep in range(repeat + 1):  # repetition 0 is the warm-up and is discarded
            res: dict[str, Pass] = {}
            res["host"] = pooled_pass(host, blocks, memcpy, memcpy)
            res["gpu"] = pooled_pass(gpu, blocks, gpu_put_base, gpu_get_base, sync=device.type == "cuda")
            res["store"] = pooled_pass(store, blocks, memcpy, memcpy)
            # Alternate which of the pair goes first, so neither always inherits the other's state.
            for name in ("lmdb", "disk") if rep % 2 else ("disk", "lmdb"):
                res[name] = (raw_lmdb_pass(fresh_dir(work_dir, name), records, memcpy) if name == "lmdb"
                             else disk_pass(fresh_dir(work_dir, name), blocks, "none", memcpy)[0])
            res["disk_zstd"], stored_ratio = disk_pass(fresh_dir(work_dir, "zstd"), zstd_blocks, "zstd", memcpy)
            if not rep:
                memcpy.samples.clear()
                continue
            for name, one_pass in res.items():
                rows[name].passes.append(one_pass)
    finally:
        store.close()
        host.close()
        gpu.close()
    # The memcpy rows are every baseline pass of the timed repetitions, against the faster of its pair.
    for spread, hot in memcpy.samples:
        best = min(spread, hot, key=lambda s: s.seconds)
        for name, sample in (("memcpy", best), ("memcpy_distinct", spread), ("memcpy_hot", hot)):
            rows[name].passes.append((sample, sample, best, best))
    rows["disk_zstd"].note = f"{len(zstd_blocks)} blocks, stored {stored_ratio:.2f} of raw bytes"
    return summarize(rows, n, repeat, device)


def summarize(rows: dict[str, Row], n: int, repeat: int, device: torch.device) -> dict:
    """Median GiB/s per row, and the median ratio of each pass to the baseline pass timed just before
    it (a load spike from another process then slows both sides of a ratio alike)."""
    out_rows = []
    for name, row in rows.items():
        puts, gets, put_bases, get_bases = (list(col) for col in zip(*row.passes))
        entry = {"row": name, "label": row.label, "note": row.note,
                 "put_gib_s": median(s.gib_s for s in puts), "get_gib_s": median(s.gib_s for s in gets),
                 "put_vs_memcpy": median(s.gib_s / b.gib_s for s, b in zip(puts, put_bases)),
                 "get_vs_memcpy": median(s.gib_s / b.gib_s for s, b in zip(gets, get_bases)),
                 "put_faults_per_block": median(s.faults * LAYOUT.nbytes() / s.nbytes for s in puts),
                 "get_faults_per_block": median(s.faults * LAYOUT.nbytes() / s.nbytes for s in gets),
                 "put_s": [s.seconds for s in puts], "get_s": [s.seconds for s in gets]}
        if name.startswith("disk") or name == "lmdb":  # the disk and raw passes of a repetition run back to back
            for col, i in (("put", 0), ("get", 1)):
                entry[f"{col}_vs_lmdb"] = median(mine[i].gib_s / raw[i].gib_s
                                              for mine, raw in zip(row.passes, rows["lmdb"].passes))
        out_rows.append(entry)
    by_name = {r["row"]: r for r in out_rows}
    targets = [{"target": f"{name} {col} >= {minimum:.2f}x {'raw LMDB' if base == 'lmdb' else base}",
                "ratio": by_name[name][f"{col}_vs_{base}"], "minimum": minimum,
                "pass": by_name[name][f"{col}_vs_{base}"] >= minimum} for name, col, base, minimum in TARGETS]
    return {"blocks": n, "block_bytes": LAYOUT.nbytes(), "total_bytes": n * LAYOUT.nbytes(), "repeat": repeat,
            "device": str(device), "torch_threads": torch.get_num_threads(), "rows": out_rows, "targets": targets}


def render(result: dict) -> str:
    lines = [f"bench_store: {result['blocks']} blocks x {result['block_bytes']:,} B (GPT-2 small: 12 layers, "
             f"12 kv heads, head_dim 64, 16 tokens, float32) = {result['total_bytes'] / MiB:.1f} MiB per pass; "
             f"median of {result['repeat']} after 1 warm-up; torch threads={result['torch_threads']}",
             "", f"{'row':<40} {'put GiB/s':>9} {'get GiB/s':>9} {'put/memcpy':>10} {'get/memcpy':>10} "
             f"{'put/LMDB':>8} {'get/LMDB':>8} {'faults/blk put,get':>18}"]

    def fmt(r: dict, key: str, width: int) -> str:
        return f"{r[key]:>{width - 1}.2f}x" if key in r else f"{'-':>{width}}"

    for r in result["rows"]:
        faults = f"{r['put_faults_per_block']:.0f},{r['get_faults_per_block']:.0f}"
        lines.append(f"{r['label']:<40} {r['put_gib_s']:>9.2f} {r['get_gib_s']:>9.2f} {fmt(r, 'put_vs_memcpy', 10)} "
                     f"{fmt(r, 'get_vs_memcpy', 10)} {fmt(r, 'put_vs_lmdb', 8)} {fmt(r, 'get_vs_lmdb', 8)} "
                     f"{faults:>18}"
                     + (f"  ({r['note']})" if r["note"] else ""))
    lines += ["", "targets (issue 2):"]
    lines += [f"  {t['target']:<34} measured {t['ratio']:.2f}x  {'PASS' if t['pass'] else 'MISS'}"
              for t in result["targets"]]
    lines += ["", "put: every block (disk: including the commit, flush()); get: every block back, each copy dropped "
              "at once (disk: page cache warm). memcpy: torch copy_ of each block out of a pool of distinct source "
              "blocks, into distinct blocks or into one reused block, whichever is faster, timed just before each "
              "pass; ratios are medians of those pairs. Raw LMDB: the same records, env flags and write batching, "
              "get with buffers=True plus one copy out. faults: minor page faults per block (4 KiB each)."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--blocks", type=int, default=128, help="blocks per pass (default 128 = 144 MiB)")
    parser.add_argument("--repeat", type=int, default=7, help="timed repetitions after one warm-up (default 7)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH ('-': stdout only)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads for every row (default 1: LMDB copies are single-threaded, "
                             "and a parallel copy on a shared 2-core box mostly waits for a descheduled thread)")
    parser.add_argument("--dir", default=None, help="where the LMDB environments go (default: a temp dir)")
    parser.add_argument("--shm-dir", default="/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir(),
                        help="where the host slabs go (default /dev/shm)")
    parser.add_argument("--markdown", metavar="PATH", help="also write the output as a page (docs/benchmarks/store.md)")
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
        print(json.dumps(result, indent=1))
        return 0
    with recorded(args.markdown, "Store: put and get per tier"):
        print(render(result))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
