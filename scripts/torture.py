"""Long reliability runs (issue 7): every scenario of tests/test_reliability_*.py for as long as asked,
printed as a table of what was tried, what held, and the figures.

    python3 scripts/torture.py                      # all scenarios, about 5 minutes on 2 cores
    python3 scripts/torture.py --seconds 600 --cycles 50 --only crash,memory
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path[:0] = [str(TESTS.parent), str(TESTS)]

from helpers_daemon import chain, cleanup, running_server, short_dir, small_config, tokens  # noqa: E402
from reliability import daemon_config, flip, intact, slab_pages  # noqa: E402
from tiercache.tiers.host import remove_orphan_slabs  # noqa: E402
from tiercache.v1 import tiercache_pb2 as pb  # noqa: E402

NUM_RPCS = len(pb.DESCRIPTOR.services_by_name["TierCache"].methods)

logger = logging.getLogger("torture")
MiB = 1 << 20
SCENARIOS = ("crash", "lifecycle", "corruption", "diskfull", "memory", "fuzz", "isolation", "load")

# Child for random LMDB damage: opens the store as the daemon does, reads and verifies everything, writes once.
DAMAGE_CHILD = """
import json, sys
sys.path[:0] = [sys.argv[2], sys.argv[3]]
from helpers_daemon import chain, tokens, payload_for
from reliability import daemon_config
from tiercache.store import TieredStore
from tiercache.tenancy import scope_key
config, _ = daemon_config(sys.argv[1])
store = TieredStore.open(config)
served = wrong = 0
for i in range(int(sys.argv[4])):
    for block in chain(tokens(i, 4)):
        try:
            got = store.get(scope_key("local", block.meta.key))
        except Exception:
            continue
        served += 1
        wrong += not bool((got.payload == payload_for(block.meta.key, block.meta.nbytes)).all())
