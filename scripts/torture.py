"""Long reliability runs (issue 7): every scenario of benchmarks/scenarios/ for as long as asked,
printed as a table of what was tried, what held, and the figures.

    python3 scripts/torture.py                      # all scenarios, about 5 minutes on 2 cores
    python3 scripts/torture.py --seconds 600 --cycles 50 --only crash,memory

Progress goes to stdout as it happens, one `# ` line per crash cycle, restart, run, check or minute of
soak, each with the figures so far, and each scenario's row once it ends: a killed run leaves them.
"""

from __future__ import annotations

import argparse
import importlib
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

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from benchmarks.daemons import PAGE, chain, cleanup, running_server, short_dir, small_config, tokens  # noqa: E402
from benchmarks.record import machine  # noqa: E402
from benchmarks.reliability import daemon_config, flip, intact, slab_pages  # noqa: E402
from tiercache.samehost.slab import remove_orphan_slabs  # noqa: E402
from tiercache.v1 import tiercache_pb2 as pb  # noqa: E402

NUM_RPCS = len(pb.DESCRIPTOR.services_by_name["TierCache"].methods)

logger = logging.getLogger("torture")
MiB = 1 << 20
SCENARIOS = ("crash", "lifecycle", "corruption", "diskfull", "memory", "fuzz", "isolation", "load")

