"""Benchmark the daemon: Fetch over shared memory and over the byte stream against memcpy and a raw gRPC
stream of the same bytes (and the byte stream step by step from the one to the other), Lookup latency
(the rpc, and the client's answer from the shared index), a worker's write-back Put (as one PutBatch
message and as a Put stream), and aggregate Fetch throughput with 1, 2 and 4 client processes.

    python3 scripts/bench_service.py [--block-mib 1] [--blocks 64] [--seconds 3] [--rounds 5] [--json FILE]

Prints tables of figures and ratios, all measured in this run against its own baselines: for each path
the median of its per-call rates (the headline) and the best call beside it, labelled as such.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent import futures

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import grpc  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.record import recorded  # noqa: E402
from benchmarks.services import cpu_seconds  # noqa: E402
from tiercache.block import Block, BlockMeta  # noqa: E402
from tiercache.client import CHANNEL_OPTIONS, Client  # noqa: E402
from tiercache.codec import encode_block  # noqa: E402
from tiercache.keys import Namespace, block_keys  # noqa: E402
from tiercache.layout import BlockLayout, checksum  # noqa: E402
from tiercache.v1 import tiercache_pb2 as pb  # noqa: E402
from tiercache.v1 import tiercache_pb2_grpc as pb_grpc  # noqa: E402

RAW_METHOD = "/bench.Raw/Stream"
RAW_COPIED = "/bench.Raw/Copied"
RAW_UNARY = "/bench.Raw/Empty"
# One intra-op thread everywhere: on a small shared box, OpenMP workers spinning against each other
# (and against the daemon) turn a 1 MiB copy into milliseconds and make every figure noise.
torch.set_num_threads(1)


def namespace(block_mib: float) -> Namespace:
    # Llama-style blocks: 8 KV heads of 128 dims, 16 tokens, float16; layers set the block size.
    layers = max(1, round(block_mib * (1 << 20) / (2 * 8 * 16 * 128 * 2)))
    return Namespace(model="bench", weights="w", dtype="float16", num_layers=layers, num_kv_heads=8, head_dim=128,
                     block_tokens=16)


def make_blocks(ns: Namespace, num_blocks: int) -> list[Block]:
    layout = BlockLayout.of(ns)
    keys = block_keys(ns, list(range(num_blocks * ns.block_tokens)))
    gen = torch.Generator().manual_seed(0)
    blocks = []
    for key, parent in zip(keys, [b""] + keys[:-1]):
        payload = torch.randint(0, 256, (layout.nbytes(),), dtype=torch.uint8, generator=gen)
        blocks.append(Block(BlockMeta(key=key, namespace=ns.digest(), num_tokens=ns.block_tokens, dtype=ns.dtype,
                                      shape=layout.shape(), nbytes=layout.nbytes(), checksum=checksum(payload),
                                      parent=parent), payload))
    return blocks


def memcpy(source: np.ndarray) -> np.ndarray:
    """A private copy of `source` in fresh memory: the baseline every fetch path is held against."""
    out = np.empty_like(source)
    np.copyto(out, source)
    return out


def latency_samples_ms(fn, count: int = 1000) -> list[float]:
    """fn()'s latency in ms, `count` calls after 50 unmeasured ones."""
    for _ in range(50):
        fn()
    samples = []
    for _ in range(count):
        t = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t) * 1e3)
    return samples


def call_rates(fn, nbytes: int, seconds: float) -> list[float]:
    """bytes/s of every call of fn() (each moving nbytes) over about `seconds`, after one unmeasured call."""
    fn()  # warm up: page faults, connections, caches
    rates, deadline = [], time.monotonic() + seconds
    while True:
        t = time.perf_counter()
        fn()
        rates.append(nbytes / (time.perf_counter() - t))
        if time.monotonic() >= deadline:
            return rates


