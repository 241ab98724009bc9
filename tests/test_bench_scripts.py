"""The benchmark scripts run end to end at tiny sizes and print their tables."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

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


SERVICE_ROWS = ("memcpy (block by block)", "Fetch, shared memory", "raw gRPC stream, same bytes", "Fetch, byte stream",
                "  raw stream, messages kept", "  + records made afresh and summed at the server",
                "  the daemon's Fetch, messages kept, not parsed", "  + the client's parse and checksums (Fetch)",
                "Lookup rpc, 128-block chain", "raw gRPC unary call (baseline)", "Fetch aggregate, 4 client processes")


def test_bench_service_runs() -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_service.py"), "--block-mib", "0.0625", "--blocks", "8",
         "--seconds", "0.2", "--rounds", "1"],
        cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    for label in SERVICE_ROWS:
        row = next((line for line in lines if line.startswith(label)), None)
        assert row is not None, f"no table row {label!r} in:\n{proc.stdout}"
        assert float(row[len(label):].split()[1 if "p50" in row else 0]) > 0, row


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
