"""Puts in place at the store: room reserved in the slab, written through a real read-write map of it
(samehost/writer.py), committed; leases, write-after-commit, and pages the disk writer still reads."""

from __future__ import annotations

import time

import pytest
import torch
from test_store import Clock, make_store

from tests.blocks import make_chain
from tiercache.block import Block, PutResult
from tiercache.errors import CapacityExceeded, CorruptBlock, InvalidArgument, NotFound
from tiercache.samehost.writer import SlabWriter, fill


def write(store, reservation, chain: list[Block]) -> None:
    """The caller's part: each reserved block's payload into its pages, through the slab's own map."""
    writer = SlabWriter(store.host.slab_path)
    for block, pages in zip(chain, reservation.pages):
        if pages is not None:
            fill(writer.runs(pages, block.meta.nbytes), [block.payload])
    writer.close()


def reserve_and_write(store, chain: list[Block], **kw):
    reservation = store.reserve([b.meta for b in chain], **kw)
    write(store, reservation, chain)
    return reservation


def test_a_chain_written_in_place_is_stored_hashed_by_the_store_and_written_through(tmp_path, shm_dir) -> None:
    store = make_store(tmp_path, shm_dir)
    chain = make_chain(list(range(64)))
    blanked = [b.meta.__class__(**{**b.meta.__dict__, "checksum": 0}) for b in chain]  # the caller's metas
    reservation = store.reserve(blanked)
    assert all(p is not None for p in reservation.pages)
    assert store.lookup([b.meta.key for b in chain]) == []  # nothing visible before the commit
    write(store, reservation, chain)
    store.check_integrity()
    assert store.commit(reservation.id) == [PutResult.STORED] * 4
    for block in chain:
        got = store.get(block.meta.key)
        assert got.meta.checksum == block.meta.checksum  # the store's own hash of what it found
        assert torch.equal(got.payload, block.payload)
    store.flush_writes()
    assert all(torch.equal(store.disk.get(b.meta.key).payload, b.payload) for b in chain)
    assert store.host.pinned_view(chain[0].meta.key)[0].numel() == chain[0].meta.nbytes
    store.check_integrity()
    store.close()


def test_present_blocks_get_no_room_and_a_commit_of_them_is_already_present(tmp_path, shm_dir) -> None:
    store = make_store(tmp_path, shm_dir)
    chain = make_chain(list(range(64)))
    store.put_many(chain[:2])
    used = store.host.used_bytes
    reservation = reserve_and_write(store, chain)
    assert [p is None for p in reservation.pages] == [True, True, False, False]
    assert store.host.used_bytes == used + 2 * 4096
    assert store.commit(reservation.id, pin=True) == [PutResult.ALREADY_PRESENT] * 2 + [PutResult.STORED] * 2
    assert all(e.pinned for e in store.entries())  # a commit's pin pins the present blocks too
    store.check_integrity()
    store.close()


def test_a_reservation_not_committed_in_time_gives_its_room_back(tmp_path, shm_dir) -> None:
    store = make_store(tmp_path, shm_dir)
    chain = make_chain(list(range(64)))
    free_before = store.host.used_bytes
    reservation = reserve_and_write(store, chain, lease_s=0.05)
    assert store.host.used_bytes == free_before + 4 * 4096
    time.sleep(0.1)
    store.expire()  # the daemon's idle maintenance
    assert store.host.used_bytes == free_before
    with pytest.raises(NotFound, match="lease"):
        store.commit(reservation.id)
    store.check_integrity()
    store.close()


def test_release_and_other_tenants_and_bad_requests(tmp_path, shm_dir) -> None:
    store = make_store(tmp_path, shm_dir)
    chain = make_chain(list(range(64)))
    reservation = store.reserve([b.meta for b in chain], tenant="alice")
    with pytest.raises(NotFound):
        store.commit(reservation.id, tenant="bob")  # another tenant cannot commit (or see) it
    assert store.release(reservation.id, tenant="alice") == 4
    with pytest.raises(NotFound):
        store.release(reservation.id, tenant="alice")
    with pytest.raises(InvalidArgument, match="twice"):
        store.reserve([chain[0].meta, chain[0].meta])
    with pytest.raises(InvalidArgument, match="shape"):
        store.reserve([chain[0].meta.__class__(**{**chain[0].meta.__dict__, "nbytes": 12})])
    assert store.host.used_bytes == 0
    store.check_integrity()
    store.close()


