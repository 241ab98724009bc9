"""scripts/bench_api.py runs end to end at a tiny size and prints its figures and its verdict."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent


def test_bench_api_prints_ttft_per_arm_the_overhead_and_the_saving() -> None:
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_api.py"), "--requests", "5", "--workers", "1",
                           "--max-tokens", "2"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    for arm in ("http", "in-process", "http, cache off"):
        row = next(line for line in out.splitlines() if line.startswith(f"{arm} ") and "  " in line)
        p50 = float(row[len(arm):].split()[0])
        assert p50 > 0, row
    saved = re.search(r"prompt tokens: ([\d,]+); computed with the cache ([\d,]+) \(([\d.]+)% reused\)", out)
    assert saved and 0 < float(saved.group(3)) < 100, out
    assert re.search(r"HTTP overhead per request \(paired, http - in-process\): median [+-][\d.]+ ms", out), out
    assert re.search(r"target within 1.1x or 5 ms: (MET|MISSED)", out), out
    assert "5 requests in" in out and "none lost" in out, out
