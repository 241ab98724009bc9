"""scripts/bench_peers.py end to end at tiny sizes: every configuration runs, figures and files come out honest."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from benchmarks.services import redis_unavailable_reason
from tests.helpers_daemon import REPO

TINY = ["--workers", "2", "--requests", "4", "--turns", "2", "--system-tokens", "40", "--request-tokens", "8,16",
        "--prefix-lengths", "32,64", "--probe-repeats", "1", "--new-tokens", "1", "--rounds", "2"]
LIVE = ("inproc", "redis", "files", "tc-shm", "tc-grpc", "tc-disk")
EXPECTED_SURVIVAL = {"none": "n/a", "inproc": "no", "redis": "no", "files": "yes", "tc-shm": "yes", "tc-grpc": "yes",
                     "tc-disk": "yes"}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    cmd = [sys.executable, "scripts/bench_peers.py", *TINY, "--out", str(out / "peers"),
           "--json", str(out / "peers.json")]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout, json.loads((out / "peers.json").read_text()), out


def test_every_configuration_runs_with_the_same_workload(run) -> None:
    _, data, _ = run
    rows = {r["key"]: r for r in data["rows"]}
    assert list(rows) == ["none", *LIVE]
    if redis_unavailable_reason():
        skipped = rows["redis"]["skipped"]
        assert "apt-get install redis-server" in skipped or "pip install redis" in skipped
    live = [k for k in LIVE if not rows[k]["skipped"]]
    prompts = {k: sorted(r["prompt_tokens"] for r in rows[k]["results"]) for k in ["none", *live] if k != "tc-disk"}
    assert len({tuple(p) for p in prompts.values()}) == 1, "the configurations did not run the same prompts"
    assert rows["none"]["tokens_reused"] == 0
    for key in live:
        row = rows[key]
        assert row["tokens_reused"] > 0, f"{key} reused nothing"
        assert row["transfer_bytes_per_s"] > 0, f"{key} transferred nothing"
        # A probe after the fill reuses the whole prefix, unless the Worker's cost model measured
        # that recomputing these few tokens is cheaper than fetching them (then it reuses nothing).
        for probe in (p for p in row["probes"] if p["kind"] == "probe"):
            assert probe["cached_tokens"] in (0, probe["prefix"]), (key, probe)
        assert row["survives_restart"] == EXPECTED_SURVIVAL[key], (key, row["survives_restart"])
    assert "disk" in rows["tc-disk"]["tiers_hit"], "the first request after the restart did not read the disk tier"
    probes = [p for p in rows["tc-disk"]["probes"] if p["cached_tokens"]]
    assert all(p["tiers"] == ["disk"] for p in probes), "a probe after the restart did not read LMDB"


def test_rounds_are_pooled_and_each_starts_from_empty_caches(run) -> None:
    stdout, data, _ = run
    rows = {r["key"]: r for r in data["rows"] if not r["skipped"]}
    for key, row in rows.items():
        by_round = [[r for r in row["results"] if r["round"] == n] for n in (1, 2)]
        assert len(by_round[0]) == len(by_round[1]) > 0 and len(row["results"]) == sum(map(len, by_round)), key
        assert sorted(r["prompt_tokens"] for r in by_round[0]) == sorted(r["prompt_tokens"] for r in by_round[1]), key
        assert {p["round"] for p in row["probes"]} == {1, 2}, key
        if key == "tc-disk":  # a new day on the system prompt cached before the restart, read from LMDB in each round
            assert all(any("disk" in r["tiers"] for r in results) for results in by_round)
        else:  # the first request of a round finds nothing: the round before left no block behind
            assert [min(r["cached_tokens"] for r in results) for results in by_round] == [0, 0], key
    for target in data["targets"]:
        if target["status"] != "SKIP":
            ratios, met = target["by_round"].split(" (")
            assert len(ratios.split(", ")) == 2 and met.endswith(" of 2 met)"), target
            assert f"by round {target['by_round']}" in stdout


def test_cache_process_memory_is_measured(run) -> None:
    _, data, _ = run
    rows = {r["key"]: r for r in data["rows"]}
    assert rows["tc-shm"]["cache_rss"].endswith("at start)") and "MB (daemon" in rows["tc-shm"]["cache_rss"]
    assert "worker growth" in rows["inproc"]["cache_rss"]
    if not rows["redis"]["skipped"]:
        assert "redis-server" in rows["redis"]["cache_rss"]


def test_cache_process_cpu_is_measured(run) -> None:
    _, data, _ = run
    rows = {r["key"]: r for r in data["rows"]}
    for key in ("tc-shm", "tc-grpc", "tc-disk") + (() if rows["redis"]["skipped"] else ("redis",)):
        ms, name = rows[key]["cache_cpu"].split(" ", 1)
        assert float(ms) >= 0 and name == ("(redis-server)" if key == "redis" else "(daemon)"), (key, rows[key]["cache_cpu"])
    # Clock ticks are 10 ms: at these sizes only the daemon's Puts and Touches of the live rows surely add up to one.
    assert float(rows["tc-shm"]["cache_cpu"].split()[0]) > 0
    assert rows["none"]["cache_cpu"] == "n/a (no cache)"
    assert rows["inproc"]["cache_cpu"] == rows["files"]["cache_cpu"] == "n/a (in the workers)"


def test_table_targets_and_plot_are_written(run) -> None:
    stdout, data, out = run
    assert [t["status"] in ("PASS", "MISS", "SKIP") for t in data["targets"]] == [True] * 4
    for target in data["targets"]:
        assert f"{target['status']}  {target['text']}" in stdout
    md = (out / "peers.md").read_text()
    assert "| configuration |" in md and "## Targets" in md and "scripts/bench_peers.py" in md
    if importlib.util.find_spec("matplotlib") is None:
        assert "pip install matplotlib" in md
    else:
        assert "![TTFT against prefix length](peers.png)" in md
        assert (out / "peers.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_missing_redis_names_the_install_commands(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no redis-server on it
    reason = redis_unavailable_reason()
    assert reason is not None and "`apt-get install redis-server`" in reason
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize("kind", ["inproc", "files"])
def test_the_backends_answer_every_call_the_workers_writer_makes(kind, tmp_path) -> None:
    # A breakpoint asked twice makes the writer probe its tail (lookup(..., probe=True)): a backend
    # without the argument lost that request's whole Put, and Worker.drain() raised the TypeError.
    from benchmarks.backends import FileBackend, InProcessBackend, Meter, Timed
    from tests.test_worker import tiny, toks
    from tiercache.layout import BlockLayout
    from tiercache.worker import Request, Worker

    holder: dict = {}

    def backend():
        ns = holder["worker"].namespace()
        layout, digest = BlockLayout.of(ns), ns.digest()
        inner = InProcessBackend(layout, digest) if kind == "inproc" else FileBackend(str(tmp_path), layout, digest)
        return Timed(inner, Meter())

    worker = holder["worker"] = Worker(tiny("llama"), backend, retry_after_s=0.0)
    prompt = tuple(toks(60, 41))
    for _ in range(3):
        result = worker.run(Request(prompt, max_new_tokens=1, breakpoints=(40,)))
        worker.drain()
        assert not result.degraded
    assert result.cached_tokens == 48  # whole blocks past the breakpoint, cached by the first request
    worker.close()
