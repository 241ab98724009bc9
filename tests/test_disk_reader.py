"""Same-host reads of the disk tier: a tokenless worker reads the daemon's LMDB itself, never serves a
damaged or timed block from it, and never opens it inside the daemon's own process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from benchmarks.daemons import Daemon, assert_intact, chain, running_server, small_config, tokens, write_config
from tiercache.client import Client, disk_reader
from tiercache.tenancy import LOCAL_TENANT, scope_keys


def readers_of(config) -> list:  # type: ignore[no-untyped-def]
    """This process's open readers of the disk tier of `config` (other tests' clients may hold theirs)."""
    data = os.stat(os.path.join(config.data_dir, "disk", "data.mdb"))
    return [r for (pid, dev, ino), r in disk_reader._READERS.items() if (dev, ino) == (data.st_dev, data.st_ino)]



@pytest.fixture
def daemon(base):
    config = small_config(base, host_pages=64)
    proc = Daemon(config=write_config(f"{base}/tc.toml", config))
    address = proc.wait_ready()[0]
    yield config, address
    assert proc.stop() == 0, proc.stderr


class Calls:
    """Counts calls of one client stub method (still making them)."""

    def __init__(self, client: Client, name: str) -> None:
        self.count = 0
        real = getattr(client._stub, name)

        def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
            self.count += 1
            return real(*args, **kwargs)
        setattr(client._stub, name, counted)


def test_a_worker_reads_the_disk_tier_without_a_call_and_touch_promotes_it(daemon):
    config, address = daemon
    with Client(address) as client:
        blocks = chain(tokens(41, 8))
        keys = [b.meta.key for b in blocks]
        client.put(blocks, durable=True)
        assert len(client.fetch_views(keys[:1])) == 1  # learns where the disk tier is
        client.send_touches()  # that read's Touch before the flush (after it, it would promote block 0)
        assert client.flush(tier="host") == 8
        absent = chain(tokens(49, 1))[0].meta.key
        disk_hits = lambda: next(t.lookup_hits for t in client.stats().tiers if t.tier == "disk")  # noqa: E731
        hits_before = disk_hits()
        lookups = Calls(client, "Lookup")
        client._fetch_shared_raw = client._fetch_raw = None  # any fetch call would fail now
        assert client.lookup(keys) == ["disk"] * 8
        assert client.lookup(keys + [absent]) == ["disk"] * 8  # the presence filter proves the end
        got = client.fetch_views(keys)
        assert [b.meta for b in got] == [b.meta for b in blocks]  # client keys and parents
        assert_intact(got)
        assert got.still_valid()
        assert_intact(client.fetch(keys))
        assert lookups.count == 0 and client.num_disk_blocks == 16
        client.send_touches()  # the daemon counts them with the Touch, as disk hits
        assert disk_hits() == hits_before + 16
        # The Touch of those reads promotes the chain: the shared index then holds it.
        assert client.lookup(keys) == ["host"] * 8
    # The last client of the process closed its environment: anything in this process may open it again.
    assert not readers_of(config)


def test_blocks_the_daemon_dropped_are_not_read_back_from_its_disk(daemon):
    """An evicted block leaves the daemon's index at once but LMDB a moment later (its delete is
    gathered with others, or held back while the disk is full): the reader stops where the
    presence filter says the store no longer has a block."""
    _, address = daemon
    with Client(address) as client:
        blocks = chain(tokens(45, 8))
        keys = [b.meta.key for b in blocks]
        client.put(blocks, durable=True)
        assert len(client.fetch_views(keys[:1])) == 1
        client.send_touches()  # that read's Touch before the flush
        client.flush(tier="host")
        assert client.evict(keys[4:]) == 4
        assert client.lookup(keys) == ["disk"] * 4
        got = client.fetch_views(keys)
        assert [b.meta.key for b in got] == keys[:4]
        assert_intact(got)


def test_damaged_and_timed_disk_blocks_are_left_to_the_daemon(daemon, base):
    config, address = daemon
    with Client(address) as client:
        plain, timed = chain(tokens(42, 8)), chain(tokens(43, 4))
        plain_keys, timed_keys = [b.meta.key for b in plain], [b.meta.key for b in timed]
        client.put(plain, durable=True)
        client.put(timed, ttl_s=300, durable=True)
        assert len(client.fetch_views(plain_keys[:1])) == 1
        client.send_touches()  # that read's Touch before the flush
        client.flush(tier="host")
        # Flip one payload byte of block 3's record in LMDB, from another process: LMDB forbids a
        # second environment of the same file in this one, which the client's reader has open.
        damaged = scope_keys(LOCAL_TENANT, [plain_keys[3]])[0]
        script = ("import lmdb, sys\n"
                  "env = lmdb.open(sys.argv[1], max_dbs=4, map_size=1 << 30)\n"
                  "db = env.open_db(b'blocks')\n"
                  "with env.begin(write=True, db=db) as txn:\n"
                  "    record = bytearray(txn.get(bytes.fromhex(sys.argv[2])))\n"
                  "    record[-5] ^= 0x40\n"
                  "    txn.put(bytes.fromhex(sys.argv[2]), bytes(record))\n")
        subprocess.run([sys.executable, "-c", script, f"{config.data_dir}/disk", damaged.hex()], check=True)
        before = sum(t.verification_failures for t in client.stats().tiers)
        got = client.fetch_views(plain_keys)
        assert len(got) == 3, "the prefix ends at the damaged block"
        assert_intact(got)
        assert client.num_disk_blocks == 0, "a read that met damage is the daemon's to answer"
        assert sum(t.verification_failures for t in client.stats().tiers) == before + 1  # it dropped it
        # A block with a TTL: only the daemon knows whether it has expired.
        lookups = Calls(client, "Lookup")
        assert client.lookup(timed_keys) == ["disk"] * 4 and lookups.count == 1
        assert_intact(client.fetch(timed_keys))
        assert client.num_disk_blocks == 0


def test_a_read_in_a_later_snapshot_checks_every_block_for_a_ttl_again(daemon):
    """read() skips the TTL check of blocks its lookup (prefix) checked in the same LMDB snapshot;
    once a write has committed since, a block that has gained a TTL meanwhile ends the run."""
    config, address = daemon
    with Client(address) as client:
        blocks = chain(tokens(44, 5))
        keys = [b.meta.key for b in blocks]
        client.put(blocks, durable=True)
        store_keys = scope_keys(LOCAL_TENANT, keys)
        reader = disk_reader.disk_reader(f"{config.data_dir}/disk", daemon_pid=-1)  # not this process's
        assert reader is not None
        try:
            assert reader.prefix(store_keys) == 5
            got = reader.read(keys, store_keys, 0, 5)  # the same snapshot: no meta record read again
            assert [b.meta.key for b in got] == keys
            assert_intact(got)
            assert reader.prefix(store_keys) == 5
            # From another process (LMDB allows one environment of a file per process): block 2's
            # meta record now carries a TTL, committed after that lookup.
            script = ("import json, lmdb, sys, time\n"
                      "env = lmdb.open(sys.argv[1], max_dbs=4, map_size=1 << 30)\n"
                      "db = env.open_db(b'meta')\n"
                      "with env.begin(write=True, db=db) as txn:\n"
                      "    record = json.loads(bytes(txn.get(bytes.fromhex(sys.argv[2]))))\n"
                      "    record['attrs'].update(ttl_s=300.0, expires_at=time.time() + 300)\n"
                      "    txn.put(bytes.fromhex(sys.argv[2]), json.dumps(record, separators=(',', ':')).encode())\n")
            subprocess.run([sys.executable, "-c", script, f"{config.data_dir}/disk", store_keys[2].hex()], check=True)
            got = reader.read(keys, store_keys, 0, 5)
            assert [b.meta.key for b in got] == keys[:2], "the block that gained a TTL is the daemon's to serve"
            assert reader.prefix(store_keys) == 2
        finally:
            disk_reader.release(reader)


def test_the_daemons_own_process_never_opens_its_environment_a_second_time(base):
    config = small_config(base)
    with running_server(config) as (store, address), Client(address) as client:
        blocks = chain(tokens(44, 4))
        keys = [b.meta.key for b in blocks]
        client.put(blocks, durable=True)
        assert len(client.fetch_views(keys[:1])) == 1
        client.send_touches()  # that read's Touch before the flush
        client.flush(tier="host")
        lookups = Calls(client, "Lookup")
        assert client.lookup(keys) == ["disk"] * 4 and lookups.count == 1  # asked: the daemon is this process
        assert_intact(client.fetch_views(keys))
        assert client.num_disk_blocks == 0 and not readers_of(config)
        store.check_integrity()
