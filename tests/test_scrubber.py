"""The disk tier's background scrub, in a real daemon over a real LMDB: damaged blocks found at the
configured rate (dropped and counted as a failed read would), intact ones untouched and served,
progress in Stats and the metrics, the position kept across a restart, no reads while calls run."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import logging
import os
import socket
import threading
import time
import urllib.request
from collections.abc import Callable
from typing import cast

import grpc
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.daemons import open_store, running_server, small_config
from benchmarks.reliability import committed_keys, flip, intact, payload_offset
from benchmarks.scenarios.corruption import populate
from tiercache import admin
from tiercache.client import Client
from tiercache.config import Config
from tiercache.store import TieredStore
from tiercache.store_scrub import ScrubProgress, key_fraction
from tiercache.tenancy import scope_key
from tiercache.v1 import tiercache_pb2_grpc as pb_grpc

NUM_CHAINS, PER_CHAIN = 6, 8
NUM_BLOCKS = NUM_CHAINS * PER_CHAIN
RECORD_BYTES = 4600  # a 4 KiB block's record, about: the rate is set from it
DAMAGED = [(0, 5), (1, 0), (2, 3), (3, 7), (5, 2)]  # (chain, block) flipped on disk


def scrub_config(base: str, pass_s: float, **server: object) -> Config:
    """small_config with the scrub on at a rate that reads the whole disk tier in about pass_s seconds."""
    config = small_config(base, host_pages=128, **server)
    return dataclasses.replace(config, disk=dataclasses.replace(
        config.disk, scrub_bytes_per_s=int(NUM_BLOCKS * RECORD_BYTES / pass_s), scrub_idle_s=0.0,
        scrub_interval_s=3600.0))


def wait_for(store: TieredStore, done: Callable[[ScrubProgress], bool], within_s: float) -> ScrubProgress:
    """The scrub's progress once `done` holds (read in-process: a call would pause the scrub)."""
    deadline = time.monotonic() + within_s
    while True:
        progress = store.scrub_progress()
        if progress is not None and done(progress):
            return progress
        assert time.monotonic() < deadline, f"not within {within_s:.1f} s: {progress}"
        time.sleep(0.02)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


