"""The main job (scripts/demo.py) runs end to end at a small size (scripts/bench_ttft.py: test_bench_ttft_plot.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

from benchmarks.daemons import REPO


def run_script(*args: str, timeout_s: float) -> tuple[subprocess.CompletedProcess, float]:
    # sys.executable: the interpreter running the tests (system python3 here, .venv's under scripts/test.sh).
    start = time.monotonic()
    proc = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    return proc, time.monotonic() - start


def test_demo_reuses_the_shared_system_prompt(tmp_path) -> None:
    out = tmp_path / "summary.json"
    proc, wall = run_script("scripts/demo.py", "--requests", "6", "--workers", "2", "--baseline", "1",
                            "--json", str(out), timeout_s=180)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    reused = re.search(r"tokens reused: (\d+), computed: (\d+)", proc.stdout)
    assert reused and int(reused.group(1)) > 0, proc.stdout
    assert "the cache saved" in proc.stdout and "daemon exit code 0 after SIGTERM" in proc.stdout
    summary = json.loads(out.read_text())
    assert summary["tokens_reused"] == int(reused.group(1))
    assert summary["errors"] == 0 and summary["hit_rate_requests"] > 0
    # The baseline reran a request with the cache off: it computed every token; with the cache on, not.
    assert summary["baseline"][0]["cached_tokens"] > 0
    assert summary["tiers"]["host"]["used_bytes"] > 0
