"""Benchmark the same-host paths at the block sizes real models use: put, fetch, fetch_into, fetch_views,
a lookup from the shared index and the first fetch from the disk tier after a restart, each against a
memcpy of the same bytes measured in the same run, for four block layouts.

    python3 scripts/bench_sizes.py [--chain-mib 64] [--reps 7] [--lookup-blocks 125] [--restarts 5]
                                   [--only TEXT] [--markdown FILE] [--quick]

Each layout gets its own daemon (`tiercache serve`, a separate process) with the default configuration
(64 KiB host pages, 256 MiB host tier, write_through disk tier), raised only where a chain would not
fit in the host tier (the output says so), on a temp data dir and socket; the client is a tokenless
same-host Client. Puts and fetches run on recycled host pages (each put's chain is evicted before the
next), as in a daemon that has run a while. Medians over repetitions are the headline; every figure
is measured in this run, and each row says which path served it (shared index, the client's own LMDB
reader, the daemon).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import pathlib
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks import paged  # noqa: E402
from benchmarks.record import machine  # noqa: E402
from tiercache.block import Block, BlockMeta  # noqa: E402
from tiercache.client import Client  # noqa: E402
from tiercache.config import Config  # noqa: E402
from tiercache.keys import Namespace, block_keys  # noqa: E402
from tiercache.layout import BlockLayout, checksum  # noqa: E402
from tiercache.store import PutResult  # noqa: E402

# One intra-op thread, in this process as in bench_service.py: on a small shared box, copy_'s OpenMP
# workers spin against the daemon and each other. The baseline and the client's copies share it.
torch.set_num_threads(1)

GB = 1e9
MiB = 1 << 20
MEMCPY = "torch copy_ into a preallocated tensor, block by block, 1 thread"
TARGETS = {"fetch_into": 0.8, "disk": 0.3}  # x memcpy, at the 1.1 and 2 MiB layouts only
SMALL_PUT_TARGET = 0.2  # x memcpy: the in-place put of the embedded model's 64 KiB blocks
# The paged-pool rows (benchmarks/paged.py, LMCache's shape), x memcpy unless in ms.
PAGED_TARGETS = {"store: reserve, gather into the slab, commit": 0.3, paged.PUT_ALONE: 0.6,
                 "retrieve: keys, lookup, fetch_into the pool (copy and hash in one pass)": 0.35}
PAGED_LOOKUP_TARGET_MS = 0.3
LOOKUP_TARGET_MS = 0.1
DEFAULT = Config()


@dataclasses.dataclass
class Row:
    layout: str
    path: str
    samples: list[float]  # GB/s, or ms for the lookup
    unit: str = "GB/s"
    ratio: float | None = None
    target: str = ""
    met: bool | None = None
    note: str = ""
    why: str = ""  # why a target counts as missed although the figure is within it

    @property
    def median(self) -> float:
        return statistics.median(self.samples)


def layouts() -> list[tuple[str, Namespace, bool]]:
    """(label, namespace, targets apply): the embedded default model's, GPT-2-small's, Llama-3-8B's,
    and a vLLM CPU block of 128 tokens in the default model's layout."""
    from tiercache.worker.model import load_default_model, namespace_for

    default = namespace_for(load_default_model(), block_tokens=16)  # the worker's default block size
    gpt2 = Namespace(model="gpt2", weights="bench", dtype="float32", num_layers=12, num_kv_heads=12, head_dim=64,
                     block_tokens=16)
    llama = Namespace(model="llama-3-8b", weights="bench", dtype="float16", num_layers=32, num_kv_heads=8,
                      head_dim=128, block_tokens=16)
    return [("embedded default model", default, False), ("GPT-2-small fp32", gpt2, True),
            ("Llama-3-8B fp16", llama, True),
            ("vLLM CPU block (128 tokens, default model)", dataclasses.replace(default, block_tokens=128), False)]


