"""What the cache reveals: prompt previews (none for salted namespaces, a config switch for the rest),
where the metrics endpoints listen, and whether their figures name tenants."""

from __future__ import annotations

import dataclasses
import json
import os
import select
import socket
import sys
import threading
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.parser import text_string_to_metric_families
from test_admin import run_admin, run_json

from benchmarks.daemons import NS, chain, cleanup, running_server, short_dir, small_config, tokens
from tiercache import cli
from tiercache.client import Client
from tiercache.config import Config, ServerConfig, WorkerConfig, load_config
from tiercache.keys import block_keys
from tiercache.metrics import serve_metrics
from tiercache.tenancy import LOCAL_TENANT, scope_key
from tiercache.worker import Request, Worker
from tiercache.worker.model import load_default_model, namespace_for

SECRET = "[alice's diary] Dear diary, today I told the doctor about my "  # a salted user's prompt
SALTED_PROMPT = SECRET + "headaches. What could cause them, and should I worry?"
PLAIN_PROMPT = "[2024-05-01 10:00:00] You are a helpful home assistant. Turn on the kitchen lights, please."
QUIET_PROMPT = "[config says no previews] Summarise the following meeting notes in three short bullet points."
CLI_PROMPT = "[worker command, previews off in its config file] List three quick vegetarian dinner ideas."
OTHER_HOST = "127.0.0.2"  # on loopback too (Linux routes all of 127/8 there), but another address


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape_text(port: int, host: str = "127.0.0.1") -> str:
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as reply:
        return reply.read().decode()


def answers(host: str, port: int) -> bool:
    """Whether something accepts TCP connections at host:port."""
    with socket.socket() as s:
        s.settimeout(2.0)
        return s.connect_ex((host, port)) == 0


def samples(text: str) -> list:
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def head_preview(client: Client, ns, prompt_tokens: list[int]) -> str:
    """The preview stored with the first block of a prompt's chain, as the daemon lists it."""
    head = scope_key(LOCAL_TENANT, block_keys(ns, prompt_tokens)[0])
    (entry,) = [e for e in client.listing(namespace=ns.digest()).entries if e.store_key == head]
    return entry.preview



@pytest.fixture(scope="module")
def loaded():
    return load_default_model()


@pytest.fixture(scope="module")
def cached(loaded):
    """A daemon with three prompts put by real workers: one salted, one plain, one with previews off."""
    path = short_dir()
    try:
        with running_server(small_config(path, host_pages=256, disk_bytes=64 << 20)) as (_, address):
            for salt, prompt, previews in (("alice-secret", SALTED_PROMPT, True), ("", PLAIN_PROMPT, True),
                                           ("", QUIET_PROMPT, False)):
                worker = Worker(loaded, lambda: Client(address), previews=previews)
                try:
                    worker.run(Request(tuple(loaded.tokenizer.encode(prompt)), max_new_tokens=1, salt=salt,
                                       preview=prompt[:64]))
                    worker.drain()
                finally:
                    worker.close()
            yield address, path
    finally:
        cleanup(path)


def test_a_salted_namespace_gets_no_preview_and_a_plain_one_does(cached, loaded):
    address, _ = cached
    salted, plain = namespace_for(loaded, block_tokens=16, salt="alice-secret"), namespace_for(loaded, block_tokens=16)
    with Client(address) as client:
        stored = client.listing(namespace=salted.digest()).entries
        assert len(stored) == len(block_keys(salted, loaded.tokenizer.encode(SALTED_PROMPT)))  # every full block
        assert [e.preview for e in stored] == [""] * len(stored)
        # The control: the same worker code stores a plain request's preview, so the check above can see one.
        assert head_preview(client, plain, loaded.tokenizer.encode(PLAIN_PROMPT)) == PLAIN_PROMPT[:64]
    code, out, _ = run_admin(address, "ls")
    assert code == 0 and "salt set" in out and "diary" not in out
    code, listing = run_json(address, "ls", "--blocks")
    by_salt = {ns["salted"]: ns for ns in listing["namespaces"]}
    assert [c["preview"] for c in by_salt[True]["chains"]] == [""]
    assert {b["preview"] for b in by_salt[True]["blocks"]} == {""}
    assert PLAIN_PROMPT[:64] in [c["preview"] for c in by_salt[False]["chains"]]


def test_previews_off_in_the_config_stores_none(cached, loaded):
    address, _ = cached
    with Client(address) as client:
        assert head_preview(client, namespace_for(loaded, block_tokens=16), loaded.tokenizer.encode(QUIET_PROMPT)) == ""