def put_costs(client: Client, daemon_pid: int, stub: pb_grpc.TierCacheStub, calls: int = 200) -> list[tuple[str, str]]:
    """A worker's write-back, new blocks each time: 2 blocks of 64 KiB per call as one PutBatch message
    (Client.put) and as a Put stream; the median call's wall time and the daemon's CPU per call."""
    if cpu_seconds(daemon_pid) is None:
        return [("Put, 2 x 64 KiB blocks", "n/a (no /proc here)")]
    blocks = make_blocks(namespace(1 / 16), 4 * calls)

    def stream(pair: list[Block]) -> None:
        stub.Put(iter([pb.PutRequest(record=encode_block(b), last=i == len(pair) - 1) for i, b in enumerate(pair)]),
                 timeout=60)

    rows = []
    for i, (name, put) in enumerate((("one PutBatch message (Client.put)", lambda pair: client.put(pair)),
                                     ("a Put stream", stream))):
        pairs = [blocks[j : j + 2] for j in range(2 * i * calls, 2 * (i + 1) * calls, 2)]
        walls, cpu = [], cpu_seconds(daemon_pid)
        for pair in pairs:
            t = time.perf_counter()
            put(pair)
            walls.append((time.perf_counter() - t) * 1e3)
        client.put(pairs[-1], durable=True)  # the disk writer's share of these calls is in the figure too
        cpu = (cpu_seconds(daemon_pid) - cpu) / len(pairs) * 1e3
        rows.append((f"Put, 2 x 64 KiB new blocks, {name}",
                     f"median {statistics.median(walls):.2f} ms, daemon CPU {cpu:.2f} ms per call "
                     f"({len(walls)} calls)"))
    return rows


# ---- child processes ---------------------------------------------------------------------------

def raw_server(socket_path: str, block_mib: float, num_blocks: int) -> None:
    """A bare gRPC server streaming pre-made records with no message layer: the transport's ceiling.
    RAW_COPIED streams the same records made afresh, as the daemon must: each payload copied from
    memory of its own into the message, then checksummed there (the step-by-step rows)."""
    blocks = make_blocks(namespace(block_mib), num_blocks)
    records = [encode_block(b) for b in blocks]
    parts = [(record[: len(record) - b.meta.nbytes], memoryview(b.payload.numpy()))
             for record, b in zip(records, blocks)]

    def copied(request, context):
        for head, payload in parts:
            record = b"".join((head, payload))
            checksum(memoryview(record)[len(head) :])
            yield record

    class Raw(grpc.GenericRpcHandler):
        def service(self, details):
            if details.method == RAW_METHOD:
                return grpc.unary_stream_rpc_method_handler(lambda request, context: iter(records))
            if details.method == RAW_COPIED:
                return grpc.unary_stream_rpc_method_handler(copied)
            if details.method == RAW_UNARY:
                return grpc.unary_unary_rpc_method_handler(lambda request, context: b"")
            return None

    server = grpc.server(futures.ThreadPoolExecutor(4), handlers=[Raw()], options=CHANNEL_OPTIONS)
    server.add_insecure_port(f"unix:{socket_path}")
    server.start()
    print("ready", flush=True)
    sys.stdin.read()  # until the parent closes our stdin
    server.stop(0)


def fetch_client(address: str, block_mib: float, num_blocks: int, seconds: float, go_file: str) -> None:
    keys = [b.meta.key for b in make_blocks(namespace(block_mib), num_blocks)]
    client = Client(address, timeout_s=60, tune_allocator=True)
    client.fetch(keys)
    print("ready", flush=True)
    while not os.path.exists(go_file):
        time.sleep(0.001)
    moved, calls, t0 = 0, 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds or not calls:
        moved += sum(b.meta.nbytes for b in client.fetch(keys))
        calls += 1
    print(json.dumps({"bytes": moved, "s": time.perf_counter() - t0, "calls": calls}), flush=True)


