"""Best-effort use of the daemon: left alone after a failure (longer after failures in a row), a fresh
client after the wait, counters; against a real daemon that stops and starts again."""

from __future__ import annotations

import threading

import pytest

from benchmarks.daemons import cleanup, running_server, short_dir, small_config
from tiercache.client import BestEffort, Client
from tiercache.errors import Unavailable

KEY = b"\x01" * 32


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Fake:
    """A client whose calls fail while `broken`; it remembers whether it was closed."""

    made = 0

    def __init__(self) -> None:
        Fake.made += 1
        self.closed = False
        self.broken = False

    def lookup(self) -> list[str]:
        if self.broken or self.closed:
            raise Unavailable("no daemon")
        return ["host"]

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def base():
    path = short_dir()
    yield path
    cleanup(path)


def test_a_failed_daemon_is_left_alone_and_then_tried_with_a_fresh_client() -> None:
    clock = Clock()
    daemon = BestEffort(Fake, 2.0, clock=clock)
    first = daemon.client()
    assert first is not None and daemon.client() is first  # one client, shared
    first.broken = True
    assert daemon.call("lookup", Fake.lookup, []) == []
    assert first.closed and (daemon.num_failures, daemon.num_skipped) == (1, 0)
    assert daemon.client() is None and daemon.call("lookup", Fake.lookup, []) == []
    assert daemon.num_skipped == 2
    clock.now += 2.0
    fresh = daemon.client()
    assert fresh is not None and fresh is not first and daemon.call("lookup", Fake.lookup, []) == ["host"]


def test_a_long_outage_is_tried_less_often_and_a_success_ends_it() -> None:
    """Down for 300 s, asked every 50 ms: tried every retry_after_s (1 s) for the first 10 s, then
    every tenth of the outage so far, at most every 5 s; back up, it is used within 5 s."""
    clock = Clock()
    start = clock.now
    tries = []

    def factory() -> Fake:
        tries.append(clock.now - start)
        client = Fake()
        client.broken = clock.now - start < 300
        return client

    daemon = BestEffort(factory, 1.0, max_retry_after_s=5.0, clock=clock)
    while daemon.call("lookup", Fake.lookup, []) != ["host"]:
        clock.now += 0.05
    gaps = [b - a for a, b in zip(tries, tries[1:])]
    assert all(0.99 < g < 1.06 for g in gaps[:10])  # a restart's seconds: every retry_after_s
    assert max(gaps) < 5.06 and all(4.99 < g for g in gaps[-10:])  # a long outage: every 5 s
    assert all(a <= b + 0.06 for a, b in zip(gaps, gaps[1:]))  # never more often as it goes on
    assert 300 <= tries[-1] < 305 and len(tries) < 110  # not 300
    client = daemon.client()
    assert client is not None  # the call that went through ended the outage: the next failure waits 1 s
    daemon.failed(client, "lookup", Unavailable("down"))
    clock.now += 1.0
    assert daemon.client() is not None


def test_a_late_failure_of_a_client_given_up_already_leaves_the_fresh_one_alone() -> None:
    clock = Clock()
    daemon = BestEffort(Fake, 0.0, clock=clock)
    old = daemon.client()
    assert old is not None
    daemon.failed(old, "put", Unavailable("down"))  # the writer thread
    fresh = daemon.client()
    assert fresh is not None and fresh is not old
    daemon.failed(old, "lookup", ValueError("closed channel"))  # the request thread, same outage
    assert daemon.client() is fresh and not fresh.closed and daemon.num_failures == 2


def test_a_factory_that_fails_counts_as_a_failure() -> None:
    clock = Clock()
    calls = []

    def factory() -> Fake:
        calls.append(1)
        raise OSError("no such certificate file")

    daemon = BestEffort(factory, 3.0, clock=clock)
    assert daemon.client() is None and daemon.client() is None
    assert (len(calls), daemon.num_failures, daemon.num_skipped) == (1, 1, 1)
    clock.now += 3.0
    assert daemon.client() is None and len(calls) == 2


def test_without_a_factory_there_is_never_a_client() -> None:
    daemon: BestEffort[Fake] = BestEffort(None, 1.0)
    assert daemon.client() is None and daemon.call("lookup", Fake.lookup, "none") == "none"
    assert (daemon.num_failures, daemon.num_skipped) == (0, 0)


def test_threads_share_one_client() -> None:
    Fake.made = 0
    daemon = BestEffort(Fake, 1.0)
    got = []
    threads = [threading.Thread(target=lambda: got.append(daemon.client())) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert Fake.made == 1 and len({id(c) for c in got}) == 1


def test_a_real_client_against_a_dead_socket(base) -> None:
    daemon = BestEffort(lambda: Client(f"unix:{base}/none.sock", timeout_s=0.5), 60.0)
    assert daemon.call("lookup", lambda c: c.lookup([KEY]), None) is None
    assert daemon.call("lookup", lambda c: c.lookup([KEY]), None) is None
    assert (daemon.num_failures, daemon.num_skipped) == (1, 1)
    daemon.close()


def test_a_daemon_that_stops_and_starts_again_is_used_again(base) -> None:
    config = small_config(base)
    daemon = BestEffort(lambda: Client(f"unix:{config.server.socket}", timeout_s=1.0), 0.0)
    with running_server(config):
        assert daemon.call("lookup", lambda c: c.lookup([KEY]), None) == []
        before = daemon.client()
    assert daemon.call("lookup", lambda c: c.lookup([KEY]), None) is None and daemon.num_failures == 1
    with running_server(config):
        # gRPC's reconnect backoff on the old channel does not matter: the client is a fresh one.
        assert daemon.call("lookup", lambda c: c.lookup([KEY]), None) == []
        assert daemon.client() is not before
    daemon.close()
