"""Time to first token of vLLM (CPU build) with and without tiercache as its KV connector.

    python3 scripts/bench_vllm.py [--lengths 600,2000,4000] [--reps 3] [--markdown docs/benchmarks/vllm.md]

Every row prefills the same prompts on the same model (a Llama with random weights, 8 layers, 8 KV
heads of 64: 4 MiB per 128-token vLLM block) and times generate(max_tokens=1) in the engine process:

  recompute        no connector, a prompt the engine has never seen: the full prefill
  prefix cache     no connector, the same prompt again in the same process: vLLM's own prefix cache
  ExampleConnector vLLM's reference connector (safetensors files), in a fresh process
  tiercache host   a fresh process; another process put the blocks, the daemon holds them in its host tier
  tiercache disk   a fresh process after a daemon restart: the blocks come from its disk (LMDB) tier

Each engine first answers an unrelated prompt (its first forward and first load pay one-off costs). Figures are
medians over --reps distinct prompts per length. Needs .venv-vllm (scripts/setup_vllm.sh).
Targets: tiercache host within 1.5x of the prefix cache, and at least 3x faster than ExampleConnector.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from benchmarks.daemons import Daemon, small_config, write_config  # noqa: E402
from benchmarks.record import recorded  # noqa: E402
from benchmarks.tiny_llama import BENCH, prompt_ids, save_tiny_llama  # noqa: E402
from benchmarks.vllm_engine import VllmEngine  # noqa: E402
from tiercache.config import HostConfig, ServerConfig, StoreConfig  # noqa: E402

ROWS = ("recompute", "prefix cache", "ExampleConnector", "tiercache host", "tiercache disk")


def prompts(lengths: list[int], reps: int) -> dict[int, list[list[int]]]:
    return {n: [prompt_ids(n, 1000 * n + r, vocab=BENCH.vocab) for r in range(reps)] for n in lengths}


def warm(engine: VllmEngine) -> None:
    """The same unrelated prompt in every engine: computed (and stored) by the first of each kind,
    loaded by the fresh ones, so one-off costs of a process's first load are not in the figures."""
    engine.generate(prompt_ids(600, 7, vocab=BENCH.vocab), 1)


def timed(engine: VllmEngine, prompt: list[int], expect_cached: int | None, label: str) -> float:
    reply = engine.generate(prompt, 1)
    if expect_cached is not None and reply["num_cached_tokens"] != expect_cached:
        print(f"  note: {label} at {len(prompt)} tokens: {reply['num_cached_tokens']} cached tokens, "
              f"expected {expect_cached}")
    return reply["wall_s"]


