"""scripts/bench_ttft.py at a tiny size: the first request after each daemon restart reads the disk tier, a line
per step goes to stderr, and --plot draws the README's picture (a PNG)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent


def test_bench_ttft_times_requests_after_a_restart_and_plots_them(tmp_path: pathlib.Path) -> None:
    out, png = tmp_path / "ttft.json", tmp_path / "ttft.png"
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_ttft.py"), "--layers", "2", "--hidden", "64", "--lengths",
         "32,64", "--repeat", "1", "--cold-repeat", "1", "--ab-pairs", "2", "--json", str(out), "--plot", str(png)],
        cwd=REPO, capture_output=True, text=True, check=False, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert all(r["restart"] > 0 for r in rows), rows
    assert "restart ms" in proc.stdout
    steps = [line for line in proc.stderr.splitlines() if line.startswith(("length ", "restart "))]
    assert [s.split(" done")[0].split(":")[0] for s in steps] == ["length 32", "length 64", "restart 1 of 1"], \
        proc.stderr[-2000:]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    again = tmp_path / "again.png"  # --replot draws the same picture from the rows, measuring nothing
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_ttft.py"), "--replot", str(out), "--plot",
                           str(again)], cwd=REPO, capture_output=True, text=True, check=False, timeout=120)
    assert done.returncode == 0 and again.read_bytes() == png.read_bytes(), done.stderr[-2000:]
