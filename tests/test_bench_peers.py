"""scripts/bench_peers.py end to end at tiny sizes: every configuration runs, figures and files come out honest."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import sys

import pytest

from benchmarks.daemons import REPO
from benchmarks.services import redis_unavailable_reason
from benchmarks.workload import VOCAB, Sizes, household_jobs

TINY = ["--workers", "2", "--requests", "4", "--turns", "2", "--system-tokens", "40", "--request-tokens", "8,16",
        "--prefix-lengths", "32,64", "--probe-repeats", "1", "--new-tokens", "1", "--rounds", "2"]
SIZES = Sizes(system_tokens=40, requests=4, turns=2, request_tokens=(8, 16), new_tokens=1, probe_repeats=1,
              prefix_lengths=(32, 64))
ROUNDS = 2
ALL = ("none", "inproc", "redis", "files", "tc-shm", "tc-views", "tc-grpc", "tc-disk")
HOUSEHOLD = ("none", "inproc", "redis", "files", "tc-shm", "tc-views", "tc-grpc")  # the disk row runs probes only
EXPECTED_SURVIVAL = {"none": "n/a", "inproc": "no", "redis": "no", "files": "yes", "tc-shm": "yes",
                     "tc-views": "yes", "tc-grpc": "yes", "tc-disk": "yes"}
# text -> (meets the target, the ratio recomputed from the rows' own figures)
TARGETS = {
    "tiercache shared-memory KV fetch (copy) >= 3x Redis":
        (lambda x: x >= 3, lambda rows: rows["tc-shm"]["fetch_bytes_per_s"] / rows["redis"]["fetch_bytes_per_s"]),
    "tiercache shared-memory KV fetch (copy) >= 3x one file per chunk":
        (lambda x: x >= 3, lambda rows: rows["tc-shm"]["fetch_bytes_per_s"] / rows["files"]["fetch_bytes_per_s"]),
    "tiercache host-tier TTFT p50 (copy) <= 1.3x in-process cache":
        (lambda x: x <= 1.3, lambda rows: rows["tc-shm"]["ttft_p50_ms"] / rows["inproc"]["ttft_p50_ms"]),
    "after a restart, disk-tier TTFT at 64 tokens >= 10x faster than no cache":
        (lambda x: x >= 10, lambda rows: rows["none"]["probe_ttft_ms"]["64"] / rows["tc-disk"]["probe_ttft_ms"]["64"]),
}
REDIS = redis_unavailable_reason() is None


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    cmd = [sys.executable, "scripts/bench_peers.py", *TINY, "--out", str(out / "peers"),
           "--json", str(out / "peers.json")]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout, json.loads((out / "peers.json").read_text()), out


def by_key(data: dict) -> dict[str, dict]:
    return {r["key"]: r for r in data["rows"]}


def test_every_configuration_runs_with_the_same_workload(run) -> None:
    _, data, _ = run
    rows = by_key(data)
    assert list(rows) == list(ALL)
    assert bool(rows["redis"]["skipped"]) is not REDIS, rows["redis"]["skipped"]
    if not REDIS:
        skipped = rows["redis"]["skipped"]
        assert "apt-get install redis-server" in skipped or "pip install redis" in skipped
    ran = [k for k in ALL if not rows[k]["skipped"]]
    assert len(ran) == len(ALL) - (not REDIS)
    jobs = household_jobs(SIZES, VOCAB, 2)
    expected = sorted(len(job.tokens) for job in jobs) * ROUNDS
    for key in HOUSEHOLD:
        if key in ran:
            assert sorted(r["prompt_tokens"] for r in rows[key]["results"]) == sorted(expected), key
    assert rows["none"]["tokens_reused"] == 0 and rows["none"]["prompt_tokens"] == sum(expected)
    for key in ran:
        row = rows[key]
        assert row["survives_restart"] == EXPECTED_SURVIVAL[key], (key, row["survives_restart"])
        probes = [p for p in row["probes"] if p["kind"] == "probe"]
        assert sorted(p["prefix"] for p in probes) == sorted(SIZES.prefix_lengths * ROUNDS), key
        if key == "none":
            continue
        assert row["ready_bytes_per_s"] > 0, f"{key}: no fetch + cache build measured"
        # A probe after the fill reuses the whole prefix, unless the Worker's cost model measured
        # that recomputing these few tokens is cheaper than fetching them (then it reuses nothing).
        assert all(p["cached_tokens"] in (0, p["prefix"]) for p in probes), (key, probes)
        if key == "tc-disk":
            continue
        assert row["tokens_reused"] > 0, f"{key} reused nothing"
        if key == "tc-views":  # views into the slab: no figure comparable with the copies' fetch
            assert row["views"] is True and math.isnan(row["fetch_bytes_per_s"])
            assert row["views_fetch_bytes_per_s"] > 0
        else:
            assert row["views"] is False and row["fetch_bytes_per_s"] > 0, key
            assert math.isnan(row["views_fetch_bytes_per_s"]), key


def test_the_disk_row_starts_empty_and_every_probe_reads_lmdb(run) -> None:
    stdout, data, _ = run
    disk = by_key(data)["tc-disk"]
    assert disk["results"] == [] and disk["wall_s"] == 0, "the disk row ran a household workload"
    probes = disk["probes"]
    assert len(probes) == len(SIZES.prefix_lengths) * SIZES.probe_repeats * ROUNDS
    assert {p["kind"] for p in probes} == {"probe"}
    # Each round's first probe is its new Worker's first fetch from the disk tier, which the cost model
    # always makes; a later one may find recomputing its few tokens cheaper (then it reuses nothing).
    for n in range(1, ROUNDS + 1):
        first = min((p for p in probes if p["round"] == n), key=lambda p: p["id"])
        assert (first["tiers"], first["cached_tokens"]) == (["disk"], first["prefix"]), first
    reused = [p for p in probes if p["cached_tokens"]]
    assert all((p["tiers"], p["cached_tokens"]) == (["disk"], p["prefix"]) for p in reused), probes
    assert disk["fetch_bytes_per_s"] > 0 and disk["cache_cpu"] == "n/a (probes only)"
    assert f"probes reading each tier: disk {len(reused)}" in disk["note"]
    assert f"{disk['label']}: {disk['note']}" in stdout


def test_rounds_are_pooled_and_each_starts_from_empty_caches(run) -> None:
    stdout, data, _ = run
    rows = {k: r for k, r in by_key(data).items() if not r["skipped"]}
    for key, row in rows.items():
        assert {p["round"] for p in row["probes"]} == {1, 2}, key
        if key == "tc-disk":
            continue
        by_round = [[r for r in row["results"] if r["round"] == n] for n in (1, 2)]
        assert len(by_round[0]) == len(by_round[1]) > 0 and len(row["results"]) == sum(map(len, by_round)), key
        assert sorted(r["prompt_tokens"] for r in by_round[0]) == sorted(r["prompt_tokens"] for r in by_round[1]), key
        # The first request of a round finds nothing: the round before left no block behind.
        first = [min(results, key=lambda r: r["id"]) for results in by_round]
        assert [r["cached_tokens"] for r in first] == [0, 0], key
    judged = [t for t in data["targets"] if t["status"] != "NOT MEASURED"]
    assert len(judged) == len(TARGETS) - (not REDIS)
    for target in judged:
        meets = TARGETS[target["text"]][0]
        ratios, met = target["by_round"].split(" (")
        values = [float(x.rstrip("x")) for x in ratios.split(", ")]
        # Printed to 2 decimals and judged on the exact ratio: a round within 0.005 of the bound may go either way.
        surely = sum(meets(v - 0.005) and meets(v + 0.005) for v in values)
        maybe = sum(meets(v - 0.005) or meets(v + 0.005) for v in values)
        count, _, rest = met.partition(" of ")
        assert len(values) == ROUNDS and rest == f"{ROUNDS} met)" and surely <= int(count) <= maybe, target
        assert f"{target['status']}  {target['text']}: {target['measured']}; by round {target['by_round']}" in stdout


def test_targets_are_judged_on_the_copy_row_and_misses_are_printed_as_missed(run) -> None:
    stdout, data, out = run
    rows = by_key(data)
    assert [t["text"] for t in data["targets"]] == list(TARGETS)
    md = (out / "peers.md").read_text()
    for target in data["targets"]:
        meets, ratio_of = TARGETS[target["text"]]
        if target["status"] == "NOT MEASURED":
            assert not REDIS and "Redis" in target["text"], target
            continue
        ratio = ratio_of(rows)
        assert target["ratio"] == pytest.approx(ratio, rel=1e-9), target
        assert target["status"] == ("MET" if meets(ratio) else "MISSED"), target
        assert f"{target['status']}  {target['text']}: {target['measured']}" in stdout
        assert f"- **{target['status']}** {target['text']}: {target['measured']}" in md


def test_cache_process_memory_is_measured(run) -> None:
    _, data, _ = run
    rows = by_key(data)
    for key in ("tc-shm", "tc-views", "tc-grpc", "tc-disk"):
        m = re.fullmatch(r"([\d,]+) MB \(daemon; ([\d,]+) MB at start\)", rows[key]["cache_rss"])
        assert m and int(m[1].replace(",", "")) > 0 and int(m[2].replace(",", "")) > 0, (key, rows[key]["cache_rss"])
    assert re.fullmatch(r"[\d,]+ MB \(worker growth\)", rows["inproc"]["cache_rss"]), rows["inproc"]["cache_rss"]
    assert re.fullmatch(r"n/a \(no process; [\d,]+ MB in [1-9]\d* files, page cache\)", rows["files"]["cache_rss"])
    if REDIS:
        m = re.fullmatch(r"([\d,]+) MB \(redis-server; ([\d,]+) MB idle\)", rows["redis"]["cache_rss"])
        assert m and int(m[1].replace(",", "")) > 0, rows["redis"]["cache_rss"]


def test_cache_process_cpu_is_measured(run) -> None:
    _, data, _ = run
    rows = by_key(data)
    for key in ("tc-shm", "tc-views", "tc-grpc") + (("redis",) if REDIS else ()):
        row = rows[key]
        name = "redis-server" if key == "redis" else "daemon"
        assert row["cache_cpu_s"] is not None, key
        assert row["cache_cpu"] == f"{row['cache_cpu_s'] / len(row['results']) * 1e3:.1f} ({name})", key
    # Clock ticks are 10 ms: at these sizes only the daemon's Puts and Touches of the copy and stream rows
    # surely add up to one.
    assert rows["tc-shm"]["cache_cpu_s"] > 0 and rows["tc-grpc"]["cache_cpu_s"] > 0
    assert rows["none"]["cache_cpu"] == "n/a (no cache)"
    assert rows["inproc"]["cache_cpu"] == rows["files"]["cache_cpu"] == "n/a (in the workers)"
    assert rows["tc-disk"]["cache_cpu"] == "n/a (probes only)" and rows["tc-disk"]["cache_cpu_s"] is None


def test_table_targets_and_plot_are_written(run) -> None:
    stdout, data, out = run
    md = (out / "peers.md").read_text()
    header = ("| configuration | TTFT p50 ms | TTFT p95 ms | p50 speedup | tokens reused | prompt tok/s "
              "| KV fetch MB/s | KV fetch+build MB/s | cache CPU ms/req | cache peak RSS | survives restart "
              "| TTFT@32 ms | TTFT@64 ms |")
    assert header in md and "## Targets" in md
    assert "Produced by `python3 scripts/bench_peers.py " + " ".join(TINY) in md
    labels = [line.split(" | ")[0].lstrip("| ") for line in md.splitlines()
              if line.startswith("| ") and not line.startswith("| configuration")]
    assert labels == [r["label"] for r in data["rows"]]
    for row in data["rows"]:
        assert stdout.count(row["label"]) >= 1
    views = by_key(data)["tc-views"]
    assert f"{views['label']}: fetch_views alone {views['views_fetch_bytes_per_s'] / 1e6:,.0f} MB/s" in md
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


def test_cache_builds_are_timed_and_the_worker_is_restored() -> None:
    import tiercache.worker.request as worker_module
    from benchmarks.backends import InProcessBackend, Meter, Timed
    from benchmarks.runner import cache_builds_timed
    from tests.test_worker import tiny, toks
    from tiercache.layout import BlockLayout
    from tiercache.worker import Request, Worker

    original = worker_module.blocks_to_cache
    meter, holder = Meter(), {}

    def backend():
        ns = holder["worker"].namespace()
        return Timed(InProcessBackend(BlockLayout.of(ns), ns.digest()), meter)

    worker = holder["worker"] = Worker(tiny("llama"), backend, retry_after_s=0.0)
    with cache_builds_timed(lambda: meter):
        for _ in range(2):
            result = worker.run(Request(tuple(toks(60, 7)), max_new_tokens=1))
            worker.drain()
    worker.close()
    assert worker_module.blocks_to_cache is original
    assert result.cached_tokens == 48 and meter.fetches == 1
    assert meter.builds == 1 and meter.build_s > 0


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
    results = []
    for _ in range(3):
        results.append(worker.run(Request(prompt, max_new_tokens=1, breakpoints=(40,))))
        worker.drain()
        assert not results[-1].degraded
    # Whole blocks past the breakpoint, cached by the first request. The second request's fetch is the
    # Worker's first from this tier, which its cost model always makes; the third's depends on what it
    # measured (a busy machine may make recomputing 48 tokens look cheaper).
    assert [r.cached_tokens for r in results[:2]] == [0, 48]
    worker.close()