def settle(socket: str, timeout_s: float = 300.0) -> None:
    """Wait until the daemon's disk tier holds every block of its host tier (write-through): the
    figures after it are not taken while the daemon still writes to LMDB on the same cores."""
    from tiercache.client import Client

    deadline = time.monotonic() + timeout_s
    with Client(f"unix:{socket}") as client:
        while time.monotonic() < deadline:
            blocks = {t.tier: t.num_blocks for t in client.stats().tiers}
            if blocks.get("disk", 0) >= blocks.get("host", 0):
                return
            time.sleep(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="600,2000,4000")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--markdown", default="")
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    base = tempfile.mkdtemp(prefix="tc-bv-", dir="/tmp")
    try:
        with recorded(args.markdown, "vLLM: time to first token with tiercache as its KV connector"):
            run(base, lengths, args.reps)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def run(base: str, lengths: list[int], reps: int) -> None:
    model = save_tiny_llama(os.path.join(base, "model"), BENCH)
    block_bytes = BENCH.num_layers * 2 * BENCH.num_kv_heads * 128 * BENCH.head_dim * 4
    # Every block of the run fits in host with room to spare (rows must not read evicted blocks from
    # disk); the daemon's server settings are its defaults, not the tests' fast maintenance ticks.
    host_bytes = (sum(lengths) * reps + 600) // 128 * block_bytes * 2
    config = small_config(base, disk_bytes=host_bytes * 2)
    config = dataclasses.replace(config, host=HostConfig(capacity_bytes=host_bytes),
                                 store=StoreConfig(max_block_bytes=16 << 20),
                                 server=ServerConfig(socket=config.server.socket))
    conf = write_config(os.path.join(base, "daemon.toml"), config)
    socket = config.server.socket
    work = prompts(lengths, reps)
    max_len = max(lengths) + 512
    times: dict[str, dict[int, list[float]]] = {row: {n: [] for n in lengths} for row in ROWS}
    block = 128
    print(f"model: Llama, {BENCH.num_layers} layers, {BENCH.num_kv_heads} KV heads x {BENCH.head_dim}, float32; "
          f"vLLM block {block} tokens = {block_bytes >> 20} MiB; daemon host tier {host_bytes >> 20} MiB")
    print(f"lengths {lengths}, {reps} prompts each; TTFT = generate(max_tokens=1) in the engine, median\n")

    def engine(connector: str, name: str, **kw: object) -> VllmEngine:
        started = time.perf_counter()
        e = VllmEngine(model, connector=connector, socket=socket, max_model_len=max_len,
                       log_path=os.path.join(base, f"{name}.log"), **kw)  # type: ignore[arg-type]
        warm(e)
        print(f"  {name}: engine ready in {time.perf_counter() - started:.0f} s")
        return e

    with engine("none", "plain") as plain:
        for n in lengths:
            for p in work[n]:
                times["recompute"][n].append(timed(plain, p, 0, "recompute"))
                times["prefix cache"][n].append(timed(plain, p, n // block * block, "prefix cache"))
    example_dir = os.path.join(base, "example")
    with engine("example", "example-writer", example_dir=example_dir) as writer:
        for n in lengths:
            for p in work[n]:
                writer.generate(p, 1)
    with engine("example", "example-reader", example_dir=example_dir) as reader:
        for n in lengths:
            for p in work[n]:
                times["ExampleConnector"][n].append(timed(reader, p, None, "ExampleConnector"))
    daemon = Daemon(config=conf)
    daemon.wait_ready(120)
    try:
        with engine("tiercache", "tiercache-writer") as writer:
            for n in lengths:
                for p in work[n]:
                    writer.generate(p, 1)
        settle(socket)
        with engine("tiercache", "tiercache-reader") as reader:
            for n in lengths:
                for p in work[n]:
                    times["tiercache host"][n].append(timed(reader, p, n // block * block, "tiercache host"))
        daemon.stop()
        daemon = Daemon(config=conf)
        daemon.wait_ready(120)
        with engine("tiercache", "tiercache-after-restart") as reader:
            for n in lengths:
                for p in work[n]:
                    times["tiercache disk"][n].append(timed(reader, p, n // block * block, "tiercache disk"))
    finally:
        daemon.stop()
    report(times, lengths)


def report(times: dict[str, dict[int, list[float]]], lengths: list[int]) -> None:
    med = {row: {n: statistics.median(times[row][n]) for n in lengths} for row in ROWS}
    print()
    print(f"{'TTFT, ms (median)':<22}" + "".join(f"{n:>10}" for n in lengths))
    for row in ROWS:
        print(f"{row:<22}" + "".join(f"{med[row][n] * 1000:>10.1f}" for n in lengths))
    print()
    print(f"{'ratio':<40}" + "".join(f"{n:>9}" for n in lengths) + "  target")
    lines = [("tiercache host / prefix cache", "tiercache host", "prefix cache", "<= 1.5x"),
             ("tiercache disk / prefix cache", "tiercache disk", "prefix cache", ""),
             ("ExampleConnector / tiercache host", "ExampleConnector", "tiercache host", ">= 3x"),
             ("recompute / tiercache host", "recompute", "tiercache host", ""),
             ("recompute / tiercache disk", "recompute", "tiercache disk", "")]
    for label, a, b, target in lines:
        print(f"{label:<40}" + "".join(f"{med[a][n] / med[b][n]:>8.2f}x" for n in lengths) + f"  {target}")
    print()
    spread = {row: {n: (min(times[row][n]) * 1000, max(times[row][n]) * 1000) for n in lengths} for row in ROWS}
    print("spread (min-max ms): " + "; ".join(
        f"{row} " + ", ".join(f"{lo:.0f}-{hi:.0f}" for lo, hi in spread[row].values()) for row in ROWS))


if __name__ == "__main__":
    main()
