"""Corruption: flipped bytes in LMDB files and in a live shared-memory page are detected, dropped, counted
and never served; a damaged LMDB is moved aside and the daemon starts empty instead of crashing."""

from __future__ import annotations

import os

import grpc
import pytest

from benchmarks.daemons import Daemon, chain, cleanup, running_server, short_dir, small_config, tokens
from benchmarks.reliability import daemon_config, flip, intact, slab_pages
from benchmarks.scenarios.corruption import damage, populate, run_lmdb_damage
from tiercache.client import CHANNEL_OPTIONS, Client, parse_fetch_response
from tiercache.codec import decode_block
from tiercache.errors import CorruptBlock
from tiercache.samehost.slab import remove_orphan_slabs
from tiercache.tenancy import scope_key, scope_keys
from tiercache.v1 import tiercache_pb2 as pb


@pytest.mark.slow
def test_flipped_bytes_in_lmdb_are_detected_dropped_counted_never_served():
    base = short_dir()
    try:
        report = run_lmdb_damage(base, seed=3)
        print(report)
        assert not report.problems, "\n".join(report.problems)
        assert report.damaged == 7 and report.detected_by_verify >= 1 and report.detected_on_read >= 1
    finally:
        cleanup(base)


# What the move-aside log line must name, for each kind of damage.
CAUSES = {
    "garbage header": "MDB_INVALID",
    "truncated": "truncated",  # regression (bug 1): was a SIGBUS; now caught before LMDB maps it
    "free list": "a probe process died with SIGABRT",  # regression (bug 1): LMDB aborted at the first write
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(CAUSES))
def test_damaged_lmdb_is_moved_aside_and_the_daemon_serves_on(kind: str):
    base = short_dir()
    daemon = None
    try:
        config, conf = daemon_config(base)
        populate(config, 6, 4)
        damage(kind, os.path.join(config.data_dir, "disk", "data.mdb"))
        daemon = Daemon(config=conf)
        daemon.wait_ready()  # raises with the daemon's exit status (e.g. -7, SIGBUS) if it died
        with Client(daemon.addresses[0], timeout_s=30) as client:
            blocks = chain(tokens(77, 3))
            client.put(blocks)  # the first write transaction
            assert intact(client.fetch([b.meta.key for b in blocks])) and client.health() == "SERVING"
            assert client.verify().integrity_ok
        assert daemon.stop() == 0, daemon.stderr
        aside = [p for p in os.listdir(config.data_dir) if p.startswith("disk.corrupt-")]
        assert len(aside) == 1, os.listdir(config.data_dir)
        moved = [line for line in daemon.stderr.splitlines() if "moved it aside" in line]
        assert len(moved) == 1 and "starting empty" in moved[0] and CAUSES[kind] in moved[0], daemon.stderr
    finally:
        if daemon is not None:
            daemon.kill()
        remove_orphan_slabs(config.host.shm_dir)  # a daemon killed by a signal leaves its slab
        cleanup(base)


def flip_in_slab(address: str, keys: list[bytes], index: int) -> None:
    """Flip one byte in the host slab page holding block `index` of the chain, as a stray write would."""
    path, header_bytes, page_bytes, pages = slab_pages(address, keys)
    flip(path, header_bytes + pages[index][0] * page_bytes + 100)


def test_flipped_slab_byte_is_caught_by_verify_and_by_fetch_never_served():
    base = short_dir()
    try:
        with running_server(small_config(base)) as (store, address), Client(address) as client:
            blocks = chain(tokens(61, 6))
            keys = [b.meta.key for b in blocks]
            client.put(blocks, durable=True)  # the disk copy exists before the slab is damaged
            flip_in_slab(address, keys, 2)
            result = client.verify()
            assert result.num_failed == 1 and result.integrity_ok
            assert result.dropped_store_keys == [scope_key("local", keys[2])]
            got = client.fetch(keys)  # the intact disk copy serves block 2
            assert len(got) == 6 and intact(got)
            assert client.lookup(keys)[2] == "host"  # and was promoted back
            flip_in_slab(address, keys, 4)  # now without a Verify first: the fetch itself must notice
            for shared_memory in (True, False):
                got = client.fetch(keys, shared_memory=shared_memory)
                assert len(got) == 6 and intact(got), "a damaged slab page reached the caller"
            assert client.num_refetched >= 1  # the shared-memory copy failed its checksum in the client
            assert client.stats().verification_failures == 2
            assert client.health() == "SERVING"
            store.check_integrity()
    finally:
        cleanup(base)