def child(*args: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, __file__, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    line = proc.stdout.readline().strip()
    if line != "ready" and not line.startswith("tiercache listening on"):
        raise SystemExit(f"child {args[:2]} failed to start: {line!r}")
    return proc


# ---- the table ---------------------------------------------------------------------------------

GB = 1e9
# (key, label, baseline key or None, target ratio or None); the order of the table
THROUGHPUT = (("memcpy", "memcpy (block by block)", None, None),
              ("shm", "Fetch, shared memory", "memcpy", 0.6),
              ("views", "fetch_views + the caller's copy", "memcpy", None),
              ("raw", "raw gRPC stream, same bytes", None, None),
              ("stream", "Fetch, byte stream", "raw", 0.8),
              (None, "Byte stream step by step, x the raw stream:", None, None),
              ("raw kept", "  raw stream, messages kept", "raw", None),
              ("raw copied", "  + records made afresh and summed at the server", "raw", None),
              ("fetch kept", "  the daemon's Fetch, messages kept, not parsed", "raw", None),
              ("stream", "  + the client's parse and checksums (Fetch)", "raw", None))
BASELINES = {"memcpy": "memcpy", "raw": "raw gRPC"}
LOOKUP_TARGET_MS = 1.0


def verdict(met: bool) -> str:
    return "MET" if met else "MISSED"


def throughput_table(rates: dict[str, list[list[float]]]) -> tuple[list[list[str]], list[dict]]:
    """One line per path: the median of its per-call rates (every call of every round), the best call
    beside it, the ratio of medians to its baseline, and that ratio's range over the rounds."""
    lines, figures = [], []
    for key, label, base, target in THROUGHPUT:
        if key is None:
            lines.append([label] + [""] * 6)
            continue
        calls = [x for each in rates[key] for x in each]
        med, best = statistics.median(calls), max(calls)
        ratio = by_round = check = ""
        figure = {"path": label.strip(), "median_gb_s": med / GB, "best_gb_s": best / GB, "calls": len(calls),
                  "call_gb_s_by_round": [[x / GB for x in each] for each in rates[key]]}
        if base is not None:
            r = med / statistics.median([x for each in rates[base] for x in each])
            each = [statistics.median(p) / statistics.median(q) for p, q in zip(rates[key], rates[base])]
            ratio, by_round = f"{r:.2f}x {BASELINES[base]}", f"{min(each):.2f}-{max(each):.2f}x"
            figure.update(ratio=r, baseline=base, ratio_by_round=each)
            if target is not None:
                check = f">= {target}: {verdict(r >= target)}"
                figure.update(target=target, status=verdict(r >= target))
        lines.append([label, f"{med / GB:.2f}", f"{best / GB:.2f}", str(len(calls)), ratio, by_round, check])
        figures.append(figure)
    return lines, figures


def print_table(header: list[str], lines: list[list[str]]) -> None:
    widths = [max(len(x) for x in column) for column in zip(header, *lines)]
    for i, line in enumerate([header] + lines):
        # the label left, the three figures right-aligned, the ratios and verdicts left
        cells = [c.rjust(w) if 0 < j < 4 else c.ljust(w) for j, (c, w) in enumerate(zip(line, widths))]
        print("  ".join(cells).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))


# ---- the run -------------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--block-mib", type=float, default=1.0, help="block size in MiB (default 1)")
    parser.add_argument("--blocks", type=int, default=64, help="blocks per fetch (default 64)")
    parser.add_argument("--seconds", type=float, default=3.0,
                        help="time per measurement: a quarter of it per path and round, all of it per aggregate "
                        "(default 3)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds of the throughput runs (default 5)")
    parser.add_argument("--json", metavar="FILE", help="also write every figure as JSON (to compare code versions)")
    parser.add_argument("--markdown", metavar="PATH",
                        help="also write the output as a page (docs/benchmarks/service.md)")
    args = parser.parse_args()
    if args.rounds < 1 or args.blocks < 1 or args.seconds <= 0 or args.block_mib <= 0:
        parser.error("--rounds and --blocks must be >= 1, --seconds and --block-mib > 0")
    with recorded(args.markdown, "Service: fetch paths and lookup"):
        measure(args)


