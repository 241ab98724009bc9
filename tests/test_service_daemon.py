"""The real daemon process (`python3 -m tiercache.cli serve`): restart, SIGTERM drain, single instance."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import signal
import socket
import threading
import time

import pytest

from benchmarks.daemons import Daemon, assert_intact, chain, cleanup, short_dir, small_config, tokens, write_config
from tiercache.client import Client
from tiercache.codec import encode_block
from tiercache.errors import Unavailable
from tiercache.store import PutResult
from tiercache.v1 import tiercache_pb2 as pb


def test_sigterm_drains_an_inflight_put_and_restart_serves_it_from_disk(base):
    config = small_config(base, host_pages=32)
    conf = write_config(f"{base}/tiercache.toml", config)
    daemon = Daemon(config=conf)
    try:
        addresses = daemon.wait_ready()
        assert addresses == [f"unix:{config.server.socket}"]
        client = Client(addresses[0], timeout_s=30)
        committed = chain(tokens(20, 6))
        assert client.put(committed) == [PutResult.STORED] * 6
        inflight = chain(tokens(21, 4))
        sent = threading.Event()
        outcome: dict = {}

        def slow_requests():
            for i, block in enumerate(inflight):
                if i == 1:
                    sent.set()
                    time.sleep(1.0)  # SIGTERM arrives while the stream is open
                yield pb.PutRequest(record=encode_block(block), last=i == len(inflight) - 1)

        def put():
            try:
                outcome["reply"] = client._stub.Put(slow_requests(), timeout=30)
            except Exception as e:  # noqa: BLE001 - reported below
                outcome["error"] = e

        thread = threading.Thread(target=put)
        thread.start()
        assert sent.wait(10)
        time.sleep(0.2)
        daemon.proc.send_signal(15)
        thread.join(30)
        assert "error" not in outcome, outcome.get("error")
        assert list(outcome["reply"].results) == [pb.PUT_RESULT_STORED] * 4
        assert daemon.proc.wait(30) == 0, daemon.stderr
        assert "drained" in daemon.stderr and not os.path.exists(config.server.socket)
    finally:
        daemon.kill()
    # A new daemon on the same data directory serves everything from disk, bytes intact.
    again = Daemon("--socket", config.server.socket, config=conf)
    try:
        client = Client(again.wait_ready()[0])
        keys = [b.meta.key for b in committed + inflight]
        assert client.lookup(keys[:6]) == ["disk"] * 6 and client.lookup(keys[6:]) == ["disk"] * 4
        got = client.fetch(keys[:6]) + client.fetch(keys[6:], shared_memory=False)
        assert len(got) == 10
        assert_intact(got)
        assert client.verify().integrity_ok
        assert again.stop() == 0
    finally:
        again.kill()


def test_a_burst_of_signals_still_ends_in_a_clean_exit(base):
    """Twenty SIGTERMs in a row (a service manager, `timeout`, an impatient operator): the handler
    took Event.set's lock, which is not re-entrant, so a signal landing while the main thread held
    it (in Event.wait, or in the previous handler) could hang the daemon for good."""
    conf = write_config(f"{base}/tiercache.toml", small_config(base))
    for _ in range(2):
        daemon = Daemon(config=conf)
        try:
            daemon.wait_ready()
            for _ in range(20):  # spaced out: signals sent at once merge into one
                daemon.proc.send_signal(signal.SIGTERM)
                time.sleep(0.001)
            assert daemon.proc.wait(30) == 0, daemon.stderr
        finally:
            daemon.kill()


def test_disk_writes_still_queued_after_the_drain_timeout_are_committed_and_the_exit_is_clean(base):
    """drain_timeout_s = 0: the wait for queued disk writes times out at once. They were accepted,
    so they are committed anyway (store.close()); the exit was 2, the usage code, after a message
    that read as if they were lost."""
    config = small_config(base, host_pages=4096, disk_bytes=64 << 20, drain_timeout_s=0.0)
    conf = write_config(f"{base}/tiercache.toml", config)
    daemon = Daemon(config=conf)
    blocks = chain(tokens(30, 1500))
    try:
        client = Client(daemon.wait_ready()[0], timeout_s=60)
        assert client.put(blocks) == [PutResult.STORED] * len(blocks)  # not durable: writes queued
        assert daemon.stop() == 0, daemon.stderr
    finally:
        daemon.kill()
    again = Daemon(config=conf)
    try:
        client = Client(again.wait_ready()[0], timeout_s=60)
        keys = [b.meta.key for b in blocks]
        assert client.lookup(keys) == ["disk"] * len(keys)
        assert_intact(client.fetch(keys))
    finally:
        again.kill()


def test_a_write_back_daemon_saves_its_host_blocks_on_sigterm_and_serves_them_after_a_restart(base):
    """write_back writes a block to disk when host evicts it; a clean stop evicts everything: the
    blocks still in host were lost at every restart, pinned ones too."""
    config = small_config(base, host_pages=256)
    config = dataclasses.replace(config, disk=dataclasses.replace(config.disk, write_policy="write_back"))
    conf = write_config(f"{base}/tiercache.toml", config)
    blocks, pinned = chain(tokens(40, 6)), chain(tokens(41, 2))
    daemon = Daemon(config=conf)
    try:
        client = Client(daemon.wait_ready()[0], timeout_s=30)
        client.put(blocks)
        client.put(pinned, pin=True)
        assert client.lookup([b.meta.key for b in blocks]) == ["host"] * 6
        assert daemon.stop() == 0, daemon.stderr
        assert "queued blocks=8 host-only blocks to disk" in daemon.stderr
    finally:
        daemon.kill()
    again = Daemon(config=conf)
    try:
        client = Client(again.wait_ready()[0], timeout_s=30)
        assert client.lookup([b.meta.key for b in blocks]) == ["disk"] * 6
        assert_intact(client.fetch([b.meta.key for b in blocks]))
        assert client.lookup([b.meta.key for b in pinned]) == ["disk"] * 2
        assert sum(e.pinned for e in client.list()) == 2
    finally:
        again.kill()


def test_second_daemon_is_refused_and_the_first_keeps_serving(base):
    config = small_config(base)
    conf = write_config(f"{base}/tiercache.toml", config)
    first = Daemon(config=conf)
    try:
        address = first.wait_ready()[0]
        client = Client(address)
        blocks = chain(tokens(30, 3))
        client.put(blocks)
        other = short_dir()
        try:
            # Same socket, another data directory; same data directory, another socket.
            same_socket = Daemon("--data-dir", f"{other}/data", config=conf)
            same_data = Daemon("--socket", f"{other}/x.sock", config=conf)
            for daemon, why in ((same_socket, "socket"), (same_data, "data directory")):
                started = time.monotonic()
                assert daemon.proc.wait(60) == 3
                assert why in daemon.stderr and "tiercache:" in daemon.stderr, daemon.stderr
                assert time.monotonic() - started < 20  # refused at once, not after a timeout
            assert not os.path.exists(f"{other}/x.sock")
        finally:
            cleanup(other)
        assert os.path.exists(config.server.socket)
        assert client.health() == "SERVING"
        assert_intact(client.fetch([b.meta.key for b in blocks]))
        assert first.stop() == 0
    finally:
        first.kill()


def test_stale_socket_is_replaced_idle_blocks_expire_and_a_regular_file_is_refused(base):
    config = small_config(base)
    conf = write_config(f"{base}/tiercache.toml", config)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(config.server.socket)  # bound, never listening: what a killed daemon leaves behind
    stale.close()
    daemon = Daemon(config=conf)
    try:
        client = Client(daemon.wait_ready()[0])
        assert client.health() == "SERVING"
        # The idle daemon runs maintenance: expired blocks leave the store without any call.
        client.put(chain(tokens(31, 2)), ttl_s=0.5)
        client.put(chain(tokens(32, 1)))
        deadline = time.monotonic() + 20
        while len(client.list()) != 1:
            assert time.monotonic() < deadline, "idle maintenance never expired the blocks"
            time.sleep(0.5)
        assert daemon.stop() == 0
    finally:
        daemon.kill()
    precious = f"{base}/notes.txt"
    with open(precious, "w") as f:
        f.write("keep me")
    refused = Daemon("--socket", precious, config=conf)
    assert refused.proc.wait(60) == 2 and "not a socket" in refused.stderr
    assert open(precious).read() == "keep me"


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_durable_put_survives_a_sigkill_right_after_its_reply(base, policy):
    """durable=True replies only after the disk tier committed, whatever the write policy: a daemon
    SIGKILLed the moment the reply arrives still serves every block after a restart."""
    config = small_config(base, host_pages=512)  # room for all: under write_back nothing is demoted to disk
    config = dataclasses.replace(config, disk=dataclasses.replace(config.disk, write_policy=policy))
    conf = write_config(f"{base}/tiercache.toml", config)
    durable, plain = chain(tokens(70, 12)), chain(tokens(71, 4))
    daemon = Daemon(config=conf)
    try:
        daemon.wait_ready()
        with Client(f"unix:{config.server.socket}", timeout_s=30) as client:
            if policy == "write_back":
                client.put(plain)  # not durable: under write_back it lives only in memory
            assert client.put(durable, durable=True) == [PutResult.STORED] * 12
            daemon.kill()  # SIGKILL: no drain, no close
    finally:
        daemon.kill()
    again = Daemon(config=conf)
    try:
        again.wait_ready()
        with Client(f"unix:{config.server.socket}", timeout_s=30) as client:
            got = client.fetch([b.meta.key for b in durable])
            assert [b.meta.key for b in got] == [b.meta.key for b in durable]
            assert_intact(got)
            if policy == "write_back":
                assert client.lookup([b.meta.key for b in plain]) == []  # so durable=True did the work
            assert client.verify().num_failed == 0
    finally:
        assert again.stop() == 0


def test_a_killed_daemons_shared_index_is_not_read_any_more(base):
    """A worker that found blocks through the shared index stops using it the moment the daemon dies
    (the daemon's lock on the index file goes with the process), instead of serving a dead cache."""
    config = small_config(base, host_pages=64)
    conf = write_config(f"{base}/tiercache.toml", config)
    daemon = Daemon(config=conf)
    try:
        daemon.wait_ready()
        client = Client(f"unix:{config.server.socket}", timeout_s=2)
        blocks = chain(tokens(80, 3))
        keys = [b.meta.key for b in blocks]
        client.put(blocks)  # a staged put: maps the slab and its index
        assert_intact(client.fetch_views(keys))
        assert client.num_local == 1
        daemon.kill()
        with pytest.raises(Unavailable):
            client.fetch_views(keys)  # not answered from the dead daemon's index: a call, which fails
        assert client.num_local == 1 and client._slab.index is None
        client.close()
    finally:
        daemon.kill()


class CountingStore:
    """A real TieredStore's maintenance calls, counted (the store itself does the work)."""

    def __init__(self, store: object) -> None:
        self.store, self.expired, self.checked = store, 0, 0

    def expire(self) -> int:
        self.expired += 1
        return self.store.expire()  # type: ignore[attr-defined]

    def check_integrity(self) -> None:
        self.checked += 1
        self.store.check_integrity()  # type: ignore[attr-defined]


@pytest.mark.parametrize("integrity_s, checks", [(0.0, (0, 0)), (0.3, (1, 6))])
def test_idle_maintenance_expires_often_and_checks_integrity_only_every_integrity_check_s(
        tmp_path, integrity_s: float, checks: tuple[int, int]) -> None:
    from benchmarks.daemons import open_store
    from server.auth import Activity
    from server.main import _maintain

    config = small_config(str(tmp_path))
    store = open_store(config)
    counting, stop = CountingStore(store), threading.Event()
    thread = threading.Thread(target=_maintain, args=(counting, Activity(), 0.05, integrity_s, stop))
    try:
        thread.start()
        time.sleep(1.5)
    finally:
        stop.set()
        thread.join(10)
        store.close()  # type: ignore[attr-defined]
    assert counting.expired >= 3, "TTL expiry must run every idle_check_s"
    assert checks[0] <= counting.checked <= checks[1], f"{counting.checked} integrity checks in 1.5 s"


def test_maintenance_intervals_are_validated() -> None:
    from tiercache.config import Config, ServerConfig

    with pytest.raises(ValueError, match="server.idle_check_s"):
        Config(server=ServerConfig(idle_check_s=0))
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="server.integrity_check_s"):
            Config(server=ServerConfig(integrity_check_s=bad))
        with pytest.raises(ValueError, match="server.idle_check_s"):
            Config(server=ServerConfig(idle_check_s=bad))


def test_a_sigterm_that_another_thread_receives_still_stops_the_daemon(base):
    """The kernel may hand SIGTERM to any thread of the daemon. The Python handler runs only in the
    main thread, between bytecodes, and that thread sits in a read of the wake pipe: a signal taken
    by another thread was lost and the daemon ran on (a race test waited 90 s for one to exit)."""
    import subprocess
    import sys

    config = small_config(base)
    conf = write_config(f"{base}/tiercache.toml", config)
    script = f"""
import logging, os, signal, sys, threading, time
from tiercache.config import load_config
from server.main import serve

def take_it_in_this_thread():
    while not os.path.exists({config.server.socket!r}):
        time.sleep(0.02)
    time.sleep(0.2)
    signal.pthread_kill(threading.get_ident(), signal.SIGTERM)  # delivered to this thread, not main

logging.basicConfig(level=logging.INFO)
threading.Thread(target=take_it_in_this_thread, daemon=True).start()
sys.exit(serve(load_config({conf!r})))
"""
    env = {**os.environ, "PYTHONPATH": str(pathlib.Path(__file__).resolve().parent.parent)}
    try:
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail("the daemon did not stop on a SIGTERM taken by a thread other than the main one")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "shutting down" in done.stderr
