"""Prometheus metrics of the daemon and of a worker, scraped over HTTP after a known workload."""

from __future__ import annotations

import json
import logging
import os
import select
import socket
import sys
import threading
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_admin import PROMPTS, SYSTEM, populate

from benchmarks.daemons import Daemon, running_server, small_config, write_config
from tiercache import cli
from tiercache.client import Client
from tiercache.errors import NotFound
from tiercache.worker.model import load_default_model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[tuple[str, frozenset], float]:
    """Every sample of http://127.0.0.1:port/metrics, parsed by Prometheus' own text parser."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)



def test_daemon_metrics_add_up_after_a_known_workload(base):
    port = free_port()
    config = small_config(base, host_pages=256, disk_bytes=64 << 20, metrics_port=port)
    prompts = [*PROMPTS, PROMPTS[0], SYSTEM + "Lock the door."]
    with running_server(config) as (store, address), Client(address) as client:
        results = populate(address, load_default_model(), prompts)
        assert [r.cached_tokens for r in results] == [0, 80, 96, 80]
        # Disk reads promote into host; an unknown namespace is a counted error.
        client.flush(tier="host")
        keys = [e.store_key for e in client.list()]
        assert len(client.fetch_store_keys(keys)) == len(keys) == 8
        with pytest.raises(NotFound):
            client.list(namespace=b"\1" * 32)
        stats = client.stats()
        m = scrape(port)
    tiers = {t.tier: t for t in stats.tiers}
    # Lookup accounting: every looked-up key is a hit (by tier) or a miss.
    hits = {tier: value(m, "tiercache_lookup_hits_total", tier=tier) for tier in tiers}
    assert value(m, "tiercache_lookups_total") == sum(hits.values()) + value(m, "tiercache_lookup_misses_total")
    assert value(m, "tiercache_lookups_total") == stats.lookups == 6 + 6 + 6 + 6
    assert hits == {"host": 5 + 6 + 5, "disk": 0} == {t: tiers[t].lookup_hits for t in tiers}
    assert value(m, "tiercache_lookup_calls_total") == len(prompts)
    # Bytes and blocks per tier are what Stats says, for every tier. The 8 blocks are on disk
    # (write_through) and back in host (the Fetch after the host flush): host counts whole pages.
    assert set(tiers) == {"host", "disk"}
    assert {t: usage.num_blocks for t, usage in tiers.items()} == {"host": 8, "disk": 8}
    assert tiers["host"].used_bytes == 8 * 65536 and tiers["disk"].used_bytes > 0
    for tier, usage in tiers.items():
        assert value(m, "tiercache_tier_used_bytes", tier=tier) == usage.used_bytes
        assert value(m, "tiercache_tier_blocks", tier=tier) == usage.num_blocks
        assert value(m, "tiercache_tier_capacity_bytes", tier=tier) == usage.capacity_bytes
        assert value(m, "tiercache_promotions_total", tier=tier) == usage.promotions
        assert value(m, "tiercache_evictions_total", tier=tier) == usage.evictions
        assert value(m, "tiercache_fetch_hits_total", tier=tier) == usage.hits
    assert value(m, "tiercache_promotions_total", tier="host") == 8  # the flushed blocks, read back from disk
    assert value(m, "tiercache_kv_payload_bytes") == stats.tenant_bytes == 8 * 65536
    assert value(m, "tiercache_verification_failures_total") == stats.verification_failures == 0
    # What the worker reported: every request, its tokens and its time to first token.
    assert value(m, "tiercache_requests_total") == len(prompts) == stats.requests_reported
    assert value(m, "tiercache_tokens_reused_total") == sum(r.cached_tokens for r in results) == stats.tokens_reused
    assert value(m, "tiercache_tokens_computed_total") == sum(r.computed_tokens for r in results)
    assert value(m, "tiercache_ttft_seconds_count") == len(prompts)
    assert value(m, "tiercache_ttft_seconds_sum") == pytest.approx(sum(r.ttft_s for r in results))
    assert value(m, "tiercache_prefill_seconds_total") == pytest.approx(sum(r.prefill_s for r in results))
    assert value(m, "tiercache_prefill_tokens_per_second_count") == len(prompts)
    # Rpc latency by method, failures by code.
    # A lookup the worker answered from the shared index is no Lookup call; a Touch counts it (one
    # Touch carries the lookups of its round: tiercache_lookup_calls_total above has them all).
    local = len(prompts) - value(m, "tiercache_rpc_duration_seconds_count", method="Lookup")
    assert local >= 1 and value(m, "tiercache_rpc_duration_seconds_count", method="Touch") >= 1
    # The worker's reports went with its Touch calls, not a Report call each.
    assert value(m, "tiercache_rpc_duration_seconds_count", method="Report") == 0
    # Workers' write-backs go in place on the same host: a Reserve and a Commit each, no PutBatch.
    assert value(m, "tiercache_rpc_duration_seconds_count", method="Reserve") >= 1
    assert value(m, "tiercache_rpc_duration_seconds_count", method="Commit") >= 1
    assert value(m, "tiercache_rpc_duration_seconds_count", method="PutBatch") == 0
    assert value(m, "tiercache_rpc_errors_total", method="List", code="NOT_FOUND") == 1


def test_serve_and_worker_metrics_ports_and_lifecycle_logs(base, monkeypatch, caplog):
    """`tiercache serve --metrics-port` as a process; `tiercache worker --metrics-port` in this one
    (its stdin and stdout on pipes), so that the test pays for one interpreter start, not two."""
    config = small_config(base, host_pages=64)
    daemon_port, worker_port = free_port(), free_port()
    daemon = Daemon("--metrics-port", str(daemon_port), config=write_config(f"{base}/tc.toml", config))
    requests_r, requests_w = os.pipe()
    results_r, results_w = os.pipe()
    monkeypatch.setattr(sys, "stdin", os.fdopen(requests_r, "r"))
    monkeypatch.setattr(sys, "stdout", os.fdopen(results_w, "w"))
    caplog.set_level(logging.DEBUG, logger="tiercache.worker.cli")
    codes: list[int] = []
    worker = threading.Thread(target=lambda: codes.append(cli.main(
        ["worker", "--socket", config.server.socket, "--metrics-port", str(worker_port)])))
    try:
        daemon.wait_ready()
        assert value(scrape(daemon_port), "tiercache_tier_capacity_bytes", tier="host") == 64 * 4096
        worker.start()
        with os.fdopen(requests_w, "w") as requests, os.fdopen(results_r) as results:
            requests.write(json.dumps({"prompt": PROMPTS[0], "max_new_tokens": 1}) + "\n")
            requests.flush()
            # A worker that failed to start would leave readline() waiting forever.
            assert select.select([results], [], [], 120)[0], "the worker wrote no result"
            result = json.loads(results.readline())
            mine = scrape(worker_port)
            assert value(mine, "tiercache_worker_requests_total") == 1
            assert value(mine, "tiercache_worker_tokens_computed_total") == result["computed_tokens"] == 105
            assert value(mine, "tiercache_worker_ttft_seconds_sum") == pytest.approx(result["ttft_s"], abs=1e-5)
            deadline = time.monotonic() + 10  # the report travels after the first token, off the critical path
            while value(scrape(daemon_port), "tiercache_requests_total") < 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert value(scrape(daemon_port), "tiercache_tokens_computed_total") == 105
        worker.join(30)
        assert codes == [0]
        assert "request prompt_tokens=105 cached_tokens=0" in caplog.text  # per request, at DEBUG
        assert daemon.stop() == 0
    finally:
        daemon.kill()
    log = daemon.stderr
    for line in ("tier host: capacity_bytes=262144", f"metrics on http://127.0.0.1:{daemon_port}/metrics",
                 "listening on", "shutting down", "stopped"):
        assert line in log, f"lifecycle log lacks {line!r}:\n{log}"