def measure(args: argparse.Namespace) -> None:
    """Every row of the benchmark, printed as it is measured."""
    started = time.monotonic()
    blocks = make_blocks(namespace(args.block_mib), args.blocks)
    keys = [b.meta.key for b in blocks]
    total = sum(b.meta.nbytes for b in blocks)
    base = tempfile.mkdtemp(prefix="tc-bench-", dir="/tmp")
    host_bytes = max(64 << 20, 4 * total)
    config = os.path.join(base, "bench.toml")
    with open(config, "w") as f:
        f.write(f'data_dir = "{base}/data"\n[host]\ncapacity_bytes = {host_bytes}\npage_bytes = 262144\n'
                f"[disk]\ncapacity_bytes = {2 * host_bytes}\n[store]\nmax_block_bytes = {64 << 20}\n"
                f'[server]\nsocket = "{base}/d.sock"\n')
    procs: list[subprocess.Popen] = []
    try:
        procs.append(child("--daemon", config))
        procs.append(child("--raw-server", f"{base}/raw.sock", str(args.block_mib), str(args.blocks)))
        address = f"unix:{base}/d.sock"
        client = Client(address, timeout_s=60, tune_allocator=True)
        # durable: every measurement below runs on an idle daemon, not next to its disk writer
        # still committing what was just put (write-through: 64-128 MiB here).
        client.put(blocks, durable=True)

        # memcpy: the same bytes copied block by block into fresh buffers, as a reader must, with
        # numpy's copy (glibc memcpy: 9-10 GB/s here against 4-6 for torch's uint8 copy_).
        sources = [b.payload.numpy() for b in blocks]
        raw_channel = grpc.insecure_channel(f"unix:{base}/raw.sock", options=CHANNEL_OPTIONS)
        raw_call, raw_copied = raw_channel.unary_stream(RAW_METHOD), raw_channel.unary_stream(RAW_COPIED)
        assert sum(len(r) for r in raw_call(b"")) >= total
        assert len(client.fetch(keys, shared_memory=True)) == len(keys)
        # The daemon's Fetch stream as bare bytes: what the client receives before it parses anything.
        fetch_bytes = grpc.insecure_channel(address, options=CHANNEL_OPTIONS).unary_stream(
            "/tiercache.v1.TierCache/Fetch", request_serializer=pb.FetchRequest.SerializeToString)
        fetch_request = pb.FetchRequest(keys=keys)
        runs = {
            "memcpy": lambda: [memcpy(s) for s in sources],
            "shm": lambda: client.fetch(keys, shared_memory=True),
            "views": lambda: [memcpy(b.payload.numpy()) for b in client.fetch_views(keys)],
            "raw": lambda: sum(len(r) for r in raw_call(b"")),
            "stream": lambda: client.fetch(keys, shared_memory=False),
            # The steps from the raw stream to Fetch: messages kept (as a fetch must), records made
            # afresh at the server, the daemon's own stream, then the client's parse and checksums.
            "raw kept": lambda: len(list(raw_call(b""))),
            "raw copied": lambda: len(list(raw_copied(b""))),
            "fetch kept": lambda: len(list(fetch_bytes(fetch_request))),
        }
        # Interleaved rounds, each measuring a path right next to its baseline: on a shared machine
        # the load changes by the second, so every path gets its share of each spell.
        rates: dict[str, list[list[float]]] = {name: [] for name in runs}
        for _ in range(args.rounds):
            for name, fn in runs.items():
                rates[name].append(call_rates(fn, total, args.seconds / 4))
        throughput, figures = throughput_table(rates)

        chain = keys[:128] if len(keys) >= 128 else block_keys(namespace(args.block_mib), list(range(128 * 16)))
        if len(chain) > len(keys):
            client.put(make_blocks(namespace(args.block_mib), 128)[len(keys):], durable=True)
        empty = grpc.insecure_channel(f"unix:{base}/raw.sock").unary_unary(RAW_UNARY)
        # The Lookup rpc itself, as a caller that cannot use the shared index (a token, another
        # machine) pays it: a stub on its own channel, next to the client's lookup.
        lookup_rpc = pb_grpc.TierCacheStub(grpc.insecure_channel(address, options=CHANNEL_OPTIONS)).Lookup
        lookup_request = pb.LookupRequest(keys=chain)
        assert len(lookup_rpc(lookup_request).tiers) == len(chain)
        latencies = {"Lookup rpc, 128-block chain": lambda: lookup_rpc(lookup_request),
                     "Client.lookup (shared index, no call)": lambda: client.lookup(chain),
                     "raw gRPC unary call (baseline)": lambda: empty(b"")}
        # Interleaved rounds here too; the median and p99 are over every call of every round.
        samples: dict[str, list[float]] = {name: [] for name in latencies}
        for _ in range(args.rounds):
            for name, fn in latencies.items():
                samples[name] += latency_samples_ms(fn, max(1, 1000 // args.rounds))
        latency_lines, targets = [], []
        for name, values in samples.items():
            med = statistics.median(values)
            p99 = statistics.quantiles(values, n=100)[98] if len(values) > 1 else values[0]
            check = ""
            if name.startswith("Lookup rpc"):
                check = f"< {LOOKUP_TARGET_MS:g} ms: {verdict(med < LOOKUP_TARGET_MS)}"
                targets.append((f"Lookup rpc median < {LOOKUP_TARGET_MS:g} ms", f"{med:.3f} ms",
                                med < LOOKUP_TARGET_MS))
            latency_lines.append([name, f"{med:.3f}", f"{p99:.3f}", str(len(values)), check])
            figures.append({"path": name, "median_ms": med, "p99_ms": p99, "calls": len(values)})

        put_rows = put_costs(client, procs[0].pid,
                             pb_grpc.TierCacheStub(grpc.insecure_channel(address, options=CHANNEL_OPTIONS)))

        aggregate = []
        for n in (1, 2, 4):
            go = os.path.join(base, f"go{n}")
            clients = [child("--fetch-client", address, str(args.block_mib), str(args.blocks), str(args.seconds), go)
                       for _ in range(n)]
            open(go, "w").close()
            results = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in clients]
            # Not a median of calls: with more processes than cores, a call's own rate says little
            # about the total. Each client's bytes over its own run (all start together), summed.
            overall = sum(r["bytes"] / r["s"] for r in results)
            label = f"Fetch aggregate, {n} client process{'es' if n > 1 else ''}"
            aggregate.append([label, f"{overall / GB:.2f}", str(sum(r["calls"] for r in results))])
            figures.append({"path": label, "aggregate_gb_s": overall / GB, "calls": sum(r["calls"] for r in results)})

        targets = [(f"{f['path']} >= {f['target']}x {BASELINES[f['baseline']]} (median calls)", f"{f['ratio']:.2f}x",
                    f["status"] == "MET") for f in figures if "status" in f] + targets
        print(f"blocks: {args.blocks} x {total // args.blocks / (1 << 20):.2f} MiB, cpus: {os.cpu_count()}, "
              f"torch threads: {torch.get_num_threads()}, load average at start {os.getloadavg()[0]:.1f}; "
              f"{args.rounds} interleaved rounds of {args.seconds / 4:.2f} s per path")
        print("Throughput: the median of per-call rates over every call of every round (best call beside it, "
              "labelled); ratio = median call / the baseline's median call\n")
        print_table(["path", "median GB/s", "best GB/s", "calls", "ratio (medians)", "by round", "target"],
                    throughput)
        print()
        print_table(["latency", "median ms", "p99 ms", "calls", "target"], latency_lines)
        print()
        for name, value in put_rows:
            print(f"{name}: {value}")
        print()
        print_table(["aggregate fetch", "GB/s (bytes / run, summed)", "calls"], aggregate)
        print()
        for text, measured, met in targets:
            print(f"{verdict(met)}  {text}: {measured}")
        print(f"wall time {time.monotonic() - started:.0f} s")
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps(
                {"blocks": args.blocks, "block_bytes": total // args.blocks, "rounds": args.rounds,
                 "figures": figures, "put": dict(put_rows),
                 "targets": [{"text": t, "measured": m, "status": verdict(ok)} for t, m, ok in targets]},
                indent=1) + "\n")
    finally:
        for proc in procs:
            if proc.stdin:
                proc.stdin.close()
            proc.terminate()
            proc.wait(30)
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--raw-server":
        raw_server(sys.argv[2], float(sys.argv[3]), int(sys.argv[4]))
    elif len(sys.argv) > 1 and sys.argv[1] == "--fetch-client":
        fetch_client(sys.argv[2], float(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]), sys.argv[6])
    elif len(sys.argv) > 1 and sys.argv[1] == "--daemon":
        from tiercache.cli import main as cli_main

        sys.exit(cli_main(["serve", "--log-level", "WARNING", "--config", sys.argv[2]]))
    else:
        main()
