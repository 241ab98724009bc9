"""Same-host transfers in place, through a real daemon on a temp socket: puts written straight into
reserved room of the slab and committed; fetches copied into the caller's own layout and verified in
the same pass; a write after the commit, a caller killed before it, and damaged pages."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from benchmarks.daemons import (
    LAYOUT,
    NS,
    REPO,
    Daemon,
    assert_intact,
    chain,
    payload_for,
    running_server,
    small_config,
    tokens,
)
from tiercache.block import PutResult
from tiercache.client import Client
from tiercache.errors import InvalidArgument, NotFound
from tiercache.samehost.writer import SlabWriter
from tiercache.tenancy import LOCAL_TENANT, scope_keys
from tiercache.v1 import tiercache_pb2 as pb


def host_used(client: Client) -> int:
    return next(t.used_bytes for t in client.stats().tiers if t.tier == "host")


def pieces(out: torch.Tensor) -> list[torch.Tensor]:
    """A block's canonical pieces (per layer K then V) as strided views into `out`, a pool block laid
    out [tokens, num_layers, 2, num_kv_heads, head_dim]: not the canonical order of its bytes."""
    return [out[:, layer, kv].transpose(0, 1) for layer in range(NS.num_layers) for kv in range(2)]


def test_a_same_host_put_is_written_in_place_once_and_read_back(base) -> None:
    with running_server(small_config(base, host_pages=128)) as (store, address), Client(address) as client:
        blocks = chain(tokens(1, 8))
        assert client.put(blocks, durable=True) == [PutResult.STORED] * 8
        assert (client.num_in_place_puts, client.num_staged_puts) == (8, 0)
        assert client.put(blocks) == [PutResult.ALREADY_PRESENT] * 8
        assert_intact(client.fetch([b.meta.key for b in blocks]))
        store.flush(tier="host")  # the disk tier wrote what the slab held
        assert_intact(client.fetch([b.meta.key for b in blocks]))
        store.check_integrity()


def test_a_chain_larger_than_the_host_tier_goes_in_place_in_parts(base) -> None:
    """More blocks than the slab holds at once: the whole chain cannot be reserved, so the put goes
    in halves, each committed before the next is reserved, and a reservation waits for the disk
    writer to give back the pages of blocks it is still copying (write_through reads them in place).
    Every block is stored once, in place, and the chain reads back intact from disk."""
    with running_server(small_config(base, host_pages=6)) as (store, address), Client(address) as client:
        blocks = chain(tokens(9, 20))  # 20 blocks of 1 page each, a slab of 6
        assert client.put(blocks) == [PutResult.STORED] * 20
        assert (client.num_in_place_puts, client.num_staged_puts, client.num_put_fallbacks) == (20, 0, 0)
        store.flush(tier="host")
        assert_intact(client.fetch([b.meta.key for b in blocks]))
        assert host_used(client) <= 6 * 4096
        store.check_integrity()


def test_a_reservation_is_written_through_its_tensors_and_committed_with_a_put_s_options(base) -> None:
    with running_server(small_config(base, host_pages=128)) as (store, address), Client(address) as client:
        blocks = chain(tokens(2, 4))
        room = client.reserve([b.meta for b in blocks], namespace=NS)
        assert len(room) == 4 and not any(room.present(i) for i in range(4))
        for i, block in enumerate(blocks):
            out = room.tensor(i)
            assert out is not None and tuple(out.shape) == LAYOUT.shape() and out.dtype == LAYOUT.torch_dtype
            out.copy_(block.payload.view(LAYOUT.torch_dtype).view(LAYOUT.shape()))  # a gather would go here
        assert client.lookup([b.meta.key for b in blocks]) == []  # nothing visible before the commit
        assert room.commit(ttl_s=0, pin=True) == [PutResult.STORED] * 4
        with pytest.raises(InvalidArgument, match="already"):
            room.commit()
        assert_intact(client.fetch([b.meta.key for b in blocks]))
        assert all(e.pinned for e in store.entries())
        assert any(ns.model == NS.model for ns in client.listing().namespaces)  # described with the Reserve
        again = client.reserve([b.meta for b in blocks])
        assert all(again.present(i) for i in range(4)) and again.tensor(0) is None
        again.release()
        store.check_integrity()


def test_a_write_after_the_commit_is_a_verified_miss_never_an_answer(base) -> None:
    config = small_config(base, host_pages=128)
    config = dataclasses.replace(config, disk=dataclasses.replace(config.disk, enabled=False))  # no other copy
    with running_server(config) as (store, address), Client(address) as client:
        blocks = chain(tokens(3, 4))
        room = client.reserve([b.meta for b in blocks])
        for i, block in enumerate(blocks):
            room.fill(i, [block.payload])
        room.commit()
        room.runs(2)[0][10] ^= 0xFF  # the caller writes into block 2's pages after its commit
        keys = [b.meta.key for b in blocks]
        got = client.fetch(keys)
        assert [b.meta.key for b in got] == keys[:2]  # the chain stops at the damaged block
        assert_intact(got)
        dest = torch.zeros(4, LAYOUT.nbytes(), dtype=torch.uint8)
        metas = client.fetch_into(keys, [dest[i] for i in range(4)])
        assert len(metas) == 2 and torch.equal(dest[1], blocks[1].payload)
        assert store.snapshot_counters().get("verification_failures", 0) >= 1


def test_a_caller_killed_between_reserve_and_commit_leaks_no_room(base) -> None:
    """SIGKILLed with its room reserved and half written: the daemon (a `tiercache serve` process, with
    its idle maintenance) takes the room back within the lease (server.reserve_lease_s) plus one
    maintenance round (server.idle_check_s)."""
    lease_s, idle_s = 1.0, 0.2
    config_path = os.path.join(base, "d.toml")
    with open(config_path, "w") as f:
        f.write(f'data_dir = "{base}/data"\n[server]\nsocket = "{base}/d.sock"\nreserve_lease_s = {lease_s}\n'
                f"idle_check_s = {idle_s}\n[host]\ncapacity_bytes = {128 * 4096}\npage_bytes = 4096\n"
                f"[disk]\ncapacity_bytes = {16 << 20}\n")
    daemon = Daemon(config=config_path)
    try:
        address = daemon.wait_ready()[0]
        with Client(address) as client:
            before = host_used(client)
            script = ("import os, signal, sys\n"
                      "from benchmarks.daemons import chain, tokens\n"
                      "from tiercache.client import Client\n"
                      "client = Client(sys.argv[1])\n"
                      "blocks = chain(tokens(4, 16))\n"
                      "room = client.reserve([b.meta for b in blocks], lease_s=60)\n"
                      "room.fill(0, [blocks[0].payload])\n"
                      "print('reserved', flush=True)\n"
                      "os.kill(os.getpid(), signal.SIGKILL)\n")
            child = subprocess.run([sys.executable, "-c", script, address], capture_output=True, text=True,
                                   timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
            killed = time.monotonic()
            assert child.returncode == -signal.SIGKILL and "reserved" in child.stdout, child.stderr
            held = host_used(client)
            assert held == before + 16 * 4096 or time.monotonic() - killed > lease_s  # held for the dead caller
            while host_used(client) != before and time.monotonic() - killed < lease_s + idle_s + 5:
                time.sleep(0.05)
            assert host_used(client) == before, "the dead caller's room was never given back"
            assert time.monotonic() - killed <= lease_s + idle_s + 1.0  # the stated bound, and some slack
            blocks = chain(tokens(4, 16))
            assert client.put(blocks) == [PutResult.STORED] * 16  # the room is there for others
        assert daemon.stop() == 0
        assert "reservation lapsed: blocks=16 pages=16" in daemon.stderr
    finally:
        daemon.kill()


def test_fetch_into_the_callers_layout_copies_and_verifies_in_one_pass(base) -> None:
    with running_server(small_config(base, host_pages=128)) as (store, address), Client(address) as client:
        blocks = chain(tokens(5, 6))
        keys = [b.meta.key for b in blocks]
        client.put(blocks)
        pool = torch.zeros(6, NS.block_tokens, NS.num_layers, 2, NS.num_kv_heads, NS.head_dim, dtype=LAYOUT.torch_dtype)
        calls = client._stub.FetchShared
        client._stub.FetchShared = None  # found through the shared index: no call
        metas = client.fetch_into(keys, [pieces(pool[i]) for i in range(6)])
        client._stub.FetchShared = calls
        assert [m.key for m in metas] == keys
        for i, block in enumerate(blocks):  # compared as bytes: random bytes make NaNs, unequal to themselves
            canonical = pool[i].permute(1, 2, 3, 0, 4).contiguous()
            assert torch.equal(canonical.view(-1).view(torch.uint8), block.payload)
        with pytest.raises(InvalidArgument, match="bytes"):  # a destination that cannot hold its block
            client.fetch_into(keys[:1], [pieces(pool[0])[:-1]])


def test_reordered_and_truncated_pages_are_caught_on_the_new_paths(base) -> None:
    with running_server(small_config(base, host_pages=128)) as (store, address), Client(address) as client:
        blocks = chain(tokens(6, 4))
        keys = [b.meta.key for b in blocks]
        client.put(blocks)
        scoped = scope_keys(LOCAL_TENANT, keys)
        pages, _ = store.host.locate(scoped[2])
        assert len(pages) == 1  # one 4 KiB page a block: reorder two blocks' pages instead
        other, _ = store.host.locate(scoped[3])
        writer = SlabWriter(store.host.slab_path)
        a, b = writer.runs(pages, 4096)[0], writer.runs(other, 4096)[0]
        a[:], b[:] = b.copy(), a.copy()  # blocks 2 and 3 swapped in the slab: each a valid block's bytes
        pool = torch.zeros(4, NS.block_tokens, NS.num_layers, 2, NS.num_kv_heads, NS.head_dim, dtype=LAYOUT.torch_dtype)
        metas = client.fetch_into(keys, [pieces(pool[i]) for i in range(4)])
        assert [m.key for m in metas] == keys[:2]
        assert [b.meta.key for b in client.fetch(keys)] == keys[:2]
        views = client.fetch_views(keys)
        assert len(views) == 2 and views.still_valid()
        # A block cut short in the slab (its last bytes gone): the same.
        writer.runs(pages, 4096)[0][2048:] = 0
        assert len(client.fetch_into(keys, [pieces(pool[i]) for i in range(4)])) == 2
        # And a reservation filled with a payload that is short of the block: refused before anything is sent.
        room = client.reserve([b.meta for b in chain(tokens(7, 1))])
        with pytest.raises(InvalidArgument, match="bytes"):
            room.fill(0, [payload_for(b"x" * 32, 100)])
        room.release()
        with pytest.raises(NotFound):  # the daemon's answer to a commit of room it no longer holds
            client._call(client._stub.Commit, pb.CommitRequest(reservation=room.id))
        with pytest.raises(InvalidArgument, match="no blocks"):
            client.reserve([])
        writer.close()
