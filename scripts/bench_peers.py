"""Side-by-side benchmark: the household workload against no cache, in-process, Redis, files and tiercache (issue 6).

    python3 scripts/bench_peers.py      # default flags: prints the table, writes docs/benchmarks/peers.md and .png

The README's table is the one this writes into docs/benchmarks/peers.md (--out PATH writes PATH.md and PATH.png).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from benchmarks.configs import CONFIGS, Bench, log, make_daemon, run_all  # noqa: E402
from benchmarks.report import markdown_table, per_round, plot, table, targets, text_table  # noqa: E402
from benchmarks.runner import WorkerPool  # noqa: E402
from benchmarks.workload import ModelSpec, Sizes, kv_bytes_per_token  # noqa: E402

logger = logging.getLogger("bench_peers")
MODEL_WHY = {
    "default": ("the embedded model every tiercache worker ships with (Llama, 4 layers, hidden 256, 2 KV heads "
                "x 64, float32). A GPT-2-small shape (--model gpt2-small) prefills only ~80 tokens/s on 2 shared "
                "cores, so a 2000-token no-cache prompt would take ~25 s and the run could not fit in 5 minutes. "
                "This model still takes hundreds of ms for a long prefix, and it stores more KV bytes per FLOP "
                "saved (4 KiB per ~4.7 MFLOP vs 72 KiB per ~170 MFLOP), so the transfer matters more, not less"),
    "gpt2-small": "GPT-2-small shape (12 layers, hidden 768, 12 heads x 64, float32), seeded random weights",
}


# ---- output ---------------------------------------------------------------------------------------


def environment(b: Bench, args: argparse.Namespace) -> list[str]:
    redis_version = "n/a"
    if shutil.which("redis-server"):
        out = subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout.split()
        redis_version = next((w.split("=")[1] for w in out if w.startswith("v=")), "?")
    try:
        import redis

        client = f"redis-py {redis.__version__}" + (" + hiredis parser" if _has("hiredis") else
                                                    " (pure-Python parser; `pip install hiredis` for the C one)")
    except ImportError:
        client = "redis-py not installed"
    s, a = b.sizes, args
    return [
        f"model: {b.model.name}, attention {b.model.attn}: {MODEL_WHY[b.model.name]}",
        f"block: {a.block_tokens} tokens = {kv_bytes_per_token(b.model) * a.block_tokens:,} bytes",
        f"workload: {a.workers} worker processes x {a.threads} torch thread(s); "
        f"system prompt {s.system_tokens} tokens; "
        f"{s.requests} requests of {s.request_tokens[0]}-{s.request_tokens[1]} tokens; a {s.turns}-turn conversation "
        f"(+{s.turn_tokens} user, +{s.reply_tokens} reply tokens per turn); {s.new_tokens} new tokens each; "
        f"probes at {', '.join(map(str, s.prefix_lengths))} tokens x {s.probe_repeats}; "
        f"{a.rounds} round(s) of every configuration in turn, each from empty caches",
        f"machine: {os.cpu_count()} CPUs, {platform.machine()}, load average at start {a.load_at_start}; "
        f"redis-server {redis_version}, {client}",
    ]


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


NOTES = [
    "Rounds: every configuration runs once per round, in the table's order, and each round starts from empty "
    "caches (a new Redis, a new directory of files, a flushed daemon), so a slow spell of a shared machine falls "
    "on every row alike. The table pools the rounds: every request's TTFT, every fetch's bytes and seconds. "
    "Under each target, what each round measured on its own.",
    "TTFT: from the request to the first token's logits, in the worker (lookup + fetch + cache build + suffix "
    "prefill).",
    "Figures are over the household workload; TTFT@N are the prefix probes (one at a time on worker 0, median of "
    "the repeats), after a cold fill run that is not counted.",
    "tokens reused: prompt tokens taken from the cache, over all requests. prompt tok/s: all prompt tokens "
    "(reused or computed) over the workload's wall time, all workers together (generation and write-back included).",
    "KV fetch: bytes fetched / seconds inside fetch(), over every fetch of the row's requests and probes (lookups "
    "excluded). In every row with a figure, fetch() ends with the blocks' bytes in memory the worker owns: the "
    "in-process cache's own tensors (nothing to copy), Redis values read into bytes objects (one MGET), one read "
    "per file into a tensor, tiercache's copy out of its host slab (found through its shared index, no call; "
    "checksummed; page generations checked after the copy), the byte stream's received messages. The zero-copy "
    "row's fetch_views ends with read-only views into the daemon's slab instead, so this column has no figure for "
    "it (its fetch_views alone is given under the table). Every target is judged on the copy row.",
    "KV fetch+build: the same bytes over the seconds of fetch() plus the Worker's kvcache.blocks_to_cache of the "
    "fetched blocks (for views, also the check after it that no slab page was recycled meanwhile): in every row it "
    "ends with the model's KV cache built. blocks_to_cache copies blocks lying at even steps in one buffer (slab "
    "views, disk reads) a run at a time, and blocks in separate tensors by one concatenation per layer.",
    "tiercache verifies a checksum on every fetch; the baselines verify nothing.",
    "cache CPU: user + system CPU time of the cache's own process (redis-server, the tiercache daemon) over the "
    "household workload, per request; on a small machine it competes with the workers' prefill for the same cores. "
    "The in-process cache and the files do their work inside the workers, where it is part of their TTFT.",
    "cache peak RSS: VmHWM of the cache process over the row (reset at its start); the daemon's includes "
    "torch and the shared-memory pages it touched. In-process: the largest worker's growth over the row.",
    "survives restart: the system prompt is looked up in worker 0's cache; then redis-server or the daemon is "
    "restarted on the same socket and directory, and the benchmark's driver process, which never held a cache "
    "(like a restarted worker), looks it up again through a new adapter: yes when every block is found again. "
    "The tiercache rows share one daemon and one restart per round (the disk row's, or one after the live rows).",
    "tiercache disk tier after a restart: starts, like every row, from a flushed daemon. The system prompt's first "
    "request and each probe prefix's fill request (uncounted, as in every row) fill it; the daemon is restarted "
    "on its data (its host tier starts empty); the host tier is flushed before each probe, so every probe reads "
    "LMDB. It runs no household workload: after the restart that would start with the system prompt cached, "
    "unlike every other row. Its disk reads go through the OS page cache, which the fill left warm: a daemon "
    "restart, not a machine reboot.",
    "Baselines store raw tensor bytes under the same chained keys, with the same 16-token layout and the same "
    "Worker code (lookup, cost model, fetch, suffix prefill, write-back); only the storage differs. Redis: pipelined "
    "EXISTS, one MGET for the prefix, persistence off. Files: write to a temp name + rename, one read per file.",
]


def row_notes(b: Bench) -> list[str]:
    """A line under the table for each row that needs one: the disk row's tiers, the views row's own fetch."""
    notes = [f"{row.label}: {row.note}" for row in b.rows if row.note and not row.skipped]
    for row in b.rows:
        if row.views and not row.skipped:
            notes.append(f"{row.label}: fetch_views alone {row.raw_fetch_bytes_per_s() / 1e6:,.0f} MB/s (ends with "
                         "views into the daemon's slab, not bytes of the worker's own: not comparable with the KV "
                         "fetch column)")
    return notes


def write_outputs(b: Bench, args: argparse.Namespace, command: str) -> int:
    lengths = list(b.sizes.prefix_lengths)
    header, cells = table(b.rows, lengths)
    verdicts = targets(b.rows, max(lengths))
    rounds = per_round([targets(rows, max(lengths)) for rows in b.rounds]) if len(b.rounds) > 1 \
        else [""] * len(verdicts)
    env = environment(b, args)
    print("\n".join(env))
    print()
    print(text_table(header, cells))
    print()
    notes = row_notes(b)
    for note in notes:
        print(note)
    print()
    for t, each in zip(verdicts, rounds):
        print(f"{t.status}  {t.text}: {t.measured}" + (f"; by round {each}" if each else ""))
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    png = out.with_suffix(".png")
    if _has("matplotlib"):
        plot(b.rows, lengths, str(png), f"TTFT vs cached prefix ({b.model.name} model, {args.workers} workers)")
        figure = f"![TTFT against prefix length]({png.name})"
    else:
        figure = "(no plot: matplotlib is not installed; `pip install matplotlib`)"
        print(figure)
    md = ["# tiercache against its peers", "", f"Produced by `{command}` on "
          f"{time.strftime('%Y-%m-%d')} ({args.elapsed_s:.0f} s).", "", *[f"- {line}" for line in env], "",
          markdown_table(header, cells), "", "## Targets", "",
          *[f"- **{t.status}** {t.text}: {t.measured}" + (f"; by round {each}" if each else "")
            for t, each in zip(verdicts, rounds)], "",
          *[f"- {note}" for note in notes], "",
          figure, "", "## How to read it", "", *[f"- {n}" for n in NOTES], ""]
    out.with_suffix(".md").write_text("\n".join(md))
    print(f"\nwrote {out.with_suffix('.md')}" + (f" and {png}" if _has("matplotlib") else ""))
    if args.json:
        data = {"environment": env, "targets": [{**vars(t), "by_round": each} for t, each in zip(verdicts, rounds)],
                "rows": [r.to_json() for r in b.rows]}
        pathlib.Path(args.json).write_text(json.dumps(data, indent=1, default=lambda x: None))
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    p.add_argument("--threads", type=int, default=0, help="torch threads per worker (default: CPUs / workers)")
    p.add_argument("--model", choices=sorted(MODEL_WHY), default="default")
    p.add_argument("--attn", choices=("sdpa", "eager"), default="sdpa",
                   help="attention kernel (default sdpa, what an engine would use; eager is quadratic in memory)")
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--request-tokens", default="16,48", help="LO,HI tokens of a user request")
    p.add_argument("--new-tokens", type=int, default=4)
    p.add_argument("--prefix-lengths", default="256,1000,2000", help="probe prefix lengths for the plot")
    p.add_argument("--probe-repeats", type=int, default=5)
    p.add_argument("--block-tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3,
                   help="run every configuration this many times in turn and pool the figures (default 3)")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"subset of {','.join(CONFIGS)}")
    p.add_argument("--out", default=str(REPO / "docs" / "benchmarks" / "peers"), help="writes OUT.md and OUT.png")
    p.add_argument("--json", help="also write every figure and request as JSON here")
    p.add_argument("--keep", action="store_true", help="keep the scratch directory")
    args = p.parse_args(argv)
    unknown = sorted(set(args.configs.split(",")) - set(CONFIGS))
    if unknown:
        p.error(f"unknown config(s) {', '.join(unknown)}; expected {','.join(CONFIGS)}")
    if args.workers < 1 or args.block_tokens < 1 or args.rounds < 1:
        p.error("--workers, --block-tokens and --rounds must be >= 1")
    args.threads = args.threads or max(1, (os.cpu_count() or 1) // args.workers)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        lo, hi = (int(x) for x in args.request_tokens.split(","))
        sizes = Sizes(system_tokens=args.system_tokens, requests=args.requests, turns=args.turns,
                      request_tokens=(lo, hi), new_tokens=args.new_tokens, probe_repeats=args.probe_repeats,
                      prefix_lengths=tuple(int(x) for x in args.prefix_lengths.split(",")))
    except ValueError as e:  # Sizes names the bad field; int() and the unpacking name the bad flag value
        print(f"bench_peers: bad sizes: {e}", file=sys.stderr)
        return 2
    model = ModelSpec(args.model, args.attn, max_positions=max(4096, sizes.longest_prompt() + 64))
    args.load_at_start = " ".join(f"{x:.1f}" for x in os.getloadavg())
    start = time.monotonic()
    workdir = tempfile.mkdtemp(prefix="tcbp-", dir="/tmp")  # short: Unix socket paths are limited to 108 bytes
    selected = args.configs.split(",")
    log(f"bench_peers: {args.workers} workers, model {args.model}, scratch {workdir}")
    daemon = make_daemon(sizes, model, workdir, str(REPO)) if any(k.startswith("tc-") for k in selected) else None
    pool = None
    stops: list[Callable[[], None]] = []  # cache processes a row started
    try:
        if daemon is not None:
            daemon.launch()
        pool = WorkerPool(args.workers, model, threads=args.threads, new_tokens=args.new_tokens)
        if daemon is not None:
            daemon.wait_ready()  # before any row: no measurement overlaps its start
        log(f"  workers and daemon ready in {time.monotonic() - start:.1f} s")
        bench = Bench(args.block_tokens, sizes, model, pool, workdir, daemon, stops=stops)
        run_all(bench, selected, args.rounds)
    finally:
        for stop in reversed(stops):
            stop()
        if daemon is not None:
            daemon.stop()
        if pool is not None:
            pool.close()
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    args.elapsed_s = time.monotonic() - start
    command = " ".join(["python3", "scripts/bench_peers.py", *(sys.argv[1:] if argv is None else argv)])
    return write_outputs(bench, args, command)


if __name__ == "__main__":
    sys.exit(main())