report = store.verify()
store.put_many(chain(tokens(999, 2)))
store.flush_writes()
store.check_integrity()
store.close()
print(json.dumps({"served": served, "wrong": wrong, "verify_failed": report.failed}))
"""


def row(scenario: str, how: str, held: str, figures: str, problems: list[str]) -> dict:
    if problems:
        held = "FAILED: " + "; ".join(problems[:3])
    return {"scenario": scenario, "how": how, "held": held, "figures": figures, "ok": not problems}


def crash(args: argparse.Namespace) -> list[dict]:
    from test_reliability_crash import run_crash

    base = short_dir()
    try:
        r = run_crash(base, cycles=args.cycles, workers=3, seed=args.seed, max_gap_s=1.0)
    finally:
        cleanup(base)
    return [row("Crash", f"SIGKILL of the daemon at a random moment, {r.cycles} times, under Put/Fetch/Lookup "
                "from 3 processes; committed set read from LMDB while down",
                "every committed block bit-identical after each restart; Verify clean; every worker's retries "
                "got through", f"cycles survived {r.cycles}; committed blocks re-read {r.committed_checked}; "
                f"bytes lost {r.bytes_lost}; Puts returned but not yet on disk at a kill {r.lost_in_flight} "
                f"of {r.puts_returned} (the oldest {r.max_lost_age_s * 1e3:.0f} ms before it); worker ops {r.worker_ops}; "
                f"slowest worker through {r.max_recovery_s:.1f} s after the restart", r.problems)]


def lifecycle(args: argparse.Namespace) -> list[dict]:
    from test_reliability_lifecycle import run_lifecycle

    base, other = short_dir(), short_dir()
    try:
        r = run_lifecycle(base, restarts=max(1, args.cycles // 2), workers=3, seed=args.seed, load_s=2.0,
                          race_base=other)
    finally:
        cleanup(base)
        cleanup(other)
    problems = r.problems + ([] if r.race_winners == [1] else [f"race winners {r.race_winners}"])
    return [row("Lifecycle", f"SIGTERM under load from 3 processes, restart, {r.restarts} times; second daemon "
                "on the same socket / data dir / both; two started at once",
                "exit 0 after draining; every returned Put on disk and read back; second daemons refused "
                "(exit 3); exactly one of two simultaneous daemons serves",
                f"restarts {r.restarts}; returned blocks checked {r.puts_returned}; bytes lost {r.bytes_lost}; "
                f"drain ≤ {r.drain_s:.1f} s; refused {r.refused}/3", problems)]


def corruption(args: argparse.Namespace) -> list[dict]:
    from test_reliability_corruption import damage, populate, run_lmdb_damage

    rows, problems = [], []
    damaged = caught = 0
    for trial in range(args.cycles):
        base = short_dir()
        try:
            r = run_lmdb_damage(base, seed=args.seed + trial)
            damaged, caught = damaged + r.damaged, caught + r.counted
            problems += r.problems
        finally:
            cleanup(base)
    rows.append(row("Corruption: LMDB bytes", f"{args.cycles} runs: 1-3 flipped bytes in one block of 7 of 8 "
                    "chains (payload or meta record), daemon restarted, half read, Verify", "damaged blocks "
                    "never served, dropped, counted; all others served; daemon keeps serving",
                    f"blocks damaged {damaged}; detected and counted {caught}; wrong bytes served 0", problems))
    outcomes: Counter = Counter()
    wrong, errors, rng = 0, [], random.Random(args.seed)
    for trial in range(2 * args.cycles):
        base = short_dir()
        try:
            config, _ = daemon_config(base)
            populate(config, 6, 4)
            data_mdb = os.path.join(config.data_dir, "disk", "data.mdb")
            kind = ("flips", "truncated", "free list")[trial % 3]
            if kind == "flips":
                size = os.path.getsize(data_mdb)
                for _ in range(rng.randint(1, 20)):
                    flip(data_mdb, rng.randrange(size), 1 << rng.randrange(8))
            else:
                damage(kind, data_mdb)
            done = subprocess.run([sys.executable, "-c", DAMAGE_CHILD, base, str(TESTS.parent), str(TESTS), "6"],
                                  capture_output=True, text=True, timeout=300)
            if done.returncode < 0:
                outcomes[f"{kind}: died ({signal.Signals(-done.returncode).name})"] += 1
                remove_orphan_slabs(config.host.shm_dir)
            elif done.returncode:
                outcomes[f"{kind}: error"] += 1
                errors.append(done.stderr.strip().splitlines()[-1][:200])
            else:
                got = json.loads(done.stdout.strip().splitlines()[-1])
                wrong += got["wrong"]
                aside = any(p.startswith("disk.corrupt-") for p in os.listdir(config.data_dir))
                outcomes[f"{kind}: {'moved aside' if aside else 'served'}"] += 1
        finally:
            cleanup(base)
    died = sum(n for k, n in outcomes.items() if "died" in k)
    problems = errors + ([f"{wrong} wrong blocks served"] if wrong else []) + (
        [f"{died} of {2 * args.cycles} processes died (bug 1)"] if died else [])
    rows.append(row("Corruption: LMDB files", f"{2 * args.cycles} stores: random bit flips anywhere, truncation, "
                    "free-list page; opened as the daemon does, all read, Verify, one write",
                    "no wrong byte served; no process died",
                    "; ".join(f"{k} {n}" for k, n in sorted(outcomes.items())) + f"; wrong bytes served {wrong}",
                    problems))
    rows.append(slab_flips(args))
    return rows


def slab_flips(args: argparse.Namespace) -> dict:
    from tiercache.client import Client

    base, rng, problems = short_dir(), random.Random(args.seed), []
    flips = detected = 0
    try:
        with running_server(small_config(base, host_pages=512)) as (store, address), Client(address) as client:
            chains = [chain(tokens(70_000 + i, 6)) for i in range(20)]
            for blocks in chains:
                client.put(blocks)
            for _ in range(10 * args.cycles):
                keys = [b.meta.key for b in rng.choice(chains)]
                client.fetch(keys)  # back into host
                path, header, page_bytes, pages = slab_pages(address, keys)
                i = rng.randrange(len(pages))
                flip(path, header + pages[i][0] * page_bytes + rng.randrange(4096), 1 << rng.randrange(8))
                flips += 1
                got = client.fetch(keys, shared_memory=rng.random() < 0.5)
                if len(got) != len(keys) or not intact(got):
                    problems.append(f"{len(got)} of {len(keys)} blocks, intact={intact(got)}")
            detected = client.stats().verification_failures
            if client.verify().num_failed or detected != flips:
                problems.append(f"flips {flips}, detected {detected}")
    finally:
        cleanup(base)
    return row("Corruption: shared memory", f"{flips} bit flips written into live slab pages of a running daemon, "
               "each followed by a Fetch (shared memory or bytes)", "every damaged copy caught on read, dropped, "
               "counted; the intact disk copy served instead", f"flips {flips}; detected {detected}; "
               "wrong bytes served 0", problems)


def diskfull(args: argparse.Namespace) -> list[dict]:
    from test_reliability_diskfull import run_disk_full

    trials, resumed, problems, puts, worst = max(1, args.cycles // 2), [], [], 0, 0.0
    for _ in range(trials):
        base = short_dir()
        try:
            r = run_disk_full(base, os.path.join(base, "mnt"), resume_wait_s=20.0)
            problems += r.problems
            puts, worst = puts + r.puts, max(worst, r.slowest_put_s)
            resumed.append(r.resumed_after_s)
        finally:
            cleanup(base)
    ok = [s for s in resumed if s >= 0]
    return [row("Disk full", f"data dir on an 8 MiB tmpfs under a 64 MiB disk tier, filled through the daemon, "
                f"then Flush of the disk tier; {trials} runs", "Puts never failed or hung (host fallback); "
                "reads intact; integrity clean" + ("" if len(ok) == trials else "; writes resumed only in "
                f"{len(ok)} of {trials} runs (bug 4)"), f"Puts {puts}, slowest {worst * 1e3:.0f} ms; resumed "
                f"after flush in {len(ok)}/{trials} runs ({', '.join(f'{s:.1f} s' for s in ok) or '-'})", problems)]


def memory(args: argparse.Namespace) -> list[dict]:
    from test_reliability_memory import run_memory

    base = short_dir()
    try:
        r = run_memory(base, seconds=args.seconds)
    finally:
        cleanup(base)
    return [row("Memory bound", f"{args.seconds:.0f} s soak, 2 processes of Put/Fetch/Lookup/Prefetch on 32 KiB "
                "blocks, 8 MiB host pool, disk tier full (evicting)", "heap within idle + 96 MiB; shared memory = pool + index",
                f"heap idle {r.idle_anon / MiB:.0f} MiB, peak {r.peak_anon / MiB:.0f} MiB; slab "
                f"{r.peak_shmem / MiB:.0f} MiB; heap slope {r.anon_slope / 1024:.1f} KiB/s, RSS slope "
                f"{r.total_slope / 1024:.1f} KiB/s; ops {r.ops}; blocks indexed {r.blocks_indexed}", r.problems)]


def fuzz(args: argparse.Namespace) -> list[dict]:
    from test_reliability_fuzz import run_fuzz

    base = short_dir()
    try:
        r = run_fuzz(base, examples=max(400, int(args.seconds * 60)), derandomize=False)
    finally:
        cleanup(base)
    codes = ", ".join(f"{k} {v}" for k, v in r.codes.most_common())
    return [row("Hostile input", f"hypothesis: structured, mutated and random messages to all {NUM_RPCS} rpcs over the "
                "Unix socket and TCP (good and bad tokens), zstd bombs, size lies", "no crash, no INTERNAL, none "
                "past its deadline, refused calls changed nothing, Verify clean after",
                f"inputs {r.inputs}; {codes}; slowest {r.slowest_s * 1e3:.0f} ms", r.problems)]


def isolation(args: argparse.Namespace) -> list[dict]:
    import test_reliability_isolation as t

    problems, checks = [], 0
    for name in dir(t):
        if name.startswith("test_"):
            base = short_dir()
            try:
                getattr(t, name)(base)
                checks += 1
            except Exception as e:  # noqa: BLE001 - reported in the table
                problems.append(f"{name}: {e}")
            finally:
                cleanup(base)
    return [row("Isolation", f"TCP with tokens: 9 malformed/wrong tokens x {NUM_RPCS} rpcs; a second tenant on every path "
                "(export, Verify, import, flush-by-tenant, Stats, List); salted users; after a restart",
                "nothing seen or changed across tenants or salts; misses across, hits within",
                f"scenarios passed {checks}", problems)]


def load(args: argparse.Namespace) -> list[dict]:
    from test_reliability_load import run_load

    base = short_dir()
    try:
        r = run_load(base, workers=8, seconds=args.seconds, seed=args.seed)
    finally:
        cleanup(base)
    return [row("Load", f"8 processes x {args.seconds:.0f} s, every rpc, 512 KiB host tier", "zero errors but "
                "backpressure; every fetched byte right; Verify and idle integrity checks clean",
                f"ops {r.ops} ({r.ops_per_s:.0f}/s); backpressure {r.backpressure}; errors {sum(r.errors.values())}; "
                f"p99 {r.p99_all_ms:.0f} ms (Put {r.p99_ms.get('put', 0):.0f}, Fetch shm "
                f"{r.p99_ms.get('fetch_shm', 0):.0f}, bytes {r.p99_ms.get('fetch_bytes', 0):.0f}); host evictions "
                f"{r.host_evictions}", r.problems)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="load and soak duration (fuzz: x60 inputs)")
    parser.add_argument("--cycles", type=int, default=4, help="crash kills; other scenarios scale from it")
    parser.add_argument("--only", default=",".join(SCENARIOS), help=f"comma-separated subset of {SCENARIOS}")
    parser.add_argument("--seed", type=int, default=int(time.time()) % 10_000)
    args = parser.parse_args()
    logging.basicConfig(level=logging.CRITICAL)  # the daemons under test log plenty; the table is the output
    started, rows = time.monotonic(), []
    for name in args.only.split(","):
        t0 = time.monotonic()
        rows += globals()[name](args)
        print(f"# {name}: {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    print(f"\n`python3 scripts/torture.py --seconds {args.seconds:g} --cycles {args.cycles} --seed {args.seed}` "
          f"({time.monotonic() - started:.0f} s, {os.cpu_count()} cores)\n")
    print("| scenario | how it was run | what held | figures |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['scenario']} | {r['how']} | {r['held']} | {r['figures']} |")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
