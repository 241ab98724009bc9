"""scripts/bench_sizes.py end to end at tiny sizes: every layout's every row, with positive figures, in
its printed table and in the markdown it writes."""

from __future__ import annotations

import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent
LAYOUTS = ("embedded default model", "GPT-2-small fp32", "Llama-3-8B fp16",
           "vLLM CPU block (128 tokens, default model)")
PATHS = ("memcpy (baseline)", "put (in place)", "put (staged: callers that cannot write the slab)", "fetch (copies)",
         "fetch_into (preallocated)", "fetch_views (zero-copy, not comparable)", "disk fetch after restart",
         "lookup, 8-block chain")
TARGETED = {"embedded default model": ("put (in place)",),
            "GPT-2-small fp32": ("fetch_into (preallocated)", "disk fetch after restart", "lookup, 8-block chain"),
            "Llama-3-8B fp16": ("fetch_into (preallocated)", "disk fetch after restart", "lookup, 8-block chain")}
PAGED = "GPT-2-small fp32, paged pool"
PAGED_PATHS = {"memcpy (baseline)": False, "store: gather, checksum, Client.put": False,
               "store: reserve, gather into the slab, commit": True,
               "retrieve: keys, lookup, fetch_into the pool (copy and hash in one pass)": True,
               "retrieve: keys, lookup, fetch_into a staging tensor, scatter": False,
               "retrieve: keys, lookup, fetch_views, scatter, still_valid": False,
               "lookup of the prompt, keys included": True, "put alone: reserve + commit": True}


def test_bench_sizes_quick_prints_every_row(tmp_path: pathlib.Path) -> None:
    md = tmp_path / "sizes.md"
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_sizes.py"), "--quick", "--markdown", str(md)],
                          cwd=REPO, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert out.startswith("machine: ") and " cores" in out.splitlines()[0]
    table = {tuple(cells[1:3]): cells[3:-1] for cells in
             ([c.strip() for c in line.split("|")] for line in md.read_text().splitlines() if line.startswith("| "))}
    for layout in LAYOUTS:
        for path in PATHS:
            printed = [line for line in out.splitlines() if line.startswith(layout + "  ") and f"  {path}  " in line]
            assert len(printed) == 1, f"no printed row {layout!r} / {path!r} in:\n{out}"
            median, spread, n, ratio, target, status = table[(layout, path)]
            assert float(median.split()[0]) > 0 and int(n) >= 1, (layout, path, median, n)
            assert all(float(x) > 0 for x in spread.split("-")), (layout, path, spread)
            if path.startswith("lookup"):
                assert median.endswith(" ms") and not ratio
            else:
                assert median.endswith(" GB/s")
                assert bool(ratio) == (path != "memcpy (baseline)") and (not ratio or float(ratio.rstrip("x")) > 0)
            targeted = path in TARGETED.get(layout, ())
            assert (status in ("MET", "MISSED")) == targeted and bool(target) == targeted, (layout, path, status)
    for path, targeted in PAGED_PATHS.items():
        median, spread, n, ratio, target, status = table[(PAGED, path)]
        assert float(median.split()[0]) > 0 and int(n) >= 1, (path, median, n)
        assert (status in ("MET", "MISSED")) == targeted and bool(target) == targeted, (path, status)
    verdicts = [line for line in out.splitlines() if line.startswith(("MET: ", "MISSED: "))]
    assert len(verdicts) == 7 + 4, out
    assert all(layout in md.read_text() for layout in LAYOUTS)
    assert "NOT ALL " not in out, "a same-host put sent its payload over gRPC"