def test_views_kept_between_fetches_are_checked_again_every_time():
    """fetch_views keeps the views of a chain for its next fetch (and a longer chain's shared
    prefix reuses them), but every fetch sums them again and reads their pages' generations: a
    flipped byte or a recycled page under a kept view is never handed back."""
    base = short_dir()
    try:
        with running_server(small_config(base)) as (store, address), Client(address) as client:
            longer = chain(tokens(63, 8))
            blocks, keys = longer[:6], [b.meta.key for b in longer[:6]]
            client.put(blocks, durable=True)  # the disk copy exists before the slab is damaged
            assert len(client.fetch_views(keys[:1])) == 1  # maps the slab and its index
            first = client.fetch_views(keys)
            again = client.fetch_views(keys)
            assert len(again) == 6 and intact(again) and again.still_valid()
            assert [a.payload is b.payload for a, b in zip(first, again)] == [True] * 6, "the views were not kept"
            client.put(longer[6:])
            grown = client.fetch_views([b.meta.key for b in longer])  # a conversation growing from a kept prefix
            assert len(grown) == 8 and intact(grown) and [b.meta for b in grown] == [b.meta for b in longer]
            assert [a.payload is b.payload for a, b in zip(first, grown)] == [True] * 6
            assert client.fetch_views(keys)[5].payload is first[5].payload  # the shorter chain: still kept

            flip_in_slab(address, keys, 3)
            got = client.fetch_views(keys)
            assert len(got) == 6 and intact(got), "a flipped byte under a kept view reached the caller"
            assert got[3].payload is not first[3].payload
            assert store.snapshot_counters().get("verification_failures", 0) == 1

            client.evict(keys[1:2])
            client.put(chain(tokens(64, 8)))  # other blocks take the freed pages
            assert [b.meta.key for b in client.fetch_views(keys)] == keys[:1]
            client.put(blocks[1:2])  # the same key again, on other pages
            got = client.fetch_views(keys)
            assert len(got) == 6 and intact(got) and got.still_valid()
            assert got[1].payload is not first[1].payload, "a kept view of a recycled page was handed back"
            assert client.health() == "SERVING"
            store.check_integrity()
    finally:
        cleanup(base)


def test_servicer_never_sends_a_damaged_slab_block_and_serves_the_disk_copy():
    base = short_dir()
    try:
        with running_server(small_config(base)) as (store, address):
            blocks = chain(tokens(62, 4))
            keys = [b.meta.key for b in blocks]
            Client(address).put(blocks, durable=True)  # the disk copy exists before the slab is damaged
            flip_in_slab(address, keys, 1)
            # A raw caller (another language, no checksum of its own) reads the byte path.
            channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
            fetch = channel.unary_stream("/tiercache.v1.TierCache/Fetch",
                                         request_serializer=pb.FetchRequest.SerializeToString)
            records = [body for data in fetch(pb.FetchRequest(keys=keys), timeout=30)
                       for _, body in parse_fetch_response(data)[1]]
            channel.close()
            try:
                got = [decode_block(r, max_payload_bytes=1 << 20, expected_key=k) for r, k in zip(records, keys)]
            except CorruptBlock as e:
                pytest.fail(f"the daemon sent a damaged record: {e}")
            assert len(got) == 4 and intact(got), "the intact disk copy should have been served"
            assert store.snapshot_counters().get("verification_failures", 0) == 1
            assert scope_keys("local", keys[1:2])[0] in {e.meta.key for e in store.entries()}
    finally:
        cleanup(base)