def test_a_reservation_the_host_tier_cannot_hold_reserves_nothing(tmp_path, shm_dir) -> None:
    store = make_store(tmp_path, shm_dir, host_blocks=4)
    chain = make_chain(list(range(16 * 6)))
    store.put_many(chain[:2], pin=True)
    with pytest.raises(CapacityExceeded):
        store.reserve([b.meta for b in chain[2:]])  # 4 more blocks in 4 pages, 2 of them pinned
    assert store.host.used_bytes == 2 * 4096
    store.check_integrity()
    store.close()


def test_bytes_written_after_the_commit_are_a_verified_miss_never_an_answer(tmp_path, shm_dir) -> None:
    store = make_store(tmp_path, shm_dir, disk=False)
    chain = make_chain(list(range(64)))
    reservation = reserve_and_write(store, chain)
    store.commit(reservation.id)
    writer = SlabWriter(store.host.slab_path)
    writer.runs(reservation.pages[1], chain[1].meta.nbytes)[0][100] ^= 0xFF  # a stray write, after the commit
    writer.close()
    assert torch.equal(store.get(chain[0].meta.key).payload, chain[0].payload)
    with pytest.raises((CorruptBlock, NotFound)):
        store.get(chain[1].meta.key)
    assert store.snapshot_counters()["verification_failures"] == 1
    assert store.lookup([b.meta.key for b in chain]) == ["host"]  # the chain stops at the damaged block
    store.check_integrity()
    store.close()


def test_pages_the_disk_writer_still_reads_are_not_reused_when_the_block_leaves_host(tmp_path, shm_dir) -> None:
    """Write-through reads a committed block's bytes from the slab, later, on the disk writer's
    thread: a block evicted from host meanwhile keeps its pages out of the free list until then."""
    store = make_store(tmp_path, shm_dir, host_blocks=8, clock=Clock())
    disk = store.disk
    with disk._cond:  # hold the writer: nothing it was given is written until released
        chain = make_chain(list(range(64)))
        reservation = reserve_and_write(store, chain)
        store.commit(reservation.id)
        store.flush(tier="host")  # the blocks leave host while their disk writes are queued
        assert store.host.used_bytes == 4 * 4096  # their pages are held, not free
        others = make_chain(list(range(1000, 1064)))
        store.put_many(others)  # takes the other 4 pages; a fifth block would find no room
        store.check_integrity()
    store.flush_writes()
    assert all(torch.equal(disk.get(b.meta.key).payload, b.payload) for b in chain)
    store.put_many(make_chain(list(range(2000, 2016))))  # the released pages are free again
    store.check_integrity()
    store.close()


def test_eviction_counts_pages_the_disk_writer_still_reads_as_freed(tmp_path, shm_dir) -> None:
    """Blocks evicted while the disk writer still reads their pages free those pages a moment later:
    making room counts them as freed, and does not go on to evict blocks that could have stayed."""
    store = make_store(tmp_path, shm_dir, host_blocks=16, clock=Clock())
    with store.disk._cond:  # hold the writer: the in-place chain's pages stay pinned
        old = make_chain(list(range(64)))  # 4 blocks, the least recently used
        store.commit(reserve_and_write(store, old).id)
        kept = make_chain(list(range(1000, 1128)))  # 8 blocks
        store.put_many(kept)
        store.put_many(make_chain(list(range(2000, 2064))))  # 4 more: past the high watermark
        assert store.lookup([b.meta.key for b in old]).count("disk") >= 3  # the LRU chain made the room
        assert store.lookup([b.meta.key for b in kept]) == ["host"] * 8, "evicted past what was needed"
        store.check_integrity()
    store.flush_writes()
    store.check_integrity()
    store.close()
