"""TieredStore policy with real tiers: write policies, promotion, demotion, pins, TTL, and a model test."""

from __future__ import annotations

import dataclasses
import pathlib
import random

import pytest
import torch

from tests.blocks import LAYOUT, make_block, make_chain
from tiercache.config import Config, DiskConfig, GpuConfig, HostConfig
from tiercache.errors import CapacityExceeded, CorruptBlock, InvalidArgument, NotFound
from tiercache.store import PutResult, TieredStore

BLOCK = LAYOUT.nbytes()  # 4096 bytes: one 4 KiB page per block
PAGE = 4096


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def make_store(tmp: pathlib.Path, shm: pathlib.Path, *, host_blocks: int = 16, disk_blocks: int = 64,
               policy: str = "write_through", disk: bool = True, clock: Clock | None = None,
               gpu_blocks: int = 0) -> TieredStore:
    from tiercache.tiers.disk import DiskTier
    from tiercache.tiers.gpu import GpuTier
    from tiercache.tiers.host import HostTier

    cfg = Config(
        data_dir=str(tmp),
        host=HostConfig(capacity_bytes=host_blocks * PAGE, page_bytes=PAGE, shm_dir=str(shm)),
        disk=DiskConfig(enabled=disk, capacity_bytes=disk_blocks * (BLOCK + 2048), write_policy=policy),
        gpu=GpuConfig(capacity_bytes=gpu_blocks * PAGE, page_bytes=PAGE),
    )
    host = HostTier(cfg.host)
    disk_tier = DiskTier(tmp / "disk", cfg.disk, max_block_bytes=cfg.store.max_block_bytes) if disk else None
    gpu = GpuTier(cfg.gpu, device="cpu") if gpu_blocks else None  # the pool logic, on a CPU tensor
    return TieredStore(cfg, host=host, disk=disk_tier, gpu=gpu, clock=clock or Clock())