def test_the_daemon_drops_previews_a_client_sends_for_a_salted_namespace(base):
    """Any client, not only our worker: a preview in a Put that describes its namespace as salted,
    or into a namespace described so before, is not stored."""
    salted = dataclasses.replace(NS, salt="carol-secret")
    first, later = chain(tokens(8, 2), salted), chain(tokens(9, 1), salted)
    first[0] = dataclasses.replace(first[0], meta=dataclasses.replace(first[0].meta, preview="carol's words"))
    later[0] = dataclasses.replace(later[0], meta=dataclasses.replace(later[0].meta, preview="more of them"))
    plain = chain(tokens(10, 1))
    plain[0] = dataclasses.replace(plain[0], meta=dataclasses.replace(plain[0].meta, preview="the house prompt"))
    with running_server(small_config(base)) as (_, address), Client(address) as client:
        client.put(first, namespace=salted)
        client.put(later)  # no description in this Put: the registry knows the namespace is salted
        client.put(plain, namespace=NS)
        assert sorted(e.preview for e in client.list()) == ["", "", "", "the house prompt"]


def test_the_admin_cli_hides_a_preview_a_salted_namespace_carries_from_before(base):
    """Blocks a worker put before salted namespaces lost their previews: the listing still has the
    text, `ls` and `ls --json --blocks` show none of it."""
    salted = dataclasses.replace(NS, salt="bob-secret")
    blocks = chain(tokens(7, 2), salted)
    blocks[0] = dataclasses.replace(blocks[0], meta=dataclasses.replace(blocks[0].meta, preview="bob's secret words"))
    with running_server(small_config(base)) as (_, address), Client(address) as client:
        client.put(blocks)  # a client that never said the namespace is salted: the daemon cannot tell
        client.put(blocks, namespace=salted)  # described later (the blocks are present already)
        assert "bob's secret words" in [e.preview for e in client.list()]  # what an old worker left behind
        code, out, _ = run_admin(address, "ls", "--blocks")
        assert code == 0 and "secret words" not in out
        code, listing = run_json(address, "ls", "--blocks")
        (ns,) = listing["namespaces"]
        assert ns["salted"] and "secret words" not in json.dumps(listing)


def test_the_worker_command_reads_previews_from_its_config_and_serves_metrics_on_loopback(cached, loaded,
                                                                                         monkeypatch):
    """`tiercache worker --config FILE` with `[worker] previews = false`, and --metrics-port without
    --metrics-host: loopback only, no tenant label."""
    address, path = cached
    config_file = os.path.join(path, "worker.toml")
    with open(config_file, "w") as f:
        f.write("[worker]\npreviews = false\n")
    port = free_port()
    requests_r, requests_w = os.pipe()
    results_r, results_w = os.pipe()
    monkeypatch.setattr(sys, "stdin", os.fdopen(requests_r, "r"))
    monkeypatch.setattr(sys, "stdout", os.fdopen(results_w, "w"))
    codes: list[int] = []
    worker = threading.Thread(target=lambda: codes.append(cli.main(
        ["worker", "--socket", address[len("unix:"):], "--config", config_file, "--metrics-port", str(port),
         "--no-tune-malloc"])))
    worker.start()
    try:
        with os.fdopen(requests_w, "w") as requests, os.fdopen(results_r) as results:
            requests.write(json.dumps({"prompt": CLI_PROMPT, "max_new_tokens": 1}) + "\n")
            requests.flush()
            assert select.select([results], [], [], 120)[0], "the worker wrote no result"
            assert "error" not in json.loads(results.readline())
            text = scrape_text(port)
            assert "tiercache_worker_requests_total 1.0" in text
            assert not [s for s in samples(text) if "tenant" in s.labels or "salt" in s.labels]
            assert not answers(OTHER_HOST, port), "the worker's metrics endpoint listens beyond 127.0.0.1"
    finally:
        worker.join(60)
    assert codes == [0]
    with Client(address) as client:
        assert head_preview(client, namespace_for(loaded, block_tokens=16), loaded.tokenizer.encode(CLI_PROMPT)) == ""