# Child for random LMDB damage: opens the store as the daemon does, reads and verifies everything, writes once.
DAMAGE_CHILD = """
import json, sys
sys.path.insert(0, sys.argv[2])
from benchmarks.daemons import chain, tokens, payload_for
from benchmarks.reliability import daemon_config
from tiercache.store import TieredStore
from tiercache.tenancy import scope_key
config, _ = daemon_config(sys.argv[1])
store = TieredStore.open(config)
served = wrong = 0
for i in range(int(sys.argv[3])):
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


def say(line: str) -> None:
    """One progress line, flushed at once (a long run shows where it is; a killed one leaves it)."""
    print(f"# {line}", flush=True)


def times(n: int) -> str:
    return "once" if n == 1 else f"{n} times"


def row(scenario: str, how: str, held: str, figures: str, problems: list[str]) -> dict:
    if problems:
        held = "FAILED: " + "; ".join(problems[:3])
    return {"scenario": scenario, "how": how, "held": held, "figures": figures, "ok": not problems}


def crash(args: argparse.Namespace) -> list[dict]:
    from benchmarks.scenarios.crash import run_crash

    workers, base = 3, short_dir()
    try:
        # About 3500 blocks of 4 KiB a cycle: a disk tier that never evicts them (a sparse LMDB map).
        r = run_crash(base, cycles=args.cycles, workers=workers, seed=args.seed, max_gap_s=1.0,
                      disk_bytes=max(1 << 30, args.cycles * (40 << 20)), progress=say)
    finally:
        cleanup(base)
    return [row("Crash", f"SIGKILL of the daemon at a random moment, {times(r.cycles)}, under Put/Fetch/Lookup "
                f"from {workers} processes; committed set read from LMDB while down",
                "after each restart, every block committed at the previous kill still committed, and 2048 "
                "blocks committed since it and 1024 older ones bit-identical and verified, then the oldest past "
                "16,384 evicted by the checker; after the last, every committed block and a Verify of the store; "
                "every worker's retries got through",
                f"kills {r.cycles}; committed blocks re-read {r.committed_checked}; "
                f"evicted by the checker {r.evicted}; "
                f"bytes lost {r.bytes_lost}; Puts returned but not yet on disk at a kill {r.lost_in_flight} "
                f"of {r.puts_returned} (the oldest {r.max_lost_age_s * 1e3:.0f} ms before it); Puts retried after "
                f"an outage {r.retried_ok}; worker ops {r.worker_ops}; slowest worker through "
                f"{r.max_recovery_s:.1f} s after the restart", r.problems)]


def lifecycle(args: argparse.Namespace) -> list[dict]:
    from benchmarks.scenarios.lifecycle import EXIT_ALREADY_RUNNING, run_lifecycle

    workers, base, other = 3, short_dir(), short_dir()
    try:
        r = run_lifecycle(base, restarts=max(1, args.cycles // 2), workers=workers, seed=args.seed, load_s=2.0,
                          race_base=other, progress=say)
    finally:
        cleanup(base)
        cleanup(other)
    problems = r.problems + ([] if r.race_winners == [1] else [f"race winners {r.race_winners}"])
    # Each second daemon is either counted as refused or reported as a problem naming it.
    attempts = r.refused + sum(p.startswith("second daemon") for p in r.problems)
    return [row("Lifecycle", f"SIGTERM under load from {workers} processes, restart, {times(r.restarts)}; second "
                "daemon on the same socket / data dir / both; two started at once",
                f"exit 0 after draining; every returned Put on disk and read back; second daemons refused "
                f"(exit {EXIT_ALREADY_RUNNING}); exactly one of two simultaneous daemons serves",
                f"restarts {r.restarts}; returned blocks checked {r.puts_returned}; bytes lost {r.bytes_lost}; "
                f"drain ≤ {r.drain_s:.1f} s; second daemons refused {r.refused} of {attempts}; daemons serving "
                f"after a simultaneous start {', '.join(map(str, r.race_winners)) or 'not run'}", problems)]


def corruption(args: argparse.Namespace) -> list[dict]:
    from benchmarks.scenarios.corruption import damage, populate, run_lmdb_damage

    rows, problems = [], []
    blocks = damaged = caught = served = wrong = 0
    for trial in range(args.cycles):
        base = short_dir()
        try:
            r = run_lmdb_damage(base, seed=args.seed + trial)
            blocks, damaged, caught = blocks + r.blocks, damaged + r.damaged, caught + r.counted
            served += r.served_intact
            # run_lmdb_damage names every fetch that returned a damaged byte among its problems.
            wrong += sum("damaged bytes served" in p for p in r.problems)
            problems += r.problems
        finally:
            cleanup(base)
        say(f"corruption: LMDB bytes run {trial + 1} of {args.cycles}: blocks damaged {damaged} of {blocks}; "
            f"detected and counted {caught}; fetches that served a damaged byte {wrong}")
    rows.append(row("Corruption: LMDB bytes", f"{args.cycles} run{'s' if args.cycles != 1 else ''}: bytes flipped "
                    "in one block of most chains (payload or meta record), daemon restarted, half read, Verify",
                    "damaged blocks never served, dropped, counted; all others served; daemon keeps serving",
                    f"blocks damaged {damaged} of {blocks}; detected and counted {caught}; blocks served intact "
                    f"{served}; fetches that served a damaged byte {wrong}", problems))
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
            done = subprocess.run([sys.executable, "-c", DAMAGE_CHILD, base, str(REPO), "6"],
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
        say(f"corruption: LMDB files store {trial + 1} of {2 * args.cycles} ({kind}): "
            + "; ".join(f"{k} {n}" for k, n in sorted(outcomes.items())) + f"; wrong blocks served {wrong}")
    stores = sum(outcomes.values())
    died = sum(n for k, n in outcomes.items() if "died" in k)
    problems = errors + ([f"{wrong} wrong blocks served"] if wrong else []) + (
        [f"{died} of {stores} processes died (bug 1)"] if died else [])
    rows.append(row("Corruption: LMDB files", f"{stores} stores: random bit flips anywhere, truncation, "
                    "free-list page; opened as the daemon does, all read, Verify, one write",
                    "no wrong byte served; no process died",
                    "; ".join(f"{k} {n}" for k, n in sorted(outcomes.items())) + f"; wrong blocks served {wrong}",
                    problems))
    rows.append(slab_flips(args))
    return rows


def slab_flips(args: argparse.Namespace) -> dict:
    from tiercache.client import Client

    base, rng, problems = short_dir(), random.Random(args.seed), []
    flips = detected = wrong = short = 0
    fetches: Counter = Counter()
    try:
        with running_server(small_config(base, host_pages=512)) as (store, address), Client(address) as client:
            chains = [chain(tokens(70_000 + i, 6)) for i in range(20)]
            for blocks in chains:
                client.put(blocks, durable=True)  # the intact disk copy exists before any flip
            for _ in range(10 * args.cycles):
                keys = [b.meta.key for b in rng.choice(chains)]
                client.fetch(keys)  # back into host
                path, header, page_bytes, pages = slab_pages(address, keys)
                i = rng.randrange(len(pages))
                flip(path, header + pages[i][0] * page_bytes + rng.randrange(4096), 1 << rng.randrange(8))
                flips += 1
                shared_memory = rng.random() < 0.5
                fetches["shared memory" if shared_memory else "bytes"] += 1
                got = client.fetch(keys, shared_memory=shared_memory)
                wrong += not intact(got)
                short += len(got) != len(keys)
                if len(got) != len(keys) or not intact(got):
                    problems.append(f"{len(got)} of {len(keys)} blocks, intact={intact(got)}")
                if flips % 10 == 0:
                    say(f"corruption: shared memory flips {flips} of {10 * args.cycles}: fetches with a wrong "
                        f"byte {wrong}; fetches short of a block {short}")
            detected = client.stats().verification_failures
            if client.verify().num_failed or detected != flips:
                problems.append(f"flips {flips}, detected {detected}")
    finally:
        cleanup(base)
    return row("Corruption: shared memory", f"{flips} bit flips written into live slab pages of a running daemon, "
               "each followed by a Fetch (shared memory or bytes)", "every damaged copy caught on read, dropped, "
               "counted; the intact disk copy served instead", f"flips {flips}; detected {detected}; fetches "
               + ", ".join(f"{k} {n}" for k, n in sorted(fetches.items())) + f"; fetches with a wrong byte {wrong}; "
               f"fetches short of a block {short}", problems)


def diskfull(args: argparse.Namespace) -> list[dict]:
    from benchmarks.scenarios.diskfull import run_disk_full

    trials, resumed, problems, puts, worst = max(1, args.cycles // 2), [], [], 0, 0.0
    refused: Counter = Counter()
    failed_writes = intact_reads = 0
    for trial in range(trials):
        base = short_dir()
        try:
            r = run_disk_full(base, os.path.join(base, "mnt"), resume_wait_s=20.0)
            problems += r.problems
            puts, worst = puts + r.puts, max(worst, r.slowest_put_s)
            refused.update(r.refused)
            failed_writes, intact_reads = failed_writes + r.write_failures, intact_reads + r.reads_intact
            resumed.append(r.resumed_after_s)
        finally:
            cleanup(base)
        say(f"diskfull: run {trial + 1} of {trials}: Puts {r.puts}, refused {sum(r.refused.values())}; disk writes "
            f"that failed {r.write_failures}; " + (f"resumed {r.resumed_after_s:.2f} s after the flush"
                                                    if r.resumed_after_s >= 0 else "did NOT resume after the flush")
            + f"; resumed so far in {sum(s >= 0 for s in resumed)} of {trial + 1} runs; problems {len(r.problems)}")
    ok = [s for s in resumed if s >= 0]
    return [row("Disk full", "data dir on a tmpfs smaller than the disk tier, filled through the daemon, then "
                f"Flush of the disk tier; {trials} run{'s' if trials != 1 else ''}",
                "Puts never failed or hung (host fallback); reads intact; integrity clean"
                + ("" if len(ok) == trials else f"; writes resumed only in {len(ok)} of {trials} runs (bug 4)"),
                f"Puts {puts}, refused {sum(refused.values())}, slowest "
                f"{worst * 1e3:.0f} ms; disk writes that failed (kept in host) {failed_writes}; chains read back "
                f"intact while full {intact_reads}; resumed after flush in {len(ok)} of {trials} runs "
                f"({', '.join(f'{s:.2f} s' for s in ok) or '-'})", problems)]


def memory(args: argparse.Namespace) -> list[dict]:
    from benchmarks.scenarios.memory import run_memory

    workers, overhead, base = 2, 96 * MiB, short_dir()
    try:
        r = run_memory(base, seconds=args.seconds, workers=workers, fixed_overhead=overhead, progress=say)
    finally:
        cleanup(base)
    return [row("Memory bound", f"{r.seconds:.0f} s soak, {workers} processes of Put/Fetch/Lookup/Prefetch, "
                f"{r.host_pool_bytes / MiB:.0f} MiB host pool, disk tier full (evicting)",
                f"heap within idle + {overhead / MiB:.0f} MiB; shared memory = pool + index",
                f"heap idle {r.idle_anon / MiB:.0f} MiB, peak {r.peak_anon / MiB:.0f} MiB; slab "
                f"{r.peak_shmem / MiB:.0f} MiB; heap slope {r.anon_slope / 1024:.1f} KiB/s, RSS slope "
                f"{r.total_slope / 1024:.1f} KiB/s; ops {r.ops}; blocks indexed {r.blocks_indexed}; memory samples "
                f"{len(r.samples)}", r.problems)]


def fuzz(args: argparse.Namespace) -> list[dict]:
    from benchmarks.scenarios.fuzz import run_fuzz

    base = short_dir()
    try:
        r = run_fuzz(base, examples=max(400, int(args.seconds * 60)), derandomize=False)
    finally:
        cleanup(base)
    codes = ", ".join(f"{k} {v}" for k, v in r.codes.most_common())
    return [row("Hostile input", f"hypothesis: structured, mutated and random messages to all {NUM_RPCS} rpcs over the "
                "Unix socket and TCP (good and bad tokens), zstd bombs, size lies", "no crash, no INTERNAL, none "
                "past its deadline, refused calls changed nothing, Verify clean after",
                f"inputs {r.inputs}; {codes or 'no status codes'}; slowest {r.slowest_s * 1e3:.0f} ms", r.problems)]


def isolation(args: argparse.Namespace) -> list[dict]:
    t = importlib.import_module("benchmarks.scenarios.isolation")

    problems, checks = [], 0
    names = [name for name in dir(t) if name.startswith("check_")]
    for name in names:
        base = short_dir()
        try:
            getattr(t, name)(base)
            checks += 1
        except Exception as e:  # noqa: BLE001 - reported in the table
            problems.append(f"{name}: {e}")
        finally:
            cleanup(base)
        say(f"isolation: {name} ({checks} of {len(names)} passed so far)")
    return [row("Isolation", f"TCP with tokens: missing, malformed and wrong tokens on all {NUM_RPCS} rpcs; a second "
                "tenant on every path (export, Verify, import, flush-by-tenant, Stats, List); salted users; after "
                "a restart", "nothing seen or changed across tenants or salts; misses across, hits within",
                f"scenarios passed {checks} of {len(names)}", problems)]


def load(args: argparse.Namespace) -> list[dict]:
    from benchmarks.scenarios.load import run_load

    workers, host_pages, base = 8, 128, short_dir()
    try:
        r = run_load(base, workers=workers, seconds=args.seconds, host_pages=host_pages, seed=args.seed)
    finally:
        cleanup(base)

    def p99(op: str) -> str:
        return f"{r.p99_ms[op]:.0f}" if op in r.p99_ms else "none timed"

    return [row("Load", f"{r.workers} processes x {r.seconds:.0f} s, every rpc, {host_pages * PAGE // 1024} KiB host "
                "tier", "zero errors but backpressure; every fetched byte right; Verify and idle integrity checks "
                "clean", f"ops {r.ops} ({r.ops_per_s:.0f}/s); backpressure {r.backpressure}; errors "
                f"{sum(r.errors.values())}; chains with a wrong byte {r.bad_blocks}; p99 {r.p99_all_ms:.0f} ms "
                f"(Put {p99('put')}, Fetch shm {p99('fetch_shm')}, bytes {p99('fetch_bytes')}); host evictions "
                f"{r.host_evictions}", r.problems)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="load and soak duration (fuzz: x60 inputs)")
    parser.add_argument("--cycles", type=int, default=4, help="crash kills; other scenarios scale from it")
    parser.add_argument("--only", default=",".join(SCENARIOS), help=f"comma-separated subset of {SCENARIOS}")
    parser.add_argument("--seed", type=int, default=int(time.time()) % 10_000)
    parser.add_argument("--markdown", metavar="PATH",
                        help="also write the table as a page (docs/benchmarks/torture.md)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.CRITICAL)  # the daemons under test log plenty; the table is the output
    started, rows = time.monotonic(), []
    for name in args.only.split(","):
        t0 = time.monotonic()
        say(f"{name}: started")
        done = globals()[name](args)
        rows += done
        for r in done:
            say(f"{name}: done in {time.monotonic() - t0:.0f} s: {r['scenario']}: {r['held']}; {r['figures']}")
    only = "" if args.only == ",".join(SCENARIOS) else f" --only {args.only}"
    table = [f"\n`python3 scripts/torture.py{only} --seconds {args.seconds:g} --cycles {args.cycles} "
             f"--seed {args.seed}` ({time.monotonic() - started:.0f} s, {os.cpu_count()} cores)\n",
             "| scenario | how it was run | what held | figures |\n|---|---|---|---|",
             *(f"| {r['scenario']} | {r['how']} | {r['held']} | {r['figures']} |" for r in rows)]
    print("\n".join(table))
    if args.markdown:
        Path(args.markdown).write_text(f"# Reliability scenarios\n\n- machine: {machine()}\n" + "\n".join(table) + "\n")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