def keyof(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def test_put_get_round_trip_and_idempotent(tmp_path, shm_dir) -> None:
    store = make_store(tmp_path, shm_dir)
    chain = make_chain(list(range(64)))
    assert store.put_many(chain) == [PutResult.STORED] * 4
    assert store.put_many(chain) == [PutResult.ALREADY_PRESENT] * 4
    assert store.lookup([b.meta.key for b in chain]) == ["host"] * 4
    for b in chain:
        assert torch.equal(store.get(b.meta.key).payload, b.payload)
    store.flush_writes()
    store.check_integrity()
    assert {e.tiers for e in store.entries()} == {("host", "disk")}
    store.close()


def test_restart_serves_disk_and_promotes(tmp_path, shm_dir) -> None:
    store = make_store(tmp_path, shm_dir)
    chain = make_chain(list(range(80)))
    store.put_many(chain)
    store.pin([chain[0].meta.key])
    store.close()
    store = make_store(tmp_path, shm_dir)
    keys = [b.meta.key for b in chain]
    assert store.lookup(keys) == ["disk"] * 5
    got = list(store.fetch(keys))
    assert [torch.equal(g.payload, b.payload) for g, b in zip(got, chain)] == [True] * 5
    assert store.lookup(keys) == ["host"] * 5  # disk hits were promoted
    assert {e.meta.key for e in store.entries() if e.pinned} == {chain[0].meta.key}  # the pin, and only it, survived
    store.check_integrity()
    store.close()


def test_lookup_stops_at_first_miss(tmp_path, shm_dir) -> None:
    store = make_store(tmp_path, shm_dir)
    chain = make_chain(list(range(64)))
    store.put_many([chain[0], chain[1], chain[3]])
    assert store.lookup([b.meta.key for b in chain]) == ["host", "host"]
    assert len(list(store.fetch([b.meta.key for b in chain]))) == 2
    store.close()


def test_eviction_demotes_to_disk_and_takes_tails_first(tmp_path, shm_dir) -> None:
    store = make_store(tmp_path, shm_dir, host_blocks=8, policy="write_back")
    a = make_chain(list(range(96)))  # 6 blocks
    b = make_chain(list(range(1000, 1064)))  # 4 more: host holds 8 pages, and past 95 % evicts down to 85 %
    store.put_many(a)
    store.put_many(b)
    # Four blocks of a had to go, and they are its tail: the head of the older chain outlives it.
    # (With a longer b, all of a left host and the order could not be seen.)
    tiers_a = store.lookup([x.meta.key for x in a])
    assert tiers_a == ["host"] * 2 + ["disk"] * 4, f"tail must leave host before head, to disk: {tiers_a}"
    assert store.lookup([x.meta.key for x in b]) == ["host"] * 4
    assert store.counters["evictions_host"] == store.counters["demotions_host_to_disk"] == 4
    store.flush_writes()
    on_disk = {m.key for m, _ in store.disk.records()}
    assert on_disk == {x.meta.key for x in a[2:]}, "write_back writes exactly the demoted blocks"
    store.check_integrity()
    store.close()


def test_no_disk_eviction_drops_and_pins_hold(tmp_path, shm_dir) -> None:
    store = make_store(tmp_path, shm_dir, host_blocks=8, disk=False)
    pinned = make_block(keyof(999))
    store.put(pinned, pin=True)
    for i in range(40):
        store.put(make_block(keyof(i)))
        store.check_integrity()
    assert store.lookup([pinned.meta.key]) == ["host"]
    # Without a disk an evicted block is dropped: what is left is what host holds (8 pages; a put past
    # 95 % evicts the least recently used down to 85 % less the new block): the pin and the 6 newest.
    assert {e.meta.key for e in store.entries()} == {pinned.meta.key} | {keyof(i) for i in range(34, 40)}
    assert store.counters["evictions_host"] == 40 - 6
    store.close()


def test_full_of_pinned_is_backpressure(tmp_path, shm_dir) -> None:
    store = make_store(tmp_path, shm_dir, host_blocks=4, disk=False)
    for i in range(4):
        store.put(make_block(keyof(i)), pin=True)
    with pytest.raises(CapacityExceeded, match="host tier full"):
        store.put(make_block(keyof(100)))
    store.unpin([keyof(0)])
    assert store.put(make_block(keyof(100))) is PutResult.STORED
    store.check_integrity()
    store.close()


def test_ttl_expires_and_hit_refreshes(tmp_path, shm_dir) -> None:
    clock = Clock()
    store = make_store(tmp_path, shm_dir, clock=clock)
    a, b = make_block(keyof(1)), make_block(keyof(2))
    store.put(a, ttl_s=300)
    store.put(b, ttl_s=300)
    clock.now += 200
    store.get(a.meta.key)  # refresh a's TTL
    clock.now += 200
    assert store.lookup([a.meta.key]) == ["host"]
    assert store.lookup([b.meta.key]) == []
    assert store.expire() == 1
    with pytest.raises(NotFound):
        store.get(b.meta.key)
    store.check_integrity()
    store.close()


def test_a_present_block_put_again_restarts_its_ttl_keeping_the_longer(tmp_path, shm_dir) -> None:
    # The Put's TTL was ignored for a present block, though the proto said it still applied.
    clock = Clock()
    store = make_store(tmp_path, shm_dir, clock=clock)
    a, b, c = make_block(keyof(1)), make_block(keyof(2)), make_block(keyof(3))
    store.put_many([a, b], ttl_s=300)
    store.put(c)  # no TTL
    clock.now += 250
    assert store.put(a, ttl_s=100) == PutResult.ALREADY_PRESENT  # restarts a's 300 s, the longer
    assert store.put(b) == PutResult.ALREADY_PRESENT  # no TTL asked: b keeps until evicted
    assert store.put(c, ttl_s=10) == PutResult.ALREADY_PRESENT  # never shortens "no TTL"
    clock.now += 200
    assert store.expire() == 0
    clock.now += 101
    assert store.expire() == 1 and store.lookup([a.meta.key]) == []
    assert store.lookup([b.meta.key]) == store.lookup([c.meta.key]) == ["host"]
    store.flush_writes()
    assert {m.key: attrs["ttl_s"] for m, attrs in store.disk.records()}[b.meta.key] == 0.0  # saved for a restart
    store.check_integrity()
    store.close()


def test_bad_blocks_change_nothing(tmp_path, shm_dir) -> None:
    store = make_store(tmp_path, shm_dir)
    good = make_block(keyof(1))
    lying = dataclasses.replace(good, meta=dataclasses.replace(good.meta, checksum=good.meta.checksum ^ 1))
    with pytest.raises(CorruptBlock):
        store.put(lying)
    short = dataclasses.replace(good, payload=good.payload[:100].clone())
    with pytest.raises(InvalidArgument, match="nbytes"):
        store.put(short)
    with pytest.raises(InvalidArgument):
        store.put_many([make_block(keyof(2)), short])
    assert store.entries() == []
    store.check_integrity()
    store.close()


def test_selective_writes_after_hits(tmp_path, shm_dir) -> None:
    store = make_store(tmp_path, shm_dir, policy="selective")
    a = make_block(keyof(1))
    store.put(a)
    assert store.entries()[0].tiers == ("host",)
    store.get(a.meta.key)
    store.get(a.meta.key)
    assert store.entries()[0].tiers == ("host", "disk")
    # Fetches that read the slab without get() (descriptors, records framed from the slab) go through
    # locate_host: the same. (A worker's reads through the shared index: touch, then promote.)
    b = make_block(keyof(2))
    store.put(b)
    assert len(store.locate_host([b.meta.key])) == 1
    assert {e.meta.key: e.tiers for e in store.entries()}[b.meta.key] == ("host",)
    store.locate_host([b.meta.key])
    assert {e.meta.key: e.tiers for e in store.entries()}[b.meta.key] == ("host", "disk")
    store.flush_writes()
    assert bytes(store.disk.get(b.meta.key).payload.numpy()) == bytes(b.payload.numpy())
    store.check_integrity()
    store.close()


def test_touch_orders_the_lru_and_moves_nothing_promote_moves_what_the_reads_earned(tmp_path, shm_dir) -> None:
    """A same-host reader's reads, recorded after the fact (the daemon's Touch): touch() counts the
    hits and orders the LRU, tail first, without moving a block; promote() makes the promotions."""
    store = make_store(tmp_path, shm_dir, policy="selective")
    chain = make_chain(list(range(48)))
    keys = [b.meta.key for b in chain]
    store.put_many(chain)
    store.persist(keys)
    store.flush(tier="host")  # the chain is on disk only, as after a restart

    def tiers() -> list[tuple[str, ...]]:
        return [{e.meta.key: e.tiers for e in store.entries()}[k] for k in keys]

    assert store.touch(keys + [keyof(99)]) == 3  # the present prefix
    assert tiers() == [("disk",)] * 3, "touch moved a block"
    assert [{e.meta.key: e.hits for e in store.entries()}[k] for k in keys] == [1, 1, 1]
    assert list(store.disk.lru_keys())[-3:] == keys[::-1], "not touched tail first"
    assert store.promote(keys) == 3
    assert tiers() == [("host", "disk")] * 3
    assert store.snapshot_counters()["promotions_to_host"] == 3
    store.check_integrity()
    store.close()


def test_a_damaged_host_copy_met_by_a_promotion_leaves_the_disk_copy_to_serve(tmp_path, shm_dir) -> None:
    # The second host hit promotes the block to gpu, reading the host copy: damaged, it is dropped,
    # and the intact disk copy takes its place (promoted into host again); the chain goes on.
    store = make_store(tmp_path, shm_dir, gpu_blocks=4)
    chain = make_chain(list(range(48)))
    keys = [b.meta.key for b in chain]
    store.put_many(chain)
    store.flush_writes()
    assert len(store.locate_host(keys)) == 3
    pages, _ = store.host.locate(keys[1])
    store.host._pool.flat[pages[0] * PAGE] ^= 0xFF  # a stray write: no generation moves
    hits = {e.meta.key: e.hits for e in store.entries()}[keys[1]]
    located = store.locate_host(keys)
    assert len(located) == 3, "the chain ended at the damaged host copy though disk had the block"
    assert {e.meta.key: e.hits for e in store.entries()}[keys[1]] == hits + 1  # one access, one hit
    assert store.snapshot_counters()["verification_failures"] == 1
    assert {e.meta.key: e.tiers for e in store.entries()}[keys[1]] == ("host", "disk")
    loc = located[1]
    assert bytes(store.host.payload_view(loc.pages, loc.meta.nbytes).numpy()) == bytes(chain[1].payload.numpy())
    store.check_integrity()
    store.close()


@pytest.mark.parametrize("policy, saved", [("write_back", 6), ("selective", 2), ("write_through", 0)])
def test_a_clean_shutdown_saves_the_host_only_blocks_its_policy_keeps(tmp_path, shm_dir, policy, saved) -> None:
    # write_back writes on eviction from host: a clean shutdown (which evicts everything) lost every
    # block still in host, and under selective a pinned prefix too, which write_through keeps.
    store = make_store(tmp_path, shm_dir, policy=policy)
    pinned, other = make_chain(list(range(32))), make_chain(list(range(100, 164)))
    store.put_many(pinned, pin=True)
    store.put_many(other)
    assert store.save_host_blocks() == saved
    store.close()
    again = make_store(tmp_path, shm_dir, policy=policy)
    try:
        keys = [b.meta.key for b in pinned]
        assert again.lookup(keys) == ["disk"] * 2
        assert {e.meta.key for e in again.entries() if e.pinned} == set(keys)  # the pins came back, no others
        expected = 4 if policy != "selective" else 0
        assert again.lookup([b.meta.key for b in other]) == ["disk"] * expected
        assert bytes(again.get(keys[1]).payload.numpy()) == bytes(pinned[1].payload.numpy())
        again.check_integrity()
    finally:
        again.close()


def test_flush_by_tier_and_namespace(tmp_path, shm_dir) -> None:
    store = make_store(tmp_path, shm_dir)
    chain = make_chain(list(range(64)))
    store.put_many(chain)
    store.flush_writes()
    assert store.flush(tier="host") == 4
    assert store.lookup([b.meta.key for b in chain]) == ["disk"] * 4
    assert store.flush(namespace=b"\0" * 32) == 0
    assert store.flush(namespace=chain[0].meta.namespace) == 4
    assert store.entries() == []
    with pytest.raises(NotFound, match="gpu"):
        store.flush(tier="gpu")
    store.check_integrity()
    store.close()


@pytest.mark.parametrize("policy, disk", [("write_through", True), ("write_back", True), ("selective", True),
                                          ("write_through", False)])
def test_random_operations_against_dict_model(tmp_path, shm_dir, policy: str, disk: bool) -> None:
    """Random put/get/pin/unpin/evict/expire; present blocks always bit-identical, pins never lost,
    and with a disk big enough nothing live is ever lost."""
    clock = Clock()
    store = make_store(tmp_path, shm_dir, host_blocks=6, disk_blocks=200, policy=policy, disk=disk, clock=clock)
    rng = random.Random(f"{policy}{disk}")
    model: dict[bytes, torch.Tensor] = {}
    ttls: dict[bytes, float] = {}  # 0: none
    expires: dict[bytes, float] = {}  # 0: never
    pinned: set[bytes] = set()
    for step in range(250):
        op = rng.choice(["put", "put", "get", "pin", "unpin", "evict", "expire", "lookup"])
        key = keyof(rng.randrange(24))
        if op == "put":
            ttl = rng.choice([0, 0, 50])
            try:
                result = store.put(make_block(key), ttl_s=ttl)
            except CapacityExceeded:
                # Backpressure only when pinned blocks fill the host tier: at most 4 of its 6 pages are.
                raise AssertionError(f"step {step}: host tier full with {len(pinned)} of 6 pages pinned") from None
            if result is PutResult.STORED:
                model[key] = make_block(key).payload
                ttls[key] = ttl
            elif ttls[key]:  # present: its TTL restarts, the longer kept, and "none" is the longest
                ttls[key] = max(ttls[key], ttl) if ttl else 0
            expires[key] = clock.now + ttls[key] if ttls[key] else 0
        elif op == "get":
            try:
                got = store.get(key)
                assert torch.equal(got.payload, model[key]), f"step {step}: wrong bytes"
                if ttls[key]:  # a hit restarts the TTL
                    expires[key] = clock.now + ttls[key]
            except NotFound:
                assert key not in pinned
        elif op == "pin" and len(pinned) < 4:
            if store.pin([key]):
                pinned.add(key)
        elif op == "unpin":
            store.unpin([key])
            pinned.discard(key)
        elif op == "evict":
            store.remove([key])
            model.pop(key, None)
            pinned.discard(key)
        elif op == "expire":
            clock.now += 20
            store.expire()
        else:
            store.lookup([key])
        store.check_integrity()
        present = {e.meta.key for e in store.entries()}
        assert present <= set(model), f"step {step}: a removed block came back"
        assert pinned <= present, f"step {step}: a pinned block was evicted"
        if disk and policy == "write_through":
            live = {k for k in model if not expires[k] or expires[k] > clock.now}
            assert live <= present, f"step {step}: live blocks lost: {sorted(k[0] for k in live - present)}"
    store.close()