def test_serve_metrics_binds_loopback_unless_told():
    registry = CollectorRegistry()
    Counter("probe", "a sample", registry=registry).inc()
    port = free_port()
    stop = serve_metrics(registry, port)
    try:
        assert "probe_total 1.0" in scrape_text(port)
        assert not answers(OTHER_HOST, port)
    finally:
        stop()
    stop = serve_metrics(registry, port, OTHER_HOST)
    try:
        assert "probe_total 1.0" in scrape_text(port, OTHER_HOST) and not answers("127.0.0.1", port)
    finally:
        stop()


def _tcp_config(base: str, **server: object) -> Config:
    return small_config(base, listen=f"{OTHER_HOST}:0", tokens={"tok-alice": "alice"}, metrics_port=free_port(),
                        **server)


def test_the_daemon_metrics_endpoint_stays_on_loopback_when_grpc_listens_elsewhere(base):
    """server.listen opens gRPC on another address; the metrics endpoint (no token) stays on
    127.0.0.1 (it used to follow server.listen's host)."""
    config = _tcp_config(base)
    assert config.server.metrics_host == "127.0.0.1"
    port = config.server.metrics_port
    with running_server(config) as (_, tcp_address):
        assert tcp_address.startswith(OTHER_HOST)
        assert "tiercache_tier_capacity_bytes" in scrape_text(port)
        assert not answers(OTHER_HOST, port)


def test_the_daemon_metrics_endpoint_binds_the_configured_host(base):
    config = _tcp_config(base, metrics_host=OTHER_HOST)
    port = config.server.metrics_port
    with running_server(config):
        assert "tiercache_tier_capacity_bytes" in scrape_text(port, OTHER_HOST)
        assert not answers("127.0.0.1", port)


@pytest.mark.parametrize("labels", [False, True])
def test_daemon_metrics_name_tenants_only_when_configured(base, labels):
    config = _tcp_config(base, **({"metrics_tenant_labels": True} if labels else {}))
    blocks = chain(tokens(3, 2))
    with running_server(config) as (_, tcp_address), Client(tcp_address, token="tok-alice") as alice:
        alice.put(blocks)
        text = scrape_text(config.server.metrics_port)
    found = samples(text)
    payload = sum(b.meta.nbytes for b in blocks)
    assert [s.value for s in found if s.name == "tiercache_kv_payload_bytes"] == [payload]  # always, summed
    tenant_samples = {s.labels["tenant"]: s.value for s in found if "tenant" in s.labels}
    if labels:
        assert tenant_samples == {"alice": payload}
    else:
        assert tenant_samples == {} and "alice" not in text


def test_new_config_fields_have_defaults_load_and_are_validated(tmp_path):
    config = Config()
    assert (config.server.metrics_host, config.server.metrics_tenant_labels, config.worker.previews) == \
        ("127.0.0.1", False, True)
    path = tmp_path / "tc.toml"
    path.write_text('[server]\nmetrics_host = "0.0.0.0"\nmetrics_tenant_labels = true\n[worker]\npreviews = false\n')
    config = load_config(path, env={})
    assert (config.server.metrics_host, config.server.metrics_tenant_labels, config.worker.previews) == \
        ("0.0.0.0", True, False)
    config = load_config(path, env={"TIERCACHE_WORKER__PREVIEWS": "true", "TIERCACHE_SERVER__METRICS_HOST": "::1"})
    assert (config.server.metrics_host, config.worker.previews) == ("::1", True)
    built: list[tuple[str, object, str]] = [
        ("server", ServerConfig(metrics_host="127.0.0.1:9464"), "server.metrics_host"),
        ("server", ServerConfig(metrics_host=""), "server.metrics_host"),
        ("server", ServerConfig(metrics_tenant_labels="yes"), "server.metrics_tenant_labels"),  # type: ignore[arg-type]
        ("worker", WorkerConfig(previews=1), "worker.previews"),  # type: ignore[arg-type]
    ]
    for section, bad, field in built:  # built directly, not loaded: the dataclasses validate too
        with pytest.raises(ValueError, match=f"config field {field}="):
            Config(**{section: bad})  # type: ignore[arg-type]
    for overrides, field in (([("worker.previews", "maybe")], "worker.previews"),
                             ([("server.metrics_tenant_labels", "2")], "server.metrics_tenant_labels"),
                             ([("server.metrics_host", "http://nas")], "server.metrics_host")):
        with pytest.raises(ValueError, match=f"config field {field}="):
            load_config(env={}, overrides=overrides)
    with pytest.raises(ValueError, match="unknown config key.*worker.preview\\b"):
        load_config(env={"TIERCACHE_WORKER__PREVIEW": "false"})
