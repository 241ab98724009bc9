"""Time to first token on a GPT-2-small-shaped model: full prefill, the in-memory ideal, and the daemon's tiers.

    python3 scripts/bench_ttft.py [--lengths 512,2000,4000] [--ab-pairs 30] [--json FILE] [--plot FILE]

"restart" is the first request after the daemon was stopped and started again: every block comes from
the disk tier (LMDB), found by the new daemon's start, which reads metadata only.

A cache miss's cost is judged on an interleaved A/B of whole requests (cache off against a reachable
daemon whose lookup misses): the median of the pairs' relative differences and its 95% confidence
interval. The "< 2%" target reads MET only when that whole interval lies under 2%, MISSED when it lies
at or over it, and NOT RESOLVED when the pairs cannot tell.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout without installing

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from benchmarks.daemons import Daemon
from benchmarks.record import recorded
from benchmarks.services import cpu_seconds
from tiercache.client import Client
from tiercache.keys import block_keys
from tiercache.layout import BlockLayout
from tiercache.worker import Request, Result, Worker
from tiercache.worker.kvcache import blocks_to_cache, prefill
from tiercache.worker.model import LoadedModel, wrap_model

logger = logging.getLogger("bench_ttft")
MiB = 1 << 20
MET, MISSED, NOT_RESOLVED = "MET", "MISSED", "NOT RESOLVED"
VOCAB = 50257  # GPT-2's; the lm head only scores the last position, so it barely shows in the timings


class IdTokenizer:
    """Token ids in, token ids out: the benchmark feeds ids, never text."""

    vocab_size = VOCAB
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError("the benchmark sends token ids")

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(map(str, ids))


def build_model(layers: int, hidden: int, heads: int, positions: int, attn: str) -> LoadedModel:
    config = GPT2Config(vocab_size=VOCAB, n_embd=hidden, n_layer=layers, n_head=heads, n_positions=positions)
    config._attn_implementation = attn  # what the attn_implementation keyword sets (GPT2Config's stub lacks it)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(config).eval()
    return wrap_model(model, IdTokenizer(), f"bench-gpt2-{layers}x{hidden}-{attn}")


def settle(pid: int, timeout_s: float = 60.0) -> None:
    """Wait until the daemon is idle (its disk writer done), so it does not steal CPU from the next timing."""
    deadline = time.monotonic() + timeout_s
    before = cpu_seconds(pid)
    while before is not None and time.monotonic() < deadline:  # None: no /proc here, nothing to wait on
        time.sleep(0.2)
        now = cpu_seconds(pid)
        if now is None or now - before < 0.02:
            return
        before = now


def median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def max_diff(a: list[tuple[int, float]], b: list[tuple[int, float]]) -> float:
    """Largest difference of the top-k next-token scores of two runs (inf when they rank different tokens)."""
    da, db = dict(a), dict(b)
    return max(abs(da[t] - db[t]) for t in da) if da.keys() == db.keys() else float("inf")


def median_ci(values: list[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """The median of `values` and a distribution-free confidence interval for it: the order statistics
    that the sign test (binomial(n, 1/2)) puts around it; (-inf, inf) when n is too small for one."""
    ordered, n = sorted(values), len(values)
    tail, k = (1 - confidence) / 2, 0
    while k < n // 2 and sum(math.comb(n, i) for i in range(k + 1)) / 2**n <= tail:
        k += 1
    if k == 0:
        return statistics.median(ordered), -math.inf, math.inf
    return statistics.median(ordered), ordered[k - 1], ordered[n - k]


def ab_miss_vs_off(length: int, args: argparse.Namespace, worker: Worker, client: Client, daemon_pid: int) -> dict:
    """Interleaved A/B of whole requests on the same prompt: the cache off (no daemon at all) against the
    cache on with a daemon that is reachable but holds nothing for it (a fresh salt per pair: the lookup
    misses, the prompt is computed in full and stored after its first token). Which runs first alternates
    pair by pair; each pair gives one relative difference of the miss's TTFT over the off run's."""
    prompt = tuple(tokens(length, 7000 + length) + tokens(args.suffix, 7001 + length))
    off, miss, diffs = [], [], []
    for i in range(args.ab_pairs):
        salt = f"ab-{length}-{i}"
        pair: dict[str, float] = {}
        for name in (("off", "miss") if i % 2 == 0 else ("miss", "off")):
            settle(daemon_pid)  # the previous miss's write-back is on disk: it does not share the CPU
            result = worker.run(Request(prompt, max_new_tokens=1, salt=salt, cache=name == "miss"))
            worker.drain()
            if result.degraded or result.cached_tokens:
                raise SystemExit(f"the A/B's {name} run was not a clean miss: cached {result.cached_tokens} "
                                 f"tokens, degraded {result.degraded!r}")
            pair[name] = result.ttft_s
        client.flush(namespace=worker.namespace(salt).digest())
        off.append(pair["off"])
        miss.append(pair["miss"])
        diffs.append(100 * (pair["miss"] / pair["off"] - 1))
    med, low, high = median_ci(diffs)
    quartiles = statistics.quantiles(diffs, n=4) if len(diffs) > 1 else [diffs[0]] * 3
    return {"pairs": len(diffs), "off_ms": round(median_ms(off), 2), "miss_ms": round(median_ms(miss), 2),
            "median_diff_pct": med, "ci_low_pct": low, "ci_high_pct": high, "iqr_pct": [quartiles[0], quartiles[2]],
            "diffs_pct": diffs}


def ab_status(ab: dict, bound_pct: float = 2.0) -> str:
    """MET when the whole confidence interval of the median paired difference lies under the bound,
    MISSED when it lies at or over it, NOT RESOLVED when it straddles it (too few pairs for the noise)."""
    if ab["ci_high_pct"] < bound_pct:
        return MET
    if ab["ci_low_pct"] >= bound_pct:
        return MISSED
    return NOT_RESOLVED


def bench_length(length: int, args: argparse.Namespace, loaded: LoadedModel, workers: dict[str, Worker],
                 client: Client, daemon_pid: int, ab: bool = False) -> dict:
    shm = workers["shm"]
    prefix = tokens(length, length)
    suffixes = [tokens(args.suffix, 1000 + r) for r in range(max(args.repeat, args.cold_repeat))]
    times: dict[str, list[float]] = {name: [] for name in ("full", "ideal", "shm", "stream", "disk")}
    scores: dict[tuple[str, int], list[tuple[int, float]]] = {}
    cached: dict[str, int] = {}

    def run(name: str, worker: Worker, r: int, salt: str, cache: bool = True) -> Result:
        settle(daemon_pid)
        result = worker.run(Request(tuple(prefix + suffixes[r]), max_new_tokens=1, salt=salt, cache=cache,
                                    return_scores=5))
        worker.drain()
        if result.degraded:
            raise SystemExit(f"the daemon failed during the benchmark: {result.degraded}")
        if name in times:
            times[name].append(result.ttft_s)
            scores[name, r] = result.scores
            cached[name] = result.cached_tokens
        return result

    row: dict = {"length": length}
    if ab:
        row["ab"] = ab_miss_vs_off(length, args, shm, client, daemon_pid)
    for r in range(args.cold_repeat):  # full prefill: the cache off
        run("full", shm, r, "", cache=False)
    warm = f"warm-{length}"
    run("store", shm, 0, warm)  # not timed: its miss stores the prefix, which every path below reuses
    ns = shm.namespace(warm)
    n = (length + args.suffix - 1) // ns.block_tokens
    # What a miss adds before the prefill, timed alone (for information: the target is the A/B above).
    probe = []
    for i in range(20):
        start = time.perf_counter()
        client.lookup(block_keys(shm.namespace(f"probe-{i}"), prefix + suffixes[0])[:n])
        probe.append(time.perf_counter() - start)
    # The ideal: the same prefix blocks already in this process, only blocks_to_cache + the suffix forward.
    layout = BlockLayout.of(ns)
    blocks = [b.payload.view(layout.torch_dtype).view(b.meta.shape) for b in client.fetch(block_keys(ns, prefix))]
    for r in range(args.repeat):
        start = time.perf_counter()
        logits, _ = prefill(loaded.model, suffixes[r], blocks_to_cache(blocks, loaded.model))
        times["ideal"].append(time.perf_counter() - start)
        top = torch.topk(logits, 5)
        scores["ideal", r] = list(zip(top.indices.tolist(), top.values.tolist()))
    del blocks
    for name in ("shm", "stream", "disk"):
        for r in range(args.repeat):
            if name == "disk":
                settle(daemon_pid)
                client.flush(tier="host")  # every block now comes from LMDB (and is promoted back)
            result = run(name, workers["stream" if name == "stream" else "shm"], r, warm)
            want = "disk" if name == "disk" else "host"
            if set(result.tiers) != {want}:
                logger.warning("%s run at %d tokens hit tiers %s", name, length, sorted(set(result.tiers)))
    client.flush(namespace=ns.digest())
    row.update({name: round(median_ms(v), 2) for name, v in times.items()})
    row.update(cached=cached, probe=round(median_ms(probe), 3),
               max_score_diff=max((max_diff(s, scores["full", r]) for (name, r), s in scores.items()
                                   if name != "full" and ("full", r) in scores), default=0.0))
    return row


def after_restarts(args: argparse.Namespace, loaded: LoadedModel, lengths: list[int], start: Callable[[], Daemon],
                   daemon: Daemon) -> tuple[dict[int, float], Daemon]:
    """TTFT (ms, median over --repeat restarts) of each length's first request after a daemon restart: each
    prefix is stored once, then the daemon is stopped (SIGTERM: it drains its disk writes) and started
    again, and a fresh worker asks for every prefix, each a disk-tier read. Returns the medians and the
    daemon now running."""
    address = daemon.addresses[0]
    prefixes = {length: tokens(length, length) for length in lengths}
    suffix = tokens(args.suffix, 1000)
    with Client(address, timeout_s=60) as client:
        worker = Worker(loaded, lambda: Client(address, timeout_s=60, tune_allocator=True))
        for prefix in prefixes.values():  # stored under a salt no other path used
            worker.run(Request(tuple(prefix + suffix), max_new_tokens=1, salt="restart"))
            worker.drain()
        worker.close()
        client.stats()
    samples: dict[int, list[float]] = {length: [] for length in lengths}
    for r in range(args.repeat):
        if daemon.stop() != 0:
            raise SystemExit(f"the daemon did not stop cleanly: {daemon.stderr[-2000:]}")
        daemon = start()
        fresh = daemon.wait_ready(120)[0]
        worker = Worker(loaded, lambda fresh=fresh: Client(fresh, timeout_s=60, tune_allocator=True))
        # Untimed: the worker's first call connects and maps the new daemon's shared memory (a worker that
        # outlives the restart reconnects once, too); its prompt shares no block with the timed ones.
        worker.run(Request(tuple(tokens(16, 3000 + r)), max_new_tokens=1, salt="restart-warmup"))
        worker.drain()
        for length, prefix in prefixes.items():
            settle(daemon.proc.pid)
            result = worker.run(Request(tuple(prefix + tokens(args.suffix, 2000 + r)), max_new_tokens=1,
                                        salt="restart"))
            worker.drain()
            if result.degraded or set(result.tiers) != {"disk"}:
                raise SystemExit(f"after restart {r + 1}: tiers {sorted(set(result.tiers))}, {result.degraded or ''}")
            samples[length].append(result.ttft_s)
        worker.close()
        figures = ", ".join(f"{n} tokens {1e3 * v[-1]:.0f} ms" for n, v in samples.items())
        print(f"restart {r + 1} of {args.repeat}: {figures}", file=sys.stderr, flush=True)
    return {length: round(median_ms(v), 2) for length, v in samples.items()}, daemon


def plot(rows: list[dict], path: str, title: str) -> None:
    """TTFT against prompt length: full prefill, from the host tier, from the disk tier after a restart."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = [r["length"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    lines = (("full", "full prefill (no cache)", "o-", 7), ("restart", "disk tier, after a daemon restart", "s-", 7),
             ("shm", "host tier (shared memory)", "^-", -13))  # the last two lie close: labels above and below
    for key, label, style, dy in lines:
        values = [r[key] for r in rows]
        (line,) = ax.plot(lengths, values, style, label=label)
        for x, y in zip(lengths, values, strict=True):
            ax.annotate(f"{y:.0f} ms", (x, y), textcoords="offset points", xytext=(5, dy), fontsize=8,
                        color=line.get_color())
    ax.margins(x=0.12, y=0.2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt length (tokens; all but the last 16 cached)")
    ax.set_ylabel("time to first token (ms, log scale)")
    ax.set_title(title, fontsize=10)
    ax.set_xticks(lengths)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def print_table(rows: list[dict]) -> None:
    print(f"\n{'prefix':>6} {'full ms':>9} {'ideal ms':>9} {'shm ms':>8} {'stream ms':>9} {'disk ms':>8} "
          f"{'restart ms':>10} {'shm/ideal':>9} {'stream/ideal':>12} {'disk/ideal':>10} {'full/shm':>8} "
          f"{'full/ideal':>10} {'max|dscore|':>11}")
    for r in rows:
        print(f"{r['length']:>6} {r['full']:>9.1f} {r['ideal']:>9.1f} {r['shm']:>8.1f} {r['stream']:>9.1f} "
              f"{r['disk']:>8.1f} {r['restart']:>10.1f} {r['shm'] / r['ideal']:>9.2f} "
              f"{r['stream'] / r['ideal']:>12.2f} {r['disk'] / r['ideal']:>10.2f} {r['full'] / r['shm']:>8.1f} "
              f"{r['full'] / r['ideal']:>10.1f} "
              f"{r['max_score_diff']:>11.1e}")
    ab_rows = [r for r in rows if "ab" in r]
    if ab_rows:
        print("\nA cache miss, whole requests: the cache off against a reachable daemon whose lookup misses, "
              "interleaved pairs (order alternating);\nmedian of the pairs' relative differences, its 95% "
              "confidence interval (sign test), the differences' interquartile range")
        print(f"{'prefix':>6} {'pairs':>5} {'off ms':>9} {'miss ms':>9} {'median diff':>11} {'95% CI':>17} "
              f"{'IQR':>17} {'keys+Lookup alone':>18}  verdict (< 2%)")
        for r in ab_rows:
            ab = r["ab"]
            print(f"{r['length']:>6} {ab['pairs']:>5} {ab['off_ms']:>9.1f} {ab['miss_ms']:>9.1f} "
                  f"{ab['median_diff_pct']:>+10.2f}% {_span(ab['ci_low_pct'], ab['ci_high_pct']):>17} "
                  f"{_span(*ab['iqr_pct']):>17} {r['probe']:>8.2f} ms ={100 * r['probe'] / ab['off_ms']:>6.3f}%  "
                  f"{ab_status(ab)}")


def _span(low: float, high: float) -> str:
    return f"{low:+.2f}..{high:+.2f}%" if math.isfinite(low) and math.isfinite(high) else "(too few pairs)"


def targets(rows: list[dict]) -> list[tuple[str, str]]:
    """(status, text) of every target, judged on this run's figures."""
    at = min(rows, key=lambda r: abs(r["length"] - 2000))
    checks = [(MET if at["shm"] <= 1.3 * at["ideal"] else MISSED,
               f"shared memory <= 1.3x ideal at {at['length']} tokens ({at['shm'] / at['ideal']:.2f}x)"),
              (MET if at["full"] >= 25 * at["shm"] else MISSED,
               (f"shared memory >= 25x faster than full prefill at {at['length']} tokens "
                f"({at['full'] / at['shm']:.1f}x)"))]
    for r in rows:
        if "ab" in r:
            ab = r["ab"]
            checks.append((ab_status(ab), (f"a cache miss adds < 2% to a {r['length']}-token request (A/B of "
                                           f"{ab['pairs']} pairs: median {ab['median_diff_pct']:+.2f}%, 95% CI "
                                           f"{_span(ab['ci_low_pct'], ab['ci_high_pct'])})")))
    checks.append((MET if all(r["max_score_diff"] < 1e-4 for r in rows) else MISSED,
                   "cached runs score like a full recompute (max |dscore| < 1e-4)"))
    return checks


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--lengths", default="512,2000,4000", help="prefix lengths in tokens, multiples of 16")
    p.add_argument("--suffix", type=int, default=16, help="suffix tokens computed on every request (default 16)")
    p.add_argument("--repeat", type=int, default=3, help="timed runs of each cached path; medians are shown")
    p.add_argument("--cold-repeat", type=int, default=2, help="full prefills (cache off) per length; medians shown")
    p.add_argument("--ab-pairs", type=int, default=30,
                   help="interleaved pairs of whole requests (cache off, lookup misses) for the < 2%% target "
                   "(default 30)")
    p.add_argument("--ab-lengths", help="prefix lengths of the A/B (default: the shortest of --lengths, where a "
                   "miss's fixed cost weighs most)")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--heads", type=int, help="attention heads (default: hidden / 64, as in GPT-2)")
    p.add_argument("--attn", choices=("sdpa", "eager"), default="sdpa")
    # 1 by default: on a small shared box, OpenMP threads spin-waiting for a descheduled sibling made a
    # 16-token forward 5-10x slower (measured: 0.19 s with 1 thread, 0.9-2.7 s with 2 on 2 busy cores).
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1; 0: torch's choice)")
    p.add_argument("--json", metavar="FILE", help="also write the rows and targets as JSON")
    p.add_argument("--markdown", metavar="PATH", help="also write the output as a page (docs/benchmarks/ttft.md)")
    p.add_argument("--plot", metavar="FILE", help="also draw TTFT against prompt length (full prefill, host tier, "
                                                  "disk tier after a restart) into this PNG (needs matplotlib)")
    p.add_argument("--replot", metavar="JSON",
                   help="measure nothing: draw --plot from the rows a run wrote with --json")
    args = p.parse_args(argv)
    if args.replot:
        if not args.plot:
            p.error("--replot needs --plot FILE")
        saved = json.loads(pathlib.Path(args.replot).read_text())
        plot(saved["rows"], args.plot, saved["title"])
        return 0
    lengths = [int(x) for x in args.lengths.split(",")]
    ab_lengths = {int(x) for x in args.ab_lengths.split(",")} if args.ab_lengths else {min(lengths)}
    args.heads = args.heads or max(1, args.hidden // 64)
    if any(n < 16 or n % 16 for n in lengths) or min(args.repeat, args.cold_repeat) < 1 or args.suffix < 1:
        p.error("--lengths must be multiples of 16, --repeat, --cold-repeat and --suffix >= 1")
    if not ab_lengths <= set(lengths) or args.ab_pairs < 1:
        p.error("--ab-lengths must be among --lengths, --ab-pairs >= 1")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.monotonic()
    loaded = build_model(args.layers, args.hidden, args.heads, max(lengths) + 2 * args.suffix + 32, args.attn)
    layout = BlockLayout.of(Worker(loaded, None).namespace())
    # Room for two prompts of the longest length (one namespace is flushed before the next is stored),
    # plus the suffix blocks of the warm runs, and headroom for page rounding and the high watermark.
    host_bytes = max(64 * MiB, int(1.5 * layout.nbytes(2 * (max(lengths) + args.suffix * (3 * args.repeat + 2)))))
    tmp = tempfile.mkdtemp(prefix="tc-bench-", dir="/tmp")
    env = {"TIERCACHE_HOST__CAPACITY_BYTES": str(host_bytes), "TIERCACHE_HOST__PAGE_BYTES": str(256 * 1024),
           "TIERCACHE_DISK__CAPACITY_BYTES": str(2 * host_bytes),
           "TIERCACHE_SERVER__IDLE_CHECK_S": "3600",  # no integrity sweep in the middle of a timing
           "TIERCACHE_STORE__MAX_BLOCK_BYTES": str(max(layout.nbytes(), MiB))}
    def start() -> Daemon:
        return Daemon("--socket", os.path.join(tmp, "d.sock"), "--data-dir", os.path.join(tmp, "data"),
                      "--log-level", "WARNING", env=env)

    daemon = start()
    rows = []
    try:
        address = daemon.wait_ready(120)[0]
        factories: dict[str, Callable[[], Client]] = {
            "shm": lambda: Client(address, timeout_s=60, tune_allocator=True),
            "stream": lambda: Client(address, timeout_s=60, shared_memory=False, tune_allocator=True)}
        workers = {name: Worker(loaded, f) for name, f in factories.items()}
        with Client(address, timeout_s=60, tune_allocator=True) as client:
            # One untimed pass over every path at a small size: first calls pay lazy imports and allocations.
            once = argparse.Namespace(**{**vars(args), "repeat": 1, "cold_repeat": 1, "ab_pairs": 2})
            bench_length(32, once, loaded, workers, client, daemon.proc.pid, ab=True)
            for length in lengths:
                rows.append(bench_length(length, args, loaded, workers, client, daemon.proc.pid,
                                         ab=length in ab_lengths))
                print(f"length {length} done after {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
        for w in workers.values():
            w.close()
        restarted, daemon = after_restarts(args, loaded, lengths, start, daemon)
        for row in rows:
            row["restart"] = restarted[row["length"]]
        code = daemon.stop()
    finally:
        daemon.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    with recorded(args.markdown, "Time to first token"):
        print(f"GPT-2-shaped model: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, float32, "
              f"attn={args.attn}, threads={torch.get_num_threads()}; suffix {args.suffix} tokens; "
              f"medians of {args.repeat} (full prefill: {args.cold_repeat}); KV {layout.nbytes(1)} bytes/token")
        print_table(rows)
        print()
        checks = targets(rows)
        for status, text in checks:
            print(f"{status}  {text}")
        print(f"daemon exit code {code}; wall time {time.monotonic() - started:.0f} s "
              "(disk = LMDB reads through a warm OS page cache)")
    title = (f"GPT-2-small-shaped model ({args.layers} layers, hidden {args.hidden}, float32), CPU, "
             f"{torch.get_num_threads()} thread(s)")
    if args.plot:
        plot(rows, args.plot, title)
        print(f"plot written to {args.plot}", file=sys.stderr)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(
            {"rows": rows, "targets": [{"status": status, "text": text} for status, text in checks], "title": title},
            indent=1) + "\n")
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
