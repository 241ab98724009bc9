"""Host tier: pool contract, slab layout, page generations, and SlabReader in other processes."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import pathlib
import queue
import random
import struct
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tiercache.block import Block, BlockMeta
from tiercache.config import HostConfig
from tiercache.errors import CapacityExceeded, InvalidArgument, NotFound
from tiercache.layout import checksum
from tiercache.samehost.reader import SlabReader
from tiercache.tiers.host import HostTier
from tiercache.tiers.paged import PagedTier

PAGE = 4096


def key_of(i: int) -> bytes:
    return hashlib.blake2b(f"block-{i}".encode(), digest_size=32).digest()


def make_block(i: int, nbytes: int, *, seed: int | None = None) -> Block:
    """A block under key_of(i) with pseudo-random bytes (a different seed gives different bytes)."""
    gen = torch.Generator().manual_seed(i if seed is None else seed)
    payload = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    meta = BlockMeta(key=key_of(i), namespace=b"\x01" * 32, num_tokens=1, dtype="float32", shape=(nbytes,),
                     nbytes=nbytes, checksum=checksum(payload))
    return Block(meta, payload)


def pages_of(nbytes: int) -> int:
    return -(-nbytes // PAGE)


class PagedTierContract:
    """Behaviour every pooled tier shares; a subclass supplies new_tier (imported by test_gpu.py too)."""

    def new_tier(self, num_pages: int) -> PagedTier:
        raise NotImplementedError

    @pytest.fixture
    def tier(self) -> Iterator[PagedTier]:
        t = self.new_tier(8)
        yield t
        t.close()

    @pytest.mark.parametrize("nbytes", [1, PAGE - 1, PAGE, PAGE + 1, 3 * PAGE, 3 * PAGE + 5, 0])
    def test_round_trip(self, tier: PagedTier, nbytes: int) -> None:
        block = make_block(1, nbytes)
        assert tier.put(block)
        got = tier.get(block.meta.key)
        assert got.meta == block.meta
        assert got.payload.device.type == "cpu" and got.payload.is_contiguous() and got.payload.dtype == torch.uint8
        assert torch.equal(got.payload, block.payload)
        assert checksum(got.payload) == block.meta.checksum
        assert tier.used_bytes == tier.cost_bytes(block.meta) == pages_of(nbytes) * PAGE
        got.payload.fill_(7)  # a copy: scribbling on it leaves the stored block alone
        assert torch.equal(tier.get(block.meta.key).payload, block.payload)
        tier.check_integrity()

    def test_many_blocks_round_trip(self, tier: PagedTier) -> None:
        blocks = [make_block(i, n) for i, n in enumerate([PAGE + 3, 1, 2 * PAGE, PAGE - 8, 2 * PAGE - 1])]
        for b in blocks:
            assert tier.put(b)
        for b in reversed(blocks):
            assert torch.equal(tier.get(b.meta.key).payload, b.payload)
        assert tier.used_bytes == 8 * PAGE and tier.stats().num_blocks == 5
        tier.check_integrity()

    def test_put_of_present_key_changes_nothing(self, tier: PagedTier) -> None:
        assert tier.put(make_block(1, PAGE))
        assert tier.put(make_block(2, PAGE))
        assert not tier.put(make_block(1, 2 * PAGE, seed=99))
        assert list(tier.lru_keys()) == [key_of(1), key_of(2)]
        assert torch.equal(tier.get(key_of(1)).payload, make_block(1, PAGE).payload)
        assert tier.used_bytes == 2 * PAGE and tier.stats().puts == 2

    def test_capacity_exceeded_changes_nothing(self, tier: PagedTier) -> None:
        assert tier.put(make_block(1, 5 * PAGE))
        before = (list(tier.lru_keys()), tier.used_bytes, tier.stats())
        with pytest.raises(CapacityExceeded, match="full"):
            tier.put(make_block(2, 3 * PAGE + 1))
        assert (list(tier.lru_keys()), tier.used_bytes, tier.stats()) == before
        assert not tier.contains(key_of(2))
        assert tier.put(make_block(3, 3 * PAGE))  # exactly the room that is left still fits
        tier.check_integrity()

    def test_payload_length_must_match_meta(self, tier: PagedTier) -> None:
        block = make_block(1, PAGE)
        with pytest.raises(InvalidArgument, match="nbytes"):
            tier.put(Block(block.meta, block.payload[:-1]))
        assert tier.used_bytes == 0 and not tier.contains(key_of(1))
        tier.check_integrity()

    def test_payload_of_any_dtype_is_stored_as_its_bytes(self, tier: PagedTier) -> None:
        values = torch.arange(3 * 4 * 5, dtype=torch.float32).reshape(3, 4, 5)
        raw = values.reshape(-1).view(torch.uint8)
        meta = make_block(1, raw.numel()).meta
        meta = replace(meta, checksum=checksum(raw))
        assert tier.put(Block(meta, values))
        assert torch.equal(tier.get(meta.key).payload.view(torch.float32).reshape(3, 4, 5), values)

    def test_remove_and_evict_free_pages(self, tier: PagedTier) -> None:
        for i in range(4):
            assert tier.put(make_block(i, 2 * PAGE))
        with pytest.raises(CapacityExceeded):
            tier.put(make_block(9, PAGE))
        assert tier.remove(key_of(0)) and not tier.remove(key_of(0))
        assert tier.evict(key_of(1)) and not tier.evict(key_of(1))
        assert tier.used_bytes == 4 * PAGE
        stats = tier.stats()
        assert (stats.removals, stats.evictions, stats.num_blocks) == (1, 1, 2)
        assert tier.put(make_block(9, 4 * PAGE))  # the freed pages are handed out again
        assert torch.equal(tier.get(key_of(9)).payload, make_block(9, 4 * PAGE).payload)
        for i in (2, 3):
            assert torch.equal(tier.get(key_of(i)).payload, make_block(i, 2 * PAGE).payload)
        tier.check_integrity()

    def test_missing_key_raises_not_found_and_counts_a_miss(self, tier: PagedTier) -> None:
        with pytest.raises(NotFound, match=key_of(5).hex()):
            tier.get(key_of(5))
        assert tier.stats().misses == 1 and not tier.contains(key_of(5))

    def test_lru_order_follows_get_and_touch(self, tier: PagedTier) -> None:
        for i in range(3):
            tier.put(make_block(i, 10))
        tier.get(key_of(0))
        tier.touch(key_of(1))
        tier.touch(key_of(7))  # absent: no-op
        assert tier.contains(key_of(2))  # contains does not reorder
        assert list(tier.lru_keys()) == [key_of(2), key_of(0), key_of(1)]
        assert sorted(m.key for m in tier.metas()) == sorted(key_of(i) for i in range(3))
        stats = tier.stats()
        assert (stats.hits, stats.puts, stats.capacity_bytes) == (1, 3, 8 * PAGE)

    def test_random_ops_match_a_dict_model(self) -> None:
        # Hypothesis runs a function defined per call: a method shared by several test classes
        # would be one test run from several executors, which it rejects.
        @settings(max_examples=40, deadline=None)
        @given(ops=st.lists(st.tuples(st.sampled_from(["put", "get", "remove", "evict", "touch"]),
                                      st.integers(0, 5), st.integers(0, 3 * PAGE + 9)), max_size=40))
        def check(ops: list[tuple[str, int, int]]) -> None:
            tier = self.new_tier(8)
            try:
                run_against_model(tier, ops)
            finally:
                tier.close()

        check()


def run_against_model(tier: PagedTier, ops: list[tuple[str, int, int]]) -> None:
    """Apply ops to an 8-page tier and to a dict model (least recently used first); compare after each."""
    model: OrderedDict[bytes, torch.Tensor] = OrderedDict()
    for step, (op, i, nbytes) in enumerate(ops):
        key = key_of(i)
        if op == "put":
            block = make_block(i, nbytes, seed=step)
            used = sum(pages_of(p.numel()) for p in model.values())
            if key in model:
                assert not tier.put(block)
            elif used + pages_of(nbytes) > 8:
                with pytest.raises(CapacityExceeded):
                    tier.put(block)
            else:
                assert tier.put(block)
                model[key] = block.payload
        elif op == "get":
            if key in model:
                assert torch.equal(tier.get(key).payload, model[key])
                model.move_to_end(key)
            else:
                with pytest.raises(NotFound):
                    tier.get(key)
        elif op == "remove":
            assert tier.remove(key) == (model.pop(key, None) is not None)
        elif op == "evict" and model:
            victim = next(iter(tier.lru_keys()))
            assert victim == next(iter(model))
            assert tier.evict(victim)
            del model[victim]
        elif op == "touch" and key in model:
            tier.touch(key)
            model.move_to_end(key)
        tier.check_integrity()
        assert list(tier.lru_keys()) == list(model)
        assert tier.used_bytes == sum(pages_of(p.numel()) for p in model.values()) * PAGE
    for key, payload in model.items():
        assert torch.equal(tier.get(key).payload, payload)


class TestHostTierContract(PagedTierContract):
    @pytest.fixture(autouse=True)
    def _shm(self, shm_dir: pathlib.Path) -> None:
        self.shm_dir = shm_dir

    def new_tier(self, num_pages: int) -> HostTier:
        return HostTier(HostConfig(capacity_bytes=num_pages * PAGE, page_bytes=PAGE, shm_dir=str(self.shm_dir)))


def host_tier(shm_dir: pathlib.Path, num_pages: int = 8, **kwargs: object) -> HostTier:
    return HostTier(HostConfig(capacity_bytes=num_pages * PAGE, page_bytes=PAGE, shm_dir=str(shm_dir)), **kwargs)


def test_slab_file_layout_and_lifecycle(shm_dir: pathlib.Path) -> None:
    tier = host_tier(shm_dir, num_pages=400, slab_name="t.slab")
    path = tier.slab_path
    assert path == str(shm_dir / "t.slab") and tier.num_pages == 400 and tier.page_bytes == PAGE
    assert tier.header_bytes == 8192  # 4096 + 400 * 8 rounded up to a page
    assert os.path.getsize(path) == 8192 + 400 * PAGE
    with open(path, "rb") as f:
        head = f.read(40)
    assert struct.unpack("<8sIIQQQ", head) == (b"TCSLAB1\0", 1, 0, PAGE, 400, 8192)
    with pytest.raises(InvalidArgument, match="already exists"):
        host_tier(shm_dir, slab_name="t.slab")
    tier.close()
    tier.close()
    assert not os.path.exists(path)


def test_default_slab_names_are_unique(shm_dir: pathlib.Path) -> None:
    a, b = host_tier(shm_dir), host_tier(shm_dir)
    assert a.slab_path != b.slab_path and os.path.basename(a.slab_path).startswith(f"tiercache-{os.getpid()}-")
    a.close()
    b.close()


def test_bad_slab_name_or_size_is_rejected(shm_dir: pathlib.Path) -> None:
    with pytest.raises(InvalidArgument, match="slab_name"):
        host_tier(shm_dir, slab_name="../escape.slab")
    with pytest.raises(InvalidArgument, match="page_bytes"):
        HostTier(HostConfig(capacity_bytes=PAGE, page_bytes=PAGE + 4, shm_dir=str(shm_dir)))
    assert list(shm_dir.iterdir()) == []


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_slab_is_pinned_and_takes_device_payloads(shm_dir: pathlib.Path) -> None:
    tier = host_tier(shm_dir)
    block = make_block(1, 3 * PAGE + 1)
    tier.put(Block(block.meta, block.payload.cuda()))
    assert tier._pool.pages.is_pinned()  # cudaHostRegister took: device copies can be asynchronous
    pages, _ = tier.locate(key_of(1))
    on_device = tier._pool.pages[pages[0]].to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(on_device.cpu(), block.payload[:PAGE])
    assert torch.equal(tier.get(key_of(1)).payload, block.payload)
    tier.close()


def test_generations_are_even_and_bumped_by_writes_and_frees(shm_dir: pathlib.Path) -> None:
    tier = host_tier(shm_dir)
    tier.put(make_block(1, 2 * PAGE + 1))
    pages, gens = tier.locate(key_of(1))
    assert len(pages) == 3 and gens == [2, 2, 2]  # 0 -> odd during the write -> 2
    tier.remove(key_of(1))
    tier.put(make_block(2, PAGE))  # the allocator hands the last freed page out first
    pages2, gens2 = tier.locate(key_of(2))
    assert set(pages2) <= set(pages) and gens2 == [6]  # 2, +2 on free, +2 for the new write
    with pytest.raises(NotFound):
        tier.locate(key_of(1))
    tier.check_integrity()
    tier.close()


def test_reader_validates_descriptors_and_files(shm_dir: pathlib.Path) -> None:
    tier = host_tier(shm_dir)
    tier.put(make_block(1, PAGE + 5))
    pages, gens = tier.locate(key_of(1))
    reader = SlabReader(tier.slab_path)
    assert (reader.page_bytes, reader.num_pages, reader.header_bytes) == (PAGE, 8, tier.header_bytes)
    assert torch.equal(reader.read(pages, gens, PAGE + 5), make_block(1, PAGE + 5).payload)
    out = torch.empty(PAGE + 5, dtype=torch.uint8)
    assert reader.read(pages, gens, PAGE + 5, out=out) is out
    with pytest.raises(InvalidArgument, match="nbytes"):
        reader.read(pages, gens, 3 * PAGE)
    with pytest.raises(InvalidArgument, match="out of range"):
        reader.read([pages[0], 8], gens, PAGE + 5)
    with pytest.raises(InvalidArgument, match="generations"):
        reader.read(pages, gens[:1], PAGE + 5)
    with pytest.raises(InvalidArgument, match="out must be"):
        reader.read(pages, gens, PAGE + 5, out=torch.empty(PAGE, dtype=torch.uint8))
    assert reader.read(pages, [g + 1 for g in gens], PAGE + 5) is None  # odd: never valid
    with pytest.raises(NotFound):
        SlabReader(str(shm_dir / "missing.slab"))
    junk = shm_dir / "junk.slab"
    junk.write_bytes(b"x" * 3 * PAGE)
    with pytest.raises(InvalidArgument, match="bad magic"):
        SlabReader(str(junk))
    truncated = shm_dir / "short.slab"
    truncated.write_bytes(pathlib.Path(tier.slab_path).read_bytes()[: tier.header_bytes])
    with pytest.raises(InvalidArgument, match="file size"):
        SlabReader(str(truncated))
    reader.close()
    reader.close()
    tier.close()


def test_reader_reads_into_a_typed_tensor(shm_dir: pathlib.Path) -> None:
    tier = host_tier(shm_dir)
    values = torch.randn(2, 2, 3, 16, 8)
    raw = values.reshape(-1).view(torch.uint8)
    tier.put(Block(BlockMeta(key=key_of(1), namespace=b"\1" * 32, num_tokens=16, dtype="float32",
                             shape=tuple(values.shape), nbytes=raw.numel(), checksum=checksum(raw)), values))
    out = torch.empty_like(values)
    reader = SlabReader(tier.slab_path)
    assert reader.read(*tier.locate(key_of(1)), raw.numel(), out=out) is out
    assert torch.equal(out, values)
    reader.close()
    tier.close()


def test_reader_rejects_a_page_recycled_after_locate(shm_dir: pathlib.Path) -> None:
    tier = host_tier(shm_dir, num_pages=2)
    tier.put(make_block(1, 2 * PAGE))
    pages, gens = tier.locate(key_of(1))
    reader = SlabReader(tier.slab_path)
    tier.evict(key_of(1))
    assert reader.read(pages, gens, 2 * PAGE) is None  # freed, not yet rewritten
    tier.put(make_block(2, 2 * PAGE))
    assert reader.read(pages, gens, 2 * PAGE) is None  # rewritten with another block's bytes
    tier.close()
    pages, gens = [0, 1], [2, 2]
    assert reader.read(pages, gens, 2 * PAGE) is None  # a closed slab never validates
    reader.close()


def test_read_many_and_view_many_agree_with_the_blocks_and_catch_changes(shm_dir: pathlib.Path) -> None:
    tier = host_tier(shm_dir, num_pages=24)
    sizes = [PAGE, 3 * PAGE, PAGE - 8, 2 * PAGE + 16, 8]  # whole pages, a short tail, a tiny block
    blocks = [make_block(i, n) for i, n in enumerate(sizes)]
    for block in blocks:
        tier.put(block)
    tier.evict(key_of(1))  # a hole in the slab: the next block's pages are not one run
    blocks[1] = make_block(1, 5 * PAGE, seed=77)
    tier.put(blocks[1])
    located = [(*tier.locate(b.meta.key), b.meta.nbytes) for b in blocks]
    checksums = [b.meta.checksum for b in blocks]
    reader = SlabReader(tier.slab_path)
    for got in (reader.read_many(located, checksums=checksums), reader.view_many(located, checksums)):
        assert [torch.equal(g, b.payload) for g, b in zip(got, blocks)] == [True] * len(blocks)
    all_pages = np.array([p for pages, _, _ in located for p in pages])
    all_gens = np.array([g for _, gens, _ in located for g in gens])
    assert reader.unchanged(all_pages, all_gens)
    wrong = checksums[:2] + [checksums[2] ^ 1] + checksums[3:]  # what a flipped slab byte looks like
    assert [g is None for g in reader.view_many(located, wrong)] == [False, False, True, False, False]
    assert [g is None for g in reader.read_many(located, checksums=wrong)] == [False, False, True, False, False]
    tier.evict(key_of(3))
    tier.put(make_block(9, 2 * PAGE + 16))  # likely the same pages, other bytes
    assert not reader.unchanged(all_pages, all_gens)  # a view read before this must be discarded
    assert reader.view_many(located, checksums)[3] is None
    assert reader.view_many([], []) == [] and reader.read_many([]) == []
    reader.close()
    tier.close()
    assert not reader.unchanged(all_pages, all_gens)


class _ProbingHostTier(HostTier):
    """Runs a reader at the moment the daemon has written half a block, as a racing worker might."""

    probe: tuple[SlabReader, list[int], list[int], int] | None = None
    results: list[torch.Tensor | None]

    def _end_write(self, pages: Sequence[int]) -> None:
        if self.probe is not None:
            reader, located_pages, gens, nbytes = self.probe
            self.results.append(reader.read(located_pages, gens, nbytes))
        super()._end_write(pages)


def test_reader_rejects_a_page_while_it_is_written(shm_dir: pathlib.Path) -> None:
    tier = _ProbingHostTier(HostConfig(capacity_bytes=2 * PAGE, page_bytes=PAGE, shm_dir=str(shm_dir)))
    tier.results = []
    tier.put(make_block(1, 2 * PAGE))
    pages, gens = tier.locate(key_of(1))
    tier.remove(key_of(1))
    reader = SlabReader(tier.slab_path)
    # Generations that match what the page will have after the write: only oddness can reject it.
    tier.probe = (reader, pages, [g + 2 for g in gens], 2 * PAGE)
    tier.put(make_block(2, 2 * PAGE))
    assert tier.results == [None]
    tier.probe = None
    assert torch.equal(reader.read(*tier.locate(key_of(2)), 2 * PAGE), make_block(2, 2 * PAGE).payload)
    reader.close()
    tier.close()


def _reader_process(inbox: mp.Queue, outbox: mp.Queue, counts: Sequence[int], slot: int) -> None:
    """A worker process (spawned): serves ("read", path, descriptors), ("hammer", path) and ("exit",)."""
    while True:
        cmd, *args = inbox.get()
        if cmd == "exit":
            return
        if cmd == "stop":  # sent at teardown in case a failed test left us hammering
            continue
        reader = SlabReader(args[0])
        if cmd == "read":
            out = [reader.read(pages, gens, nbytes) for pages, gens, nbytes in args[1]]
            outbox.put([None if t is None else t.numpy().tobytes() for t in out])
        elif cmd == "hammer":
            outbox.put("ready")
            outbox.put(_hammer(reader, inbox, counts, slot))
        reader.close()


def _hammer(reader: SlabReader, inbox: mp.Queue, counts: Sequence[int], slot: int) -> list[int]:
    """Read the newest located block over and over until ("stop",) arrives.

    Tallies, also published live in counts[slot:slot+4]: reads with the right bytes, reads rejected,
    rejected reads whose copied bytes were wrong (what the seqlock caught), reads with wrong bytes.
    """
    current = None
    tallies = [0, 0, 0, 0]
    while True:
        try:
            while True:  # drain to the newest descriptor
                msg = inbox.get_nowait()
                if msg[0] == "stop":
                    return tallies
                current = msg[1:]
        except queue.Empty:
            pass
        if current is None:
            time.sleep(0.001)
            continue
        pages, gens, nbytes, expected_sum, expected = current
        out = torch.empty(nbytes, dtype=torch.uint8)
        got = reader.read(pages, gens, nbytes, out=out)
        if got is None:
            tallies[1] += 1
            tallies[2] += checksum(out) != expected_sum
        elif checksum(got) == expected_sum and got.numpy().tobytes() == expected:
            tallies[0] += 1
        else:
            tallies[3] += 1
        counts[slot : slot + 4] = tallies


@dataclass
class ReaderProcess:
    process: mp.process.BaseProcess
    inbox: mp.Queue
    outbox: mp.Queue


@pytest.fixture(scope="module")
def readers() -> Iterator[tuple[list[ReaderProcess], Sequence[int]]]:
    """Two worker processes, started once (spawn: a fresh interpreter, as a real worker would be)."""
    ctx = mp.get_context("spawn")
    counts = ctx.Array("q", 8, lock=False)
    procs = []
    for r in range(2):
        inbox, outbox = ctx.Queue(), ctx.Queue()
        proc = ctx.Process(target=_reader_process, args=(inbox, outbox, counts, 4 * r), daemon=True)
        proc.start()
        procs.append(ReaderProcess(proc, inbox, outbox))
    yield procs, counts
    for rp in procs:
        rp.inbox.put(("stop",))
        rp.inbox.put(("exit",))
    for rp in procs:
        rp.process.join(timeout=30)
        if rp.process.is_alive():
            rp.process.kill()
    assert all(rp.process.exitcode == 0 for rp in procs)


def test_reader_in_another_process_reads_blocks_bit_identical(
        shm_dir: pathlib.Path, readers: tuple[list[ReaderProcess], Sequence[int]]) -> None:
    tier = host_tier(shm_dir, num_pages=16)
    blocks = [make_block(i, n) for i, n in enumerate([1, PAGE, 3 * PAGE + 7, 5 * PAGE - 1])]
    for b in blocks:
        tier.put(b)
    fillers = [make_block(100 + i, PAGE) for i in range(5)]  # one page each: the slab is full
    for b in fillers:
        tier.put(b)
    for key in (key_of(1), key_of(101), key_of(103)):  # three single-page holes, apart
        tier.remove(key)
    blocks[1] = make_block(1, 2 * PAGE + 3, seed=42)  # 3 pages: the allocator has no run that long
    tier.put(blocks[1])
    descriptors = [(*tier.locate(b.meta.key), b.meta.nbytes) for b in blocks]
    assert sorted(descriptors[1][0]) != list(range(min(descriptors[1][0]), max(descriptors[1][0]) + 1))
    worker = readers[0][0]
    worker.inbox.put(("read", tier.slab_path, descriptors))
    assert worker.outbox.get(timeout=60) == [b.payload.numpy().tobytes() for b in blocks]
    tier.close()


def test_concurrent_readers_never_get_wrong_bytes_while_pages_recycle(
        shm_dir: pathlib.Path, readers: tuple[list[ReaderProcess], Sequence[int]]) -> None:
    """Two reader processes hammer located blocks while this process evicts and re-puts blocks with
    different bytes into the same pages. Every read is either exactly right or rejected."""
    procs, counts = readers
    tier = host_tier(shm_dir, num_pages=48)
    for rp in procs:
        rp.inbox.put(("hammer", tier.slab_path))
    for rp in procs:
        assert rp.outbox.get(timeout=60) == "ready"
    rng = random.Random(0)
    model: dict[bytes, Block] = {}
    deadline = time.monotonic() + 30
    rounds = 0
    try:
        while time.monotonic() < deadline:
            live = [counts[r : r + 4] for r in (0, 4)]
            if rounds >= 150 and all(t[0] >= 30 and t[1] >= 30 and t[2] >= 1 for t in live):
                break
            if model:
                block = model[rng.choice(sorted(model))]
                pages, gens = tier.locate(block.meta.key)
                for rp in procs:
                    rp.inbox.put(("block", pages, gens, block.meta.nbytes, block.meta.checksum,
                                  block.payload.numpy().tobytes()))
                time.sleep(rng.random() * 0.002)
            # Recycle: evict least recently used blocks until a new one with fresh bytes fits.
            new = make_block(rounds, rng.randint(6 * PAGE, 12 * PAGE), seed=1000 + rounds)
            while tier.used_bytes + tier.cost_bytes(new.meta) > tier.capacity_bytes:
                victim = next(iter(tier.lru_keys()))
                tier.evict(victim)
                del model[victim]
            tier.put(new)
            model[new.meta.key] = new
            tier.check_integrity()
            rounds += 1
    finally:
        for rp in procs:
            rp.inbox.put(("stop",))
        tallies = [rp.outbox.get(timeout=60) for rp in procs]
    assert all(t[3] == 0 for t in tallies), f"a reader got wrong bytes: {tallies}"
    assert all(t[0] >= 30 for t in tallies), f"too few good reads: {tallies}"
    assert all(t[1] >= 30 and t[2] >= 1 for t in tallies), f"recycling never invalidated a read: {tallies}"
    tier.close()


def test_orphan_slab_of_dead_process_is_removed(shm_dir) -> None:
    import subprocess
    import sys

    from tiercache.samehost.slab import remove_orphan_slabs

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    orphan = shm_dir / f"tiercache-{int(dead.stdout)}-abcdef012345.slab"
    orphan.write_bytes(b"x" * 4096)
    mine = shm_dir / f"tiercache-{os.getpid()}-abcdef012345.slab"
    mine.write_bytes(b"x")
    assert remove_orphan_slabs(str(shm_dir)) == [orphan.name]
    assert not orphan.exists() and mine.exists()