def test_the_scrub_finds_every_damaged_block_at_its_rate_and_leaves_the_rest_alone(base):
    port = free_port()
    config = scrub_config(base, 2.0, metrics_port=port)
    chains = populate(config, NUM_CHAINS, PER_CHAIN)
    data_mdb = os.path.join(config.data_dir, "disk", "data.mdb")
    with open(data_mdb, "rb") as f:
        content = f.read()
    for c, i in DAMAGED:  # one byte of each payload, at rest, where no request will read it
        at = payload_offset(content, chains[c][i])
        assert at >= 0, f"block {i} of chain {c} not found once in data.mdb"
        flip(data_mdb, at + 1000)
    bad = {scope_key("local", chains[c][i].meta.key) for c, i in DAMAGED}
    store = cast(TieredStore, open_store(config))
    assert store.disk is not None
    before = {e.meta.key: (e.hits, e.last_access) for e in store.entries()}
    lru = list(store.disk.lru_keys())
    assert len(before) == NUM_BLOCKS and all(e.tiers == ("disk",) for e in store.entries())
    rate = config.disk.scrub_bytes_per_s
    with running_server(config, store) as (store, address):
        started = time.monotonic()
        # The rate implies NUM_BLOCKS * RECORD_BYTES / rate = 2 s; slack for a loaded 2-core machine.
        bound_s = 3 * NUM_BLOCKS * RECORD_BYTES / rate + 5
        done = wait_for(store, lambda p: p.passes >= 1, bound_s)
        took = time.monotonic() - started
        assert done.damaged_blocks == len(DAMAGED) and done.blocks_scrubbed == NUM_BLOCKS
        assert NUM_BLOCKS * 4096 < done.bytes_scrubbed < NUM_BLOCKS * 2 * RECORD_BYTES
        assert took >= 0.5 * done.bytes_scrubbed / rate, f"read {done.bytes_scrubbed} bytes in {took:.2f} s"
        assert done.pass_fraction == 0 and done.next_pass_unix_s > time.time() + 3000 and done.last_pass_unix_s
        # Dropped through the store's own path: index, disk tier and counters agree.
        store.check_integrity()
        assert not bad & {e.meta.key for e in store.entries()}
        assert store.snapshot_counters()["verification_failures"] == len(DAMAGED)
        disk = next(t for t in store.tier_stats() if t.name == "disk")
        assert disk.verification_failures == len(DAMAGED) and disk.num_blocks == NUM_BLOCKS - len(DAMAGED)
        # The intact blocks were read and nothing else: no hit, no access time, no LRU move.
        assert {e.meta.key: (e.hits, e.last_access) for e in store.entries()} == \
            {k: v for k, v in before.items() if k not in bad}
        assert list(store.disk.lru_keys()) == [k for k in lru if k not in bad]
        m = scrape(port)  # over HTTP, not a call: the scrub's figures as Prometheus sees them
        assert m["tiercache_scrub_damaged_blocks_total"] == len(DAMAGED)
        assert m["tiercache_scrub_blocks_total"] == NUM_BLOCKS and m["tiercache_scrub_passes_total"] == 1
        assert m["tiercache_scrub_bytes_total"] == done.bytes_scrubbed and m["tiercache_scrub_pass_fraction"] == 0
        assert m["tiercache_scrub_last_pass_timestamp_seconds"] == done.last_pass_unix_s
        assert m["tiercache_verification_failures_total"] == len(DAMAGED)
        with Client(address) as client:
            stats = client.stats()
            assert stats.scrub is not None and stats.verification_failures == len(DAMAGED)
            assert (stats.scrub.damaged_blocks, stats.scrub.blocks_scrubbed, stats.scrub.passes) == \
                (len(DAMAGED), NUM_BLOCKS, 1)
            assert stats.scrub.bytes_per_s == rate and not stats.scrub.paused
            for c, blocks in enumerate(chains):
                for i, block in enumerate(blocks):
                    got = client.fetch([block.meta.key])
                    if (c, i) in DAMAGED:
                        assert got == [], "a damaged block was served"
                    else:
                        assert len(got) == 1 and intact(got), f"intact block {i} of chain {c} not served"
        out = io.StringIO()
        assert admin.main(["stats", "--socket", config.server.socket], out, io.StringIO(), io.StringIO()) == 0
        line = next(line for line in out.getvalue().splitlines() if line.startswith("disk scrub"))
        assert "between passes" in line and "1 passes completed" in line and f"{NUM_BLOCKS} blocks" in line
        assert f"{len(DAMAGED)} damaged dropped" in line and "last full pass ended" in line
        out = io.StringIO()
        assert admin.main(["stats", "--json", "--socket", config.server.socket], out, io.StringIO(),
                          io.StringIO()) == 0
        scrub = json.loads(out.getvalue())["scrub"]
        assert (scrub["damaged_blocks"], scrub["passes"], scrub["bytes_scrubbed"]) == \
            (len(DAMAGED), 1, done.bytes_scrubbed)


def test_a_restarted_daemon_resumes_the_pass_where_it_stopped(base):
    config = scrub_config(base, 4.0)
    populate(config, NUM_CHAINS, PER_CHAIN)
    with running_server(config) as (store, _):
        first = wait_for(store, lambda p: p.blocks_scrubbed >= 8, 10)
        assert first.passes == 0
    after_stop = first.blocks_scrubbed  # at least: the batch running at the stop finished
    with open(os.path.join(config.data_dir, "scrub.json")) as f:
        position = bytes.fromhex(json.load(f)["position"])
    keys = sorted(committed_keys(config.data_dir))
    done_before = sum(1 for k in keys if k <= position)
    assert after_stop <= done_before < NUM_BLOCKS
    with running_server(config) as (store, address):
        assert store.scrub_progress().pass_fraction >= key_fraction(position) > 0  # resumed, not from 0
        done = wait_for(store, lambda p: p.passes >= 1, 3 * 4.0 + 5)
        assert done.blocks_scrubbed == NUM_BLOCKS - done_before, "the restarted pass read blocks read before"
        with Client(address) as client:
            assert client.stats().scrub.passes == 1
    with open(os.path.join(config.data_dir, "scrub.json")) as f:
        assert json.load(f)["position"] == ""  # between passes