def make_chain(ns: Namespace, num_blocks: int, seed: int) -> list[Block]:
    """`num_blocks` blocks with real chained keys, random payloads and their checksums."""
    layout = BlockLayout.of(ns)
    rng = np.random.default_rng(seed)
    keys = block_keys(ns, rng.integers(3, 50_000, num_blocks * ns.block_tokens).tolist())
    payloads = torch.from_numpy(rng.integers(0, 256, (num_blocks, layout.nbytes()), dtype=np.uint8))
    return [Block(BlockMeta(key=key, namespace=ns.digest(), num_tokens=ns.block_tokens, dtype=ns.dtype,
                            shape=layout.shape(), nbytes=layout.nbytes(), checksum=checksum(payload), parent=parent),
                  payload)
            for key, parent, payload in zip(keys, [b""] + keys[:-1], payloads)]


class Daemon:
    """`tiercache serve --config FILE` in its own process, ready once it prints its address."""

    def __init__(self, config_path: str, timeout_s: float = 120.0) -> None:
        cmd = [sys.executable, "-m", "tiercache.cli", "serve", "--log-level", "WARNING", "--config", config_path]
        self.proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.log: list[str] = []
        threading.Thread(target=lambda: self.log.extend(self.proc.stderr), daemon=True).start()
        ready: list[str] = []
        reader = threading.Thread(target=lambda: ready.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout_s)
        if not ready or not ready[0].startswith("tiercache listening on "):
            self.kill()
            raise SystemExit(f"the daemon did not start: {ready[:1]!r}\n{''.join(self.log)[-3000:]}")
        self.address = ready[0].split()[3]

    def stop(self) -> None:
        """SIGTERM: the daemon drains, finishes its disk writes and closes LMDB."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.kill()
            raise SystemExit(f"the daemon ignored SIGTERM for 120 s:\n{''.join(self.log)[-3000:]}") from None
        if rc != 0:
            raise SystemExit(f"the daemon exited with {rc} after SIGTERM:\n{''.join(self.log)[-3000:]}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


def config_for(base: str, resident_bytes: int) -> tuple[str, str]:
    """A config file under `base`: the defaults, with the host tier (and the disk tier, which
    write_through keeps at least as large) raised where `resident_bytes` would pass the host tier's
    low watermark. Returns (path, what was raised, or "")."""
    host, disk = DEFAULT.host.capacity_bytes, DEFAULT.disk.capacity_bytes
    text = f'data_dir = "{base}/data"\n[server]\nsocket = "{base}/d.sock"\n'
    note = ""
    if resident_bytes > DEFAULT.host.low_watermark * host:
        need = -(-resident_bytes / DEFAULT.host.low_watermark // (64 * MiB)) * 64 * MiB
        host, disk = int(need), max(disk, 2 * int(need))
        text += f"[host]\ncapacity_bytes = {host}\n[disk]\ncapacity_bytes = {disk}\n"
        note = (f"host.capacity_bytes raised to {host // MiB} MiB (default {DEFAULT.host.capacity_bytes // MiB} MiB) "
                f"to hold {resident_bytes / MiB:.0f} MiB below its low watermark; "
                f"disk.capacity_bytes {disk // MiB} MiB")
    path = os.path.join(base, "bench.toml")
    pathlib.Path(path).write_text(text)
    return path, note


def warm_page_cache(directory: str) -> int:
    """Read every data extent of the files under `directory` (LMDB's map is sparse); returns bytes read."""
    total = 0
    for path in pathlib.Path(directory).rglob("*"):
        if not path.is_file():
            continue
        with open(path, "rb") as f:
            fd, pos, end = f.fileno(), 0, os.fstat(f.fileno()).st_size
            while pos < end:
                try:
                    pos = os.lseek(fd, pos, os.SEEK_DATA)
                    hole = os.lseek(fd, pos, os.SEEK_HOLE)
                except OSError:  # no data past pos
                    break
                while pos < hole:
                    total += len(os.pread(fd, min(8 * MiB, hole - pos), pos))
                    pos += min(8 * MiB, hole - pos)
    return total


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


class Run:
    """One layout's measurements against one daemon (restarted for the disk row) on a data dir of its own."""

    def __init__(self, label: str, ns: Namespace, args: argparse.Namespace) -> None:
        self.label, self.ns, self.args = label, ns, args
        self.nbytes = BlockLayout.of(ns).nbytes()
        self.num = max(2, round(args.chain_mib * MiB / self.nbytes))  # blocks per chain
        self.total = self.num * self.nbytes
        self.notes = [f"{self.num} blocks of {self.nbytes / MiB:.3f} MiB per chain ({self.total / MiB:.1f} MiB)"]
        self.memcpy_gb: list[float] = []  # the baseline, sampled beside every other measurement
        self.dest = torch.zeros(self.num, self.nbytes, dtype=torch.uint8)  # preallocated, touched once
        self.outs = [self.dest[i] for i in range(self.num)]
        self.sentinel = make_chain(ns, 1, seed=1)
        self.client: Client | None = None

    def memcpy(self, chain: list[Block]) -> None:
        """The baseline: the chain's payloads copied into the preallocated tensor, block by block."""
        seconds, _ = timed(lambda: [out.copy_(b.payload) for out, b in zip(self.outs, chain)])
        self.memcpy_gb.append(self.total / seconds / GB)

    def settle(self) -> None:
        """Wait for the daemon's disk writer: a durable put waits until every queued write is committed."""
        self.client.put(self.sentinel, durable=True)  # type: ignore[union-attr]

    def puts(self, client: Client, *, in_place: bool) -> tuple[list[float], str, list[Block]]:
        """client.put of a fresh chain, each from the same state (chain absent, disk writer idle, host
        pages recycled by the previous one's eviction, as in a daemon that has run a while); returns
        (GB/s per put, what the client's counters said, the last chain, left stored for the fetches)."""
        num, reps = self.num, self.args.reps
        rates, went, fallbacks, stored = [], 0, 0, True
        chain: list[Block] = []
        way = "num_in_place_puts" if in_place else "num_staged_puts"
        for rep in range(reps + 1):  # the first one (fresh pages, the staging file grown) unmeasured
            chain = make_chain(self.ns, num, seed=100 + rep + (0 if in_place else 50))
            before = (getattr(client, way), client.num_put_fallbacks)
            seconds, results = timed(functools.partial(client.put, chain))
            if rep:
                rates.append(self.total / seconds / GB)
                went += getattr(client, way) - before[0]
                fallbacks += client.num_put_fallbacks - before[1]
                stored &= results == [PutResult.STORED] * num
            self.settle()
            if rep:
                self.memcpy(chain)
            if rep < reps or not in_place:
                client.evict([b.meta.key for b in chain])
                self.settle()
        what = "written in place" if in_place else "staged"
        note = f"{went} of {num * reps} blocks {what}, {fallbacks} sent as bytes instead"
        if went != num * reps or fallbacks or not stored:
            note = f"NOT ALL {what.upper()}: " + note + ("" if stored else "; some results were not STORED")
        return rates, note, chain

    def fetches(self, chain: list[Block]) -> dict[str, tuple[list[float], str]]:
        """fetch, fetch_into and fetch_views of the chain, interleaved with memcpy round by round."""
        client, keys, num, reps = self.client, [b.meta.key for b in chain], self.num, self.args.reps
        assert client is not None

        def views() -> int:
            fetched = client.fetch_views(keys)
            if not fetched.still_valid():
                raise SystemExit(f"{self.label}: a view's pages were recycled during the run")
            return len(fetched)

        paths: dict[str, Callable[[], int]] = {"fetch": lambda: len(client.fetch(keys)),
                                               "fetch_into": lambda: len(client.fetch_into(keys, self.outs)),
                                               "fetch_views": views}
        for fn in paths.values():
            fn()  # unmeasured: first-touch costs
        rates: dict[str, list[float]] = {name: [] for name in paths}
        served = {name: [0, 0] for name in paths}  # calls answered without a call; blocks read from LMDB here
        for _ in range(reps):
            self.memcpy(chain)
            for name, fn in paths.items():
                before = (client.num_local, client.num_disk_blocks)
                seconds, got = timed(fn)
                if got != num:
                    raise SystemExit(f"{self.label}: {name} returned {got} of {num} blocks")
                rates[name].append(self.total / seconds / GB)
                served[name][0] += client.num_local - before[0]
                served[name][1] += client.num_disk_blocks - before[1]
        if not all(torch.equal(f.payload, b.payload) for f, b in zip(client.fetch(keys), chain, strict=True)):
            raise SystemExit(f"{self.label}: fetch returned other bytes than were put")
        if not torch.equal(self.dest, torch.stack([b.payload for b in chain])):
            raise SystemExit(f"{self.label}: fetch_into wrote other bytes than were put")
        in_index = client.lookup(keys, probe=True).count("host")
        if in_index < num:
            self.notes.append(f"NOT IN THE SHARED INDEX: {num - in_index} of the {num} fetched blocks, though in "
                              "the daemon's host tier (put on recycled pages)")
        return {name: (rates[name], f"{local} of {reps} calls answered without a call to the daemon, {disk} of "
                                    f"{num * reps} blocks read from its LMDB by the client")
                for name, (local, disk) in served.items()}

    def lookups(self) -> tuple[list[float], str, bool]:
        """Client.lookup of a chain in the host tier, its keys hashed beforehand; (ms per call, note,
        whether every answer was right: all in host, no rpc)."""
        client, n = self.client, self.args.lookup_blocks
        assert client is not None
        client.flush(tier="host")  # the fetch chain stays on disk; the looked-up chain alone in host
        keys = [b.meta.key for b in client_put(client, make_chain(self.ns, n, seed=7))]
        self.settle()
        stub = getattr(client, "_stub", None)
        checked = hasattr(stub, "Lookup")
        saved = getattr(stub, "Lookup", None)
        if checked:
            stub.Lookup = None  # type: ignore[union-attr]  # a Lookup rpc during the timing raises TypeError
        samples, rpc_made, tiers = [], False, []
        try:
            for i in range(self.args.lookup_calls + 10):  # 10 unmeasured
                try:
                    seconds, tiers = timed(lambda: client.lookup(keys))
                except TypeError:
                    rpc_made, stub.Lookup = True, saved  # type: ignore[union-attr]
                    seconds, tiers = timed(lambda: client.lookup(keys))
                if len(tiers) != n:
                    raise SystemExit(f"{self.label}: lookup found {len(tiers)} of {n} blocks")
                if i >= 10:
                    samples.append(seconds * 1e3)
        finally:
            if checked:
                stub.Lookup = saved  # type: ignore[union-attr]
        note = ("a Lookup rpc was made (the shared index did not answer)" if rpc_made else
                "no Lookup rpc (the stub removed during the timing)" if checked else "rpcs not checked")
        if tiers.count("host") < n:  # every one is in the daemon's host tier
            note += (f"; WRONG TIER: {tiers.count('host')} reported in host, {tiers.count('disk')} in disk (the "
                     "client's own LMDB reader), though all are in the daemon's host tier")
        return samples, note, not rpc_made and tiers.count("host") == n


def client_put(client: Client, chain: list[Block]) -> list[Block]:
    if client.put(chain) != [PutResult.STORED] * len(chain):
        raise SystemExit("a put of a fresh chain did not store every block")
    return chain


def run_layout(label: str, ns: Namespace, targeted: bool, args: argparse.Namespace) -> tuple[list[Row], list[str]]:
    """Every measurement of one layout, on daemons of its own; (rows, notes)."""
    run = Run(label, ns, args)
    base = tempfile.mkdtemp(prefix="tc-sizes-", dir="/tmp")  # short: a socket path has 107 bytes
    config, raised = config_for(base, max(run.total, args.lookup_blocks * run.nbytes) + run.nbytes)
    if raised:
        run.notes.append(raised)
    daemon = Daemon(config)
    try:
        with Client(daemon.address, timeout_s=300, tune_allocator=True) as client, \
                Client(daemon.address, timeout_s=300, put_in_place=False) as staging:
            run.client = client
            client.put(run.sentinel, durable=True)
            staged_gb, staged_note, _ = run.puts(staging, in_place=False)
            put_gb, put_note, chain = run.puts(client, in_place=True)
            fetched = run.fetches(chain)
            lookup_ms, lookup_note, lookup_right = run.lookups()
        # The first fetch after a restart (SIGTERM, same data dir), from the disk tier, page cache warm.
        disk_gb, read_here, keys = [], 0, [b.meta.key for b in chain]
        for _ in range(args.restarts):
            daemon.stop()
            daemon = Daemon(config)
            warm_page_cache(os.path.join(base, "data"))
            with Client(daemon.address, timeout_s=300, tune_allocator=True) as fresh:
                fresh.health()  # connected, nothing fetched yet
                seconds, got = timed(lambda: fresh.fetch(keys))
                if len(got) != run.num:  # type: ignore[arg-type]
                    raise SystemExit(f"{label}: the fetch after a restart returned {len(got)} of {run.num} blocks")
                disk_gb.append(run.total / seconds / GB)
                read_here += fresh.num_disk_blocks
            run.memcpy(chain)
        daemon.stop()
    finally:
        daemon.kill()
        shutil.rmtree(base, ignore_errors=True)
    base_gb = statistics.median(run.memcpy_gb)
    rows = [Row(label, "memcpy (baseline)", run.memcpy_gb, note=MEMCPY)]
    disk_note = (f"{read_here} of {run.num * args.restarts} blocks read from the daemon's LMDB by the client itself, "
                 "the rest through the daemon")
    for key, path, samples, note in (
            ("put", "put (in place)", put_gb, put_note),
            ("staged", "put (staged: callers that cannot write the slab)", staged_gb, staged_note),
            ("fetch", "fetch (copies)", *fetched["fetch"]),
            ("fetch_into", "fetch_into (preallocated)", *fetched["fetch_into"]),
            ("fetch_views", "fetch_views (zero-copy, not comparable)", fetched["fetch_views"][0],
             "views and still_valid(), no bytes copied; " + fetched["fetch_views"][1]),
            ("disk", "disk fetch after restart", disk_gb, disk_note)):
        row = Row(label, path, samples, ratio=statistics.median(samples) / base_gb, note=note)
        if targeted and key in TARGETS:
            row.target, row.met = f">= {TARGETS[key]}x", row.ratio >= TARGETS[key]
        if key == "put" and label.startswith("embedded"):
            row.target, row.met = f">= {SMALL_PUT_TARGET}x", row.ratio >= SMALL_PUT_TARGET
        rows.append(row)
    lookup = Row(label, f"lookup, {args.lookup_blocks}-block chain", lookup_ms, unit="ms", note=lookup_note)
    if targeted:
        # Met only by a right answer from the shared index: a fast lookup that names the wrong tier or
        # makes a call is not the path the target is about.
        lookup.target, lookup.met = f"< {LOOKUP_TARGET_MS} ms", lookup.median < LOOKUP_TARGET_MS and lookup_right
        lookup.why = "" if lookup_right else "the answers were wrong or made a call: see its note"
    return rows + [lookup], run.notes


PAGED_LABEL = "GPT-2-small fp32, paged pool"


def run_paged(args: argparse.Namespace) -> tuple[list[Row], list[str]]:
    """LMCache's benchmark shape (benchmarks/paged.py) on a daemon of its own; (rows, notes)."""
    base = tempfile.mkdtemp(prefix="tc-paged-", dir="/tmp")
    prompt_bytes = args.paged_tokens // 16 * BlockLayout.of(paged.GPT2).nbytes()
    config, _ = config_for(base, 2 * prompt_bytes)
    daemon = Daemon(config)
    try:
        with Client(daemon.address, timeout_s=300, tune_allocator=True) as client:
            seconds, what, memcpy, nbytes = paged.measure(client, num_tokens=args.paged_tokens, reps=args.reps)
        daemon.stop()
    finally:
        daemon.kill()
        shutil.rmtree(base, ignore_errors=True)
    base_s = statistics.median(memcpy)
    rows = [Row(PAGED_LABEL, "memcpy (baseline)", [nbytes / s / GB for s in memcpy],
                note="the same bytes, block by block, into preallocated memory (torch copy_, 1 thread)")]
    for name, samples in seconds.items():
        if name.startswith("lookup"):
            row = Row(PAGED_LABEL, name, [s * 1e3 for s in samples], unit="ms", note=what[name])
            row.target, row.met = f"<= {PAGED_LOOKUP_TARGET_MS} ms", row.median <= PAGED_LOOKUP_TARGET_MS
        else:
            row = Row(PAGED_LABEL, name, [nbytes / s / GB for s in samples],
                      ratio=base_s / statistics.median(samples),
                      note="" if name.endswith(what[name]) else what[name])
            if name in PAGED_TARGETS:
                row.target, row.met = f">= {PAGED_TARGETS[name]}x", (row.ratio or 0) >= PAGED_TARGETS[name]
        rows.append(row)
    block_mib = BlockLayout.of(paged.GPT2).nbytes() / MiB
    notes = [f"{args.paged_tokens // 16} blocks of {block_mib:.3f} MiB ({nbytes / 1e6:.0f} MB) a prompt, in a pool "
             "of vLLM's FLASH_ATTN layout on the CPU ([blocks, tokens, heads, head_dim] per layer's K and V): each "
             "block gathered from, or scattered into, 2 x 12 strided views",
             "put alone is the in-place store less the caller's gather: Client.reserve and the commit"]
    return rows, notes


def table(rows: list[Row]) -> tuple[list[str], list[list[str]]]:
    header = ["layout", "path", "median", "min-max", "n", "x memcpy", "target", "status"]
    lines = []
    for r in rows:
        lines.append([r.layout, r.path, f"{r.median:.3f} {r.unit}" if r.unit == "ms" else f"{r.median:.2f} {r.unit}",
                      f"{min(r.samples):.3f}-{max(r.samples):.3f}" if r.unit == "ms" else
                      f"{min(r.samples):.2f}-{max(r.samples):.2f}",
                      str(len(r.samples)), "" if r.ratio is None else f"{r.ratio:.3f}x", r.target,
                      "" if r.met is None else ("MET" if r.met else "MISSED")])
    return header, lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chain-mib", type=float, default=64, help="MiB of blocks per chain (default 64)")
    parser.add_argument("--reps", type=int, default=7, help="repetitions of each put and fetch (default 7)")
    parser.add_argument("--lookup-blocks", type=int, default=125, help="blocks in the looked-up chain (default 125)")
    parser.add_argument("--lookup-calls", type=int, default=300, help="timed lookups (default 300)")
    parser.add_argument("--restarts", type=int, default=5, help="daemon restarts per layout (default 5)")
    parser.add_argument("--paged-tokens", type=int, default=2000,
                        help="prompt tokens of the paged-pool rows, LMCache's shape (default 2000)")
    parser.add_argument("--only", metavar="TEXT", help="only the layouts whose label contains TEXT (any case)")
    parser.add_argument("--markdown", metavar="FILE", help="also write the results as markdown")
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes for a smoke test: 2 MiB chains, 2 reps, 8-block lookups, 1 restart")
    args = parser.parse_args()
    if args.quick:
        args.chain_mib, args.reps, args.lookup_blocks, args.lookup_calls, args.restarts = 2, 2, 8, 20, 1
        args.paged_tokens = 128
    if min(args.reps, args.lookup_blocks, args.lookup_calls, args.restarts) < 1 or args.chain_mib <= 0:
        parser.error("--reps, --lookup-blocks, --lookup-calls and --restarts must be >= 1, --chain-mib > 0")
    started, load_start = time.monotonic(), os.getloadavg()
    rows: list[Row] = []
    notes: dict[str, list[str]] = {}
    for label, ns, targeted in layouts():
        if args.only and args.only.lower() not in label.lower():
            continue
        layout_rows, notes[label] = run_layout(label, ns, targeted, args)
        rows += layout_rows
        print(f"{label}: done after {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    if not args.only or args.only.lower() in PAGED_LABEL.lower():
        paged_rows, notes[PAGED_LABEL] = run_paged(args)
        rows += paged_rows
        print(f"{PAGED_LABEL}: done after {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    load_end = os.getloadavg()
    head = [f"machine: {machine()}",
            f"load average (1/5/15 min) at start {'/'.join(f'{x:.1f}' for x in load_start)}, "
            f"at end {'/'.join(f'{x:.1f}' for x in load_end)}; wall time {time.monotonic() - started:.0f} s",
            f"daemon: the default config (host tier {DEFAULT.host.capacity_bytes // MiB} MiB of "
            f"{DEFAULT.host.page_bytes // 1024} KiB pages, disk tier {DEFAULT.disk.write_policy}) unless a layout "
            "says otherwise; a tokenless same-host Client on its Unix socket",
            f"medians of {args.reps} repetitions ({args.restarts} restart(s) for the disk row, "
            f"{args.lookup_calls} calls for the lookup); x memcpy = median / the layout's memcpy median; "
            f"memcpy = {MEMCPY}, sampled beside every put, fetch round and restart; GB = 1e9 bytes",
            "disk fetch after restart: the first Client.fetch of a chain after `tiercache serve` was stopped "
            "(SIGTERM) and started again on the same data dir, its files read once beforehand (warm page cache), "
            "from a fresh Client connected beforehand"]
    header, lines = table(rows)
    details = {label: layout_notes + [f"{r.path}: {r.note}" for r in rows if r.layout == label and r.note != MEMCPY
                                      and r.note]
               for label, layout_notes in notes.items()}
    verdicts = [f"{'MET' if r.met else 'MISSED'}: {r.layout}, {r.path} {r.target}: "
                + (f"{r.median:.3f} ms" if r.unit == "ms" else f"{r.ratio:.3f}x memcpy")
                + (f" ({r.why})" if r.why else "")
                for r in rows if r.met is not None]
    widths = [max(len(x) for x in column) for column in zip(header, *lines)]
    print("\n".join(head) + "\n")
    for i, line in enumerate([header] + lines):
        print("  ".join(c.rjust(w) if 2 <= j <= 5 else c.ljust(w)
                        for j, (c, w) in enumerate(zip(line, widths))).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))
    for label, items in details.items():
        print(f"\n{label}:\n" + "\n".join(f"  {item}" for item in items))
    print("\n" + "\n".join(verdicts))
    if args.markdown:
        md = ["# Same-host paths at real block sizes", "",
              f"Written by `python3 scripts/bench_sizes.py {' '.join(sys.argv[1:])}`; every figure was measured in "
              "that run.", "", *(f"- {line}" for line in head), "", "| " + " | ".join(header) + " |",
              "|" + "|".join("---" if j < 2 else "---:" for j in range(len(header))) + "|",
              *("| " + " | ".join(line) + " |" for line in lines), "", "## What each layout's run checked", ""]
        for label, items in details.items():
            md += [f"- {label}", *(f"  - {item}" for item in items)]
        md += ["", "## Targets", "", *(f"- {v}" for v in verdicts)]
        pathlib.Path(args.markdown).write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    main()
