"""The benchmark scripts run end to end at tiny sizes and print their tables."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import types
from collections import Counter

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent

ROWS = ("memcpy baseline", "raw LMDB loop", "host (HostTier)", "gpu (GpuTier", "disk (DiskTier, uncompressed)",
        "disk (DiskTier, zstd", "store (TieredStore via host)")
TARGETS = ("host get >= 0.60x memcpy", "disk get >= 0.50x memcpy", "disk put >= 0.80x raw LMDB")


def test_bench_store_runs(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_store.py"), "--blocks", "8", "--repeat", "1",
         "--dir", str(tmp_path), "--shm-dir", str(tmp_path), "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    for label in ROWS:
        row = [line for line in lines if line.startswith(label)]
        assert len(row) == 1, f"no table row {label!r} in:\n{proc.stdout}"
        put_gib_s, get_gib_s = (float(x) for x in row[0][40:].split()[:2])
        assert put_gib_s > 0 and get_gib_s > 0, row[0]
    for target in TARGETS:
        line = next((line for line in lines if target in line), None)
        assert line is not None, f"no target line {target!r} in:\n{proc.stdout}"
        assert line.rstrip().endswith(("PASS", "MISS")), line
    result = json.loads(out.read_text())
    assert result["blocks"] == 8 and result["block_bytes"] == 1_179_648
    assert {t["target"] for t in result["targets"]} == set(TARGETS)
    rows = {r["row"]: r for r in result["rows"]}
    assert all(r["put_gib_s"] > 0 and r["get_gib_s"] > 0 for r in rows.values())
    assert all(len(rows[name]["get_s"]) == 1 for name in ("host", "gpu", "disk", "lmdb", "store")), "one timed pass"
    assert list(tmp_path.iterdir()) == [out], "the benchmark left files behind"


SERVICE_THROUGHPUT = {"memcpy (block by block)": None, "Fetch, shared memory": ("memcpy", 0.6),
                      "fetch_views + the caller's copy": ("memcpy", None), "raw gRPC stream, same bytes": None,
                      "Fetch, byte stream": ("raw", 0.8), "raw stream, messages kept": ("raw", None),
                      "+ records made afresh and summed at the server": ("raw", None),
                      "the daemon's Fetch, messages kept, not parsed": ("raw", None),
                      "+ the client's parse and checksums (Fetch)": ("raw", None)}
SERVICE_LATENCY = ("Lookup rpc, 128-block chain", "Client.lookup (shared index, no call)",
                   "raw gRPC unary call (baseline)")
SERVICE_AGGREGATE = tuple(f"Fetch aggregate, {n} client process{'es' if n > 1 else ''}" for n in (1, 2, 4))


def test_bench_service_reports_the_median_call_and_judges_on_it(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "service.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_service.py"), "--block-mib", "0.0625", "--blocks", "8",
         "--seconds", "0.2", "--rounds", "2", "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    lines = proc.stdout.splitlines()
    figures = {f["path"]: f for f in data["figures"]}
    assert list(figures) == [*SERVICE_THROUGHPUT, *SERVICE_LATENCY, *SERVICE_AGGREGATE]
    base = {"memcpy": "memcpy (block by block)", "raw": "raw gRPC stream, same bytes"}
    expected_targets = []
    for path, judged in SERVICE_THROUGHPUT.items():
        f = figures[path]
        calls = [x for each in f["call_gb_s_by_round"] for x in each]
        assert len(f["call_gb_s_by_round"]) == 2 and all(f["call_gb_s_by_round"]) and min(calls) > 0, path
        # The headline is the median call, the best call only beside it.
        assert f["calls"] == len(calls) and f["median_gb_s"] == pytest.approx(statistics.median(calls), rel=1e-12), path
        assert f["best_gb_s"] == max(calls), path
        line = next(line for line in lines if line.strip().startswith(path))
        assert line[line.index(path) + len(path):].split()[:3] == [f"{f['median_gb_s']:.2f}", f"{f['best_gb_s']:.2f}",
                                                                    str(len(calls))], line
        if judged is None:
            assert "ratio" not in f, path
            continue
        baseline, target = judged
        theirs = [x for each in figures[base[baseline]]["call_gb_s_by_round"] for x in each]
        assert f["ratio"] == pytest.approx(statistics.median(calls) / statistics.median(theirs), rel=1e-12), path
        if target is not None:
            status = "MET" if f["ratio"] >= target else "MISSED"
            assert f["status"] == status, f
            expected_targets.append(status)
            assert f">= {target}: {status}" in line, line
    for name in SERVICE_LATENCY:
        f = figures[name]
        assert f["calls"] == 1000 and 0 < f["median_ms"] <= f["p99_ms"], f
    lookup = figures[SERVICE_LATENCY[0]]
    expected_targets.append("MET" if lookup["median_ms"] < 1 else "MISSED")
    assert [t["status"] for t in data["targets"]] == expected_targets
    for t in data["targets"]:
        assert f"{t['status']}  {t['text']}: {t['measured']}" in lines
    for n, name in zip((1, 2, 4), SERVICE_AGGREGATE):
        assert figures[name]["aggregate_gb_s"] > 0 and figures[name]["calls"] >= n, figures[name]
    assert len(data["put"]) == 2
    for value in data["put"].values():
        wall, cpu = (float(x) for x in re.fullmatch(r"median ([\d.]+) ms, daemon CPU ([\d.]+) ms per call "
                                                    r"\(200 calls\)", value).groups())
        assert wall > 0 and cpu > 0, value


def test_bench_decode_runs() -> None:
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_decode.py"), "--lengths", "64,128",
                           "--new-tokens", "4", "--repeat", "1"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines() if line.strip().startswith(("64 ", "128 "))]
    assert [row[0] for row in rows] == ["64", "128"], proc.stdout
    assert all(float(row[1]) > 0 and float(row[2]) > 0 and row[3].endswith("x") for row in rows), proc.stdout


def test_bench_cache_build_runs() -> None:
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_cache_build.py"), "--tokens", "64",
                           "--repeat", "1"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = [line.split(")")[-1].split() for line in proc.stdout.splitlines() if line.rstrip().endswith("x")]
    assert len(rows) == 3, proc.stdout
    assert all(len(row) == 6 and all(float(x.rstrip("x")) > 0 for x in row) for row in rows), proc.stdout


# ---- scripts/torture.py: every figure of its table comes from what the run reported ------------------

TORTURE_ARGS = argparse.Namespace(seconds=7.0, cycles=4, seed=5)


@pytest.fixture
def torture(monkeypatch):
    spec = importlib.util.spec_from_file_location("torture_under_test", REPO / "scripts" / "torture.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fake(monkeypatch, name: str, **attrs) -> None:
    """Stand in for a benchmarks/scenarios/ module that torture.py imports a run_* function from."""
    monkeypatch.setitem(sys.modules, name, types.SimpleNamespace(**attrs))


def test_torture_crash_and_lifecycle_figures_are_the_runs_own(torture, monkeypatch) -> None:
    from benchmarks.scenarios.crash import CrashReport
    from benchmarks.scenarios.lifecycle import EXIT_ALREADY_RUNNING, LifecycleReport

    seen = {}
    crash = CrashReport(cycles=3, puts_returned=41, committed_checked=29, lost_in_flight=2, max_lost_age_s=0.007,
                        max_recovery_s=0.4, bytes_lost=4096, retried_ok=5, worker_ops=77, evicted=12,
                        problems=["cycle 2: committed block 0a altered"])
    fake(monkeypatch, "benchmarks.scenarios.crash", run_crash=lambda base, **kw: seen.update(kw) or crash)
    [r] = torture.crash(TORTURE_ARGS)
    assert r["figures"] == ("kills 3; committed blocks re-read 29; evicted by the checker 12; bytes lost 4096; "
                            "Puts returned but not yet on "
                            "disk at a kill 2 of 41 (the oldest 7 ms before it); Puts retried after an outage 5; "
                            "worker ops 77; slowest worker through 0.4 s after the restart")
    assert f"3 times, under Put/Fetch/Lookup from {seen['workers']} processes" in r["how"]
    assert seen["cycles"] == 4 and r["held"] == "FAILED: cycle 2: committed block 0a altered" and not r["ok"]

    refused_one = "second daemon ({'socket': 'x'}) rc=0 after 0.1 s: "
    reports = [LifecycleReport(restarts=2, drain_s=1.26, puts_returned=300, bytes_lost=12, refused=2,
                               race_winners=[2], problems=[refused_one]),
               LifecycleReport(restarts=2, drain_s=0.5, puts_returned=30, refused=3, race_winners=[1])]
    fake(monkeypatch, "benchmarks.scenarios.lifecycle", EXIT_ALREADY_RUNNING=EXIT_ALREADY_RUNNING,
         run_lifecycle=lambda base, **kw: seen.update(kw) or reports.pop(0))
    [bad] = torture.lifecycle(TORTURE_ARGS)
    assert bad["figures"] == ("restarts 2; returned blocks checked 300; bytes lost 12; drain ≤ 1.3 s; second daemons "
                              "refused 2 of 3; daemons serving after a simultaneous start 2")
    assert bad["held"] == f"FAILED: {refused_one}; race winners [2]"
    [good] = torture.lifecycle(TORTURE_ARGS)
    assert good["ok"] and f"refused (exit {EXIT_ALREADY_RUNNING})" in good["held"]
    assert good["figures"].endswith("second daemons refused 3 of 3; daemons serving after a simultaneous start 1")
    assert good["how"].startswith(f"SIGTERM under load from {seen['workers']} processes, restart, 2 times")


def test_torture_corruption_figures_are_the_runs_own(torture, monkeypatch) -> None:
    from benchmarks.scenarios.corruption import LmdbDamageReport

    def populate(config, num_chains, blocks_per_chain):
        os.makedirs(os.path.join(config.data_dir, "disk"))
        pathlib.Path(config.data_dir, "disk", "data.mdb").write_bytes(bytes(4096))

    fake(monkeypatch, "benchmarks.scenarios.corruption", populate=populate, damage=lambda kind, path: None,
         run_lmdb_damage=lambda base, seed: LmdbDamageReport(
             blocks=32, damaged=7, counted=6, served_intact=50,
             problems=["chain 1: damaged bytes served", "disk verification_failures=6, damaged=7"]))
    child = subprocess.CompletedProcess([], 0, stdout='{"served": 5, "wrong": 1, "verify_failed": 0}\n', stderr="")
    monkeypatch.setattr(torture.subprocess, "run", lambda *a, **kw: child)
    monkeypatch.setattr(torture, "slab_flips", lambda args: {"scenario": "slab"})
    lmdb_bytes, files, slab = torture.corruption(TORTURE_ARGS)
    assert lmdb_bytes["figures"] == ("blocks damaged 28 of 128; detected and counted 24; blocks served intact 200; "
                                     "fetches that served a damaged byte 4")
    assert lmdb_bytes["how"].startswith("4 runs:") and lmdb_bytes["held"].startswith("FAILED: chain 1: damaged")
    assert files["figures"] == "flips: served 3; free list: served 2; truncated: served 3; wrong blocks served 8"
    assert files["how"].startswith("8 stores:") and files["held"] == "FAILED: 8 wrong blocks served"
    assert slab == {"scenario": "slab"}


def test_torture_slab_flips_counts_the_wrong_bytes_it_was_served(torture, monkeypatch) -> None:
    monkeypatch.setattr(torture, "intact", lambda blocks: False)  # as if every fetch had served a damaged byte
    r = torture.slab_flips(argparse.Namespace(seconds=1.0, cycles=1, seed=3))
    fetches = dict(re.findall(r"(bytes|shared memory) (\d+)", r["figures"]))
    assert sum(map(int, fetches.values())) == 10 and r["how"].startswith("10 bit flips")
    assert "fetches with a wrong byte 10; fetches short of a block 0" in r["figures"] and not r["ok"]


def test_torture_diskfull_memory_fuzz_isolation_and_load_figures_are_the_runs_own(torture, monkeypatch) -> None:
    from benchmarks.scenarios.diskfull import DiskFullReport
    from benchmarks.scenarios.fuzz import FuzzReport
    from benchmarks.scenarios.load import LoadReport
    from benchmarks.scenarios.memory import MemoryReport

    MiB, seen = 1 << 20, {}
    disk = [DiskFullReport(puts=11, refused=Counter({"Backpressure": 2}), slowest_put_s=0.25, write_failures=4,
                           reads_intact=6, resumed_after_s=resumed) for resumed in (-1.0, 0.3)]
    fake(monkeypatch, "benchmarks.scenarios.diskfull", run_disk_full=lambda *a, **kw: disk.pop(0))
    [r] = torture.diskfull(TORTURE_ARGS)
    assert r["figures"] == ("Puts 22, refused 4, slowest 250 ms; disk writes that failed (kept in host) 8; chains read "
                            "back intact while full 12; resumed after flush in 1 of 2 runs (0.30 s)")
    assert r["how"].endswith("; 2 runs") and r["held"].endswith("writes resumed only in 1 of 2 runs (bug 4)")

    memory = MemoryReport(seconds=7.0, ops=99, host_pool_bytes=3 * MiB, idle_anon=100 * MiB, peak_anon=120 * MiB,
                          peak_shmem=4 * MiB, anon_slope=2048, total_slope=4096, blocks_indexed=12, samples=[1, 2, 3])
    fake(monkeypatch, "benchmarks.scenarios.memory", run_memory=lambda base, **kw: seen.update(kw) or memory)
    [r] = torture.memory(TORTURE_ARGS)
    assert r["figures"] == ("heap idle 100 MiB, peak 120 MiB; slab 4 MiB; heap slope 2.0 KiB/s, RSS slope 4.0 KiB/s; "
                            "ops 99; blocks indexed 12; memory samples 3")
    assert r["how"].startswith(f"7 s soak, {seen['workers']} processes of Put/Fetch/Lookup/Prefetch, 3 MiB host pool")
    assert r["held"].startswith(f"heap within idle + {seen['fixed_overhead'] // MiB} MiB") and r["ok"]

    fuzz = FuzzReport(inputs=17, codes=Counter({"OK": 3, "INVALID_ARGUMENT": 14}), slowest_s=0.012)
    fake(monkeypatch, "benchmarks.scenarios.fuzz", run_fuzz=lambda base, **kw: fuzz)
    [r] = torture.fuzz(TORTURE_ARGS)
    assert r["figures"] == "inputs 17; INVALID_ARGUMENT 14, OK 3; slowest 12 ms"

    def fails(base):
        raise ValueError("boom")

    fake(monkeypatch, "benchmarks.scenarios.isolation", check_one=lambda base: None, check_two=fails)
    [r] = torture.isolation(TORTURE_ARGS)
    assert r["figures"] == "scenarios passed 1 of 2" and r["held"] == "FAILED: check_two: boom"

    load = LoadReport(workers=8, seconds=7.0, ops=140, ops_per_s=20.0, backpressure=3, errors=Counter({"X": 1}),
                      bad_blocks=2, p99_ms={"put": 5.0, "fetch_bytes": 9.4}, p99_all_ms=9.9, host_evictions=17)
    fake(monkeypatch, "benchmarks.scenarios.load", run_load=lambda base, **kw: seen.update(kw) or load)
    [r] = torture.load(TORTURE_ARGS)
    assert r["figures"] == ("ops 140 (20/s); backpressure 3; errors 1; chains with a wrong byte 2; p99 10 ms (Put 5, "
                            "Fetch shm none timed, bytes 9); host evictions 17")
    assert r["how"] == f"8 processes x 7 s, every rpc, {seen['host_pages'] * 4} KiB host tier"


def test_torture_prints_its_table_and_fails_on_a_failed_scenario(torture, monkeypatch, capsys) -> None:
    fake(monkeypatch, "benchmarks.scenarios.isolation", check_one=lambda base: None)
    monkeypatch.setattr(sys, "argv", ["torture.py", "--only", "isolation", "--seconds", "7", "--cycles", "3",
                                      "--seed", "5"])
    assert torture.main() == 0
    out = capsys.readouterr().out
    assert re.search(rf"`python3 scripts/torture.py --only isolation --seconds 7 --cycles 3 --seed 5` "
                     rf"\(\d+ s, {os.cpu_count()} cores\)", out)
    assert "| Isolation | " in out and out.rstrip().endswith("| scenarios passed 1 of 1 |")
    fake(monkeypatch, "benchmarks.scenarios.isolation", check_two=lambda base: 1 / 0)
    assert torture.main() == 1


@pytest.mark.slow
def test_torture_reports_each_crash_cycle_and_each_run_as_it_goes() -> None:
    """A long run shows where it is, and a killed one leaves its figures so far: a progress line per crash
    cycle and per disk-full run, each flushed as it happens (read here while the script still runs)."""
    # Disk full first (it mounts a tmpfs: root only): each line checked below has a crash cycle after it.
    only = "diskfull,crash" if os.geteuid() == 0 else "crash"
    proc = subprocess.Popen([sys.executable, str(REPO / "scripts" / "torture.py"), "--only", only, "--cycles", "2",
                             "--seconds", "1", "--seed", "3"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    lines, seen_while_running = [], []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if proc.poll() is None:
                seen_while_running.append(lines[-1])
    finally:
        if proc.poll() is None:
            proc.kill()
        rc = proc.wait()
    out = "\n".join(lines)
    assert rc == 0, out
    cycles = [line for line in lines if line.startswith("# crash: cycle ")]
    assert [c.split(":")[1] for c in cycles] == [" cycle 1 of 2", " cycle 2 of 2"], out
    assert all(re.search(r"committed blocks re-read \d+; bytes lost 0;", c) for c in cycles), out
    assert cycles[0] in seen_while_running, "the first cycle's line came only when the script ended"
    assert any(line.startswith("# crash: done in ") and "kills 2;" in line for line in lines), out
    if "diskfull" in only:
        [run] = [line for line in lines if line.startswith("# diskfull: run ")]
        assert re.match(r"# diskfull: run 1 of 1: Puts \d+, refused 0; disk writes that failed \d+; resumed "
                        r"[\d.]+ s after the flush; resumed so far in 1 of 1 runs; problems 0$", run), run
        assert run in seen_while_running
    assert out.rstrip().endswith("|") and "| Crash | " in out, "the table comes last"