def test_after_a_crash_mid_pass_the_scrub_skips_what_it_may_have_read_last(base, caplog):
    """A damaged LMDB page that takes the daemon down would be read again after every restart (a crash
    loop): the state file says "not stopped" from the scrub's start until a clean stop, and a daemon
    that finds it so skips about SAVE_EVERY_S of reading past the kept position (here, at a rate
    that reads the tier in 4 s, the rest of the pass)."""
    config = scrub_config(base, 4.0)
    populate(config, NUM_CHAINS, PER_CHAIN)
    state = os.path.join(config.data_dir, "scrub.json")
    with running_server(config) as (store, _):
        wait_for(store, lambda p: p.blocks_scrubbed >= 1, 10)
        with open(state) as f:
            assert json.load(f)["stopped"] is False  # what a SIGKILL now would leave
    with open(state) as f:
        kept = json.load(f)
    assert kept["stopped"] is True
    keys = sorted(committed_keys(config.data_dir))
    with open(state, "w") as f:  # killed a quarter of the way through a pass
        json.dump({**kept, "position": keys[len(keys) // 4].hex(), "stopped": False}, f)
    with caplog.at_level(logging.WARNING, logger="tiercache.store_scrub"), running_server(config) as (store, _):
        done = wait_for(store, lambda p: p.passes >= 1, 10)
        assert done.blocks_scrubbed == 0, "blocks after the kept position were read again"
    assert "the daemon stopped while scrubbing" in caplog.text


def test_the_scrub_reads_nothing_while_a_call_is_in_flight(base):
    config = scrub_config(base, 3.0)
    populate(config, NUM_CHAINS, PER_CHAIN)
    with running_server(config) as (store, address):
        wait_for(store, lambda p: p.blocks_scrubbed >= 3, 10)
        gate = threading.Event()

        def held_open():  # a Put stream that sends nothing until the gate opens
            gate.wait(30)
            yield from ()

        with grpc.insecure_channel(address) as channel:
            call = pb_grpc.TierCacheStub(channel).Put.future(held_open(), timeout=60)
            try:
                paused = wait_for(store, lambda p: p.paused, 10)
                # The scrub has looked again several times and found the call still there: nothing read.
                again = wait_for(store, lambda p: p.paused_s >= paused.paused_s + 0.3, 10)
                assert again.paused and (again.bytes_scrubbed, again.blocks_scrubbed) == \
                    (paused.bytes_scrubbed, paused.blocks_scrubbed)
                assert paused.passes == 0 and paused.blocks_scrubbed < NUM_BLOCKS
            finally:
                gate.set()
                with contextlib.suppress(grpc.RpcError):
                    call.result()
        done = wait_for(store, lambda p: p.passes >= 1, 3 * 3.0 + 5)
        assert not done.paused and done.blocks_scrubbed == NUM_BLOCKS


def test_no_scrub_at_rate_zero(base):
    config = small_config(base)  # scrub_bytes_per_s = 0
    with running_server(config) as (store, address), Client(address) as client:
        assert store.scrub_progress() is None and client.stats().scrub is None
    assert not os.path.exists(os.path.join(config.data_dir, "scrub.json"))


def test_two_callers_stopping_the_scrub_at_once_both_return_after_its_position_is_kept(base, monkeypatch):
    """The daemon's shutdown and store.close stop the scrub at once: neither may return while the state
    file still says "not stopped" (the next start would take a clean exit for a crash mid-pass)."""
    from tiercache.store_scrub import Scrubber

    save = Scrubber._save

    def slow_save(self: Scrubber, stopped: bool = False) -> None:  # widens the window the second caller had
        if stopped:
            time.sleep(0.5)
        save(self, stopped)

    monkeypatch.setattr(Scrubber, "_save", slow_save)
    config = scrub_config(base, 4.0)
    populate(config, NUM_CHAINS, PER_CHAIN)
    state = os.path.join(config.data_dir, "scrub.json")
    seen: list[bool] = []
    with running_server(config) as (store, _):
        wait_for(store, lambda p: p.blocks_scrubbed >= 1, 10)

        def stop_and_read() -> None:
            store.stop_scrub()
            with open(state) as f:
                seen.append(json.load(f)["stopped"])

        threads = [threading.Thread(target=stop_and_read) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    assert seen == [True, True]
