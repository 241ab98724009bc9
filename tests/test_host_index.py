"""The host tier's shared index: published blocks are found in order, never a freed one, and a reader
in another process never takes a wrong block for a right one while the daemon recycles pages."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import mmap
import multiprocessing as mp
import pathlib
import random
import time

import numpy as np
import pytest
import torch

from tiercache.block import Block, BlockMeta
from tiercache.config import HostConfig
from tiercache.errors import InvalidArgument
from tiercache.layout import checksum
from tiercache.samehost.index import (
    MAX_EXTENTS,
    SLOT,
    VERSION,
    HostIndex,
    IndexReader,
    index_size,
    page_runs,
    slot_metas,
)
from tiercache.samehost.reader import SlabReader
from tiercache.tiers.host import HostTier

PAGE = 4096


def key_of(i: int) -> bytes:
    return hashlib.blake2b(f"indexed-{i}".encode(), digest_size=32).digest()


def payload_of(key: bytes, nbytes: int) -> torch.Tensor:
    """Bytes that follow from the key alone, so another process can check what it read."""
    seed = int.from_bytes(key[:8], "little") & 0x7FFF_FFFF
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def block_of(i: int, nbytes: int, parent: bytes = b"") -> Block:
    key = key_of(i)
    payload = payload_of(key, nbytes)
    return Block(BlockMeta(key=key, namespace=b"\x02" * 32, num_tokens=nbytes // 64, dtype="float16",
                           shape=(1, 2, 1, nbytes // 64, 16), nbytes=nbytes, checksum=checksum(payload),
                           parent=parent), payload)


@pytest.fixture
def shm_dir(tmp_path: pathlib.Path) -> pathlib.Path:
    return tmp_path


def tier_of(shm_dir: pathlib.Path, num_pages: int) -> HostTier:
    return HostTier(HostConfig(capacity_bytes=num_pages * PAGE, page_bytes=PAGE, shm_dir=str(shm_dir)))


def test_published_blocks_are_found_in_order_and_unpublished_before_their_pages_are_freed(shm_dir):
    tier = tier_of(shm_dir, 64)
    chain = [block_of(0, 2 * PAGE)]
    for i in range(1, 6):
        chain.append(block_of(i, PAGE, parent=chain[-1].meta.key))
    for block in chain:
        tier.put(block)
    index, slab = IndexReader(tier.index_path), SlabReader(tier.slab_path)
    assert index.live()
    keys = [b.meta.key for b in chain]
    found, pages_of, gens = index.find(keys + [key_of(99)], slab.generations)
    assert len(found) == 6  # the longest published prefix
    for i, (slot, block) in enumerate(zip(found, chain)):
        pages, expected = tier.locate(block.meta.key)
        assert pages_of[i][: slot["num_pages"]].tolist() == pages
        assert gens[i][: slot["num_pages"]].tolist() == expected
        parent = keys[i - 1] if i else b""
        assert slot_metas(np.asarray(slot).reshape(1), [block.meta.key], [parent])[0] == block.meta
    assert slot_metas(found, keys, [b""] + keys[:-1]) == [b.meta for b in chain]
    assert len(index.find(keys[1:], slab.generations)[0]) == 5  # any stretch of the chain
    tier.evict(keys[2])
    assert len(index.find(keys, slab.generations)[0]) == 2  # gone from the index with its pages
    tier.put(chain[2])  # back, in other pages
    found, pages_of, _ = index.find(keys, slab.generations)
    assert len(found) == 6 and pages_of[2][0] == tier.locate(keys[2])[0][0]
    tier.close()
    assert not index.live() and len(index.find(keys, slab.generations)[0]) == 0
    index.close()
    slab.close()


def test_a_chain_found_again_is_read_afresh_once_one_of_its_slots_changed(shm_dir):
    """find() answers a chain it found last from those slots while their seqs stand still; a block
    put back into the same slot with other pages must come back with its new pages."""
    tier = tier_of(shm_dir, 64)
    chain = [block_of(60, PAGE)]
    for i in range(61, 64):
        chain.append(block_of(i, PAGE, parent=chain[-1].meta.key))
    for block in chain:
        tier.put(block)
    index, slab = IndexReader(tier.index_path), SlabReader(tier.slab_path)
    keys = [b.meta.key for b in chain]
    first, first_pages, _ = index.find(keys + [key_of(98)], slab.generations)  # remembers the 4 found
    again, _, gens = index.find(keys, slab.generations)
    assert len(first) == 4 and again.tobytes() == first.tobytes()
    assert [g[0] for g in gens.tolist()] == [tier.locate(k)[1][0] for k in keys]
    tier.evict(keys[1])
    tier.put(block_of(70, PAGE))  # takes the freed page: keys[1] comes back elsewhere, in its old slot
    tier.put(chain[1])
    found, pages_of, gens = index.find(keys, slab.generations)
    pages, expected = tier.locate(keys[1])
    assert len(found) == 4 and pages_of[1][0] == pages[0] != first_pages[1][0]
    assert gens[1][0] == expected[0]
    tier.evict(keys[3])
    assert len(index.find(keys, slab.generations)[0]) == 3  # remembers those 3
    assert len(index.find(keys[:3], slab.generations)[0]) == 3  # from the remembered slots
    tier.close()
    assert len(index.find(keys[:3], slab.generations)[0]) == 0  # closed: every seq odd, remembered or not
    index.close()
    slab.close()


def test_presence_filter_says_absent_only_for_keys_in_no_tier(shm_dir):
    tier = tier_of(shm_dir, 64)
    index = IndexReader(tier.index_path)
    keys = [key_of(200 + i) for i in range(500)]
    for key in keys[:300]:
        tier._index.present(key, 1)  # what the store has the host tier do for a block in any tier
    assert all(index.maybe_present(k) for k in keys[:300])  # never a false "absent"
    false_maybe = sum(index.maybe_present(k) for k in keys[300:])
    assert false_maybe <= 2, f"{false_maybe} of 200 absent keys look present"
    for key in keys[:150]:
        tier._index.present(key, -1)
    assert all(index.maybe_present(k) for k in keys[150:300])
    assert sum(index.maybe_present(k) for k in keys[:150]) <= 2  # gone again
    assert index.live() and not index.maybe_present(keys[0])
    tier.close()
    # The daemon closed its index: live() says so, and callers check it before they trust the filter
    # (which still says keys[0] is absent) and go to the daemon.
    assert not index.live()
    index.close()  # a reader that let go of the index sends every key to the daemon
    assert all(index.maybe_present(k) for k in keys)


def test_blocks_the_index_cannot_describe_are_left_to_the_daemon(shm_dir, caplog):
    tier = tier_of(shm_dir, 64)
    singles = [block_of(10 + i, PAGE) for i in range(64)]  # the slab full of one-page blocks
    for block in singles:
        tier.put(block)
    for block in singles[::2]:  # every other page free again: no two free pages are neighbours
        tier.evict(block.meta.key)
    scattered = block_of(1, (MAX_EXTENTS + 1) * PAGE)
    tier.put(scattered)
    assert len(page_runs(tier.locate(scattered.meta.key)[0])) == MAX_EXTENTS + 1
    index, slab = IndexReader(tier.index_path), SlabReader(tier.slab_path)
    assert len(index.find([scattered.meta.key], slab.generations)[0]) == 0
    assert tier._index.num_unpublished == 1 and tier.get(scattered.meta.key).meta == scattered.meta
    assert f"its pages form {MAX_EXTENTS + 1} runs" in caplog.text  # said, not silent
    # A field wider than the slot's (a token count past 2**32 in an empty block) is not published
    # either, and no slot is left half written.
    import dataclasses

    empty = Block(dataclasses.replace(block_of(2, 0).meta, num_tokens=1 << 32, shape=(1, 2, 1, 1 << 32, 0)),
                  torch.empty(0, dtype=torch.uint8))
    assert tier.put(empty) and tier.get(empty.meta.key).meta == empty.meta
    assert tier._index.num_unpublished == 2 and len(index.find([empty.meta.key], slab.generations)[0]) == 0
    assert tier._index._fields["seq"].max() % 2 == 0
    tier.close()
    with pytest.raises(InvalidArgument, match="not a"):
        IndexReader(_junk(shm_dir))


def _junk(shm_dir: pathlib.Path) -> str:
    path = shm_dir / "junk.index"
    path.write_bytes(b"\0" * 8192)
    return str(path)


def _index_reader_process(index_path: str, slab_path: str, keys: list[bytes], nbytes: int, seconds: float,
                          out: mp.Queue) -> None:
    index, slab = IndexReader(index_path), SlabReader(slab_path)
    ok = rejected = wrong = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for key in keys:
            found, pages_of, gens = index.find([key], slab.generations)
            if not len(found):
                continue
            slot = found[0]
            count = int(slot["num_pages"])
            located = [(pages_of[0][:count].tolist(), gens[0][:count].tolist(), int(slot["nbytes"]))]
            view = slab.view_many(located, [int(slot["checksum"])])[0]
            copy = view.clone() if view is not None else None
            pages = np.array(located[0][0])
            if copy is None or not slab.unchanged(pages, np.array(located[0][1])):
                rejected += 1
            elif torch.equal(copy, payload_of(key, nbytes)):
                ok += 1
            else:
                wrong += 1
    out.put((ok, rejected, wrong))


def test_a_reader_process_never_takes_a_recycled_block_for_the_one_it_asked(shm_dir):
    """Another process reads through the index while this one evicts and re-puts blocks (all of one
    size, so freed pages are reused at once by other keys). Every read is right or rejected."""
    tier = tier_of(shm_dir, 24)
    nbytes = 2 * PAGE
    keys = [key_of(100 + i) for i in range(16)]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_index_reader_process, args=(tier.index_path, tier.slab_path, keys, nbytes, 6.0, out))
    proc.start()
    rng = random.Random(5)
    deadline = time.monotonic() + 6.0
    while time.monotonic() < deadline:
        key = rng.choice(keys)
        if tier.contains(key):
            tier.evict(key)
        else:
            while tier.used_bytes + nbytes > tier.capacity_bytes:
                tier.evict(next(iter(tier.lru_keys())))
            payload = payload_of(key, nbytes)
            tier.put(Block(BlockMeta(key=key, namespace=b"\x02" * 32, num_tokens=32, dtype="float16",
                                     shape=(1, 2, 1, 32, 32), nbytes=nbytes, checksum=checksum(payload)), payload))
    ok, rejected, wrong = out.get(timeout=60)
    proc.join(timeout=30)
    tier.check_integrity()
    tier.close()
    assert wrong == 0, f"{wrong} wrong blocks accepted ({ok} right, {rejected} rejected)"
    assert ok > 100, f"only {ok} reads got through ({rejected} rejected)"


def test_blocks_with_a_ttl_and_odd_reads_stay_with_the_daemon(tmp_path):
    """A block with a TTL is never published (a reader cannot see it expire); a 0-byte block and
    the same block twice at the very end of the slab read correctly (views and copies)."""
    from benchmarks.daemons import chain, open_store, small_config, tokens

    config = small_config(str(tmp_path), host_pages=8)
    store = open_store(config)
    try:
        timed, forever = chain(tokens(31, 1)), chain(tokens(32, 1))
        store.put_many(timed, ttl_s=60)
        store.put_many(forever)
        index, slab = IndexReader(store.host.index_path), SlabReader(store.host.slab_path)
        assert len(index.find([b.meta.key for b in timed], slab.generations)[0]) == 0
        assert len(index.find([b.meta.key for b in forever], slab.generations)[0]) == 1
        assert index.maybe_present(timed[0].meta.key)  # present: the daemon serves it
        store.remove([timed[0].meta.key])
        store.put_many(timed)  # back without a TTL: published again
        assert len(index.find([b.meta.key for b in timed], slab.generations)[0]) == 1
    finally:
        store.close()
    tier = tier_of(tmp_path, 4)
    last = block_of(7, 2 * PAGE)
    tier.put(block_of(6, 2 * PAGE))
    tier.put(last)  # pages 2 and 3: it ends where the slab ends
    empty = Block(BlockMeta(key=key_of(8), namespace=b"\x02" * 32, num_tokens=0, dtype="float16",
                            shape=(1, 2, 1, 0, 16), nbytes=0, checksum=checksum(b"")),
                  torch.empty(0, dtype=torch.uint8))
    reader = SlabReader(tier.slab_path)
    located = (*tier.locate(last.meta.key), last.meta.nbytes)
    for got in (reader.view_many([located, located], [last.meta.checksum] * 2),
                reader.read_many([located, located], checksums=[last.meta.checksum] * 2)):
        assert [g is not None and torch.equal(g, last.payload) for g in got] == [True, True]
    assert [g.numel() for g in reader.view_many([([], [], 0)], [empty.meta.checksum])] == [0]
    assert reader.view_runs(np.empty(0, np.int64), np.empty(0, np.int64), np.array([0]), np.array([0]),
                            np.array([0], np.uint64)) is None
    tier.close()


def test_find_and_view_runs_fast_paths_reject_what_the_slow_paths_reject(shm_dir):
    """A chain put in one go lies back to back in the slab (view_runs' one-reduceat path) and is
    found whole (find's list checks); a slot being written, a wrong checksum or a recycled page
    still ends the prefix or drops exactly that block."""
    tier = tier_of(shm_dir, 64)
    chain = [block_of(300, 2 * PAGE)]
    for i in range(301, 306):
        chain.append(block_of(i, 2 * PAGE, parent=chain[-1].meta.key))
    for block in chain:
        tier.put(block)
    index, slab = IndexReader(tier.index_path), SlabReader(tier.slab_path)
    keys = [b.meta.key for b in chain]

    def arrays(found, pages_of, gens):
        counts = found["num_pages"].astype(np.int64)
        pages = pages_of[:, :2].reshape(-1)
        return pages, gens[:, :2].reshape(-1), counts, found["nbytes"].astype(np.int64)

    found, pages_of, gens = index.find(keys, slab.generations)
    assert len(found) == 6
    pages, expected, counts, sizes = arrays(found, pages_of, gens)
    assert pages.tolist() == list(range(pages[0], pages[0] + 12))  # back to back: the fast path
    views = slab.view_runs(pages, expected, counts, sizes, found["checksum"].copy())
    assert [v is not None and torch.equal(v, b.payload) for v, b in zip(views, chain, strict=True)] == [True] * 6
    wrong = found["checksum"].copy()
    wrong[2] += 1
    views = slab.view_runs(pages, expected, counts, sizes, wrong)
    assert [v is None for v in views] == [False, False, True] + [False] * 3
    stale = expected.copy()
    stale[9] += 2  # block 4's second page: as if recycled since it was found
    assert [v is None for v in slab.view_runs(pages, stale, counts, sizes, found["checksum"].copy())] == \
        [False] * 4 + [True, False]
    odd = expected.copy()
    odd[0] += 1  # a page being written when found
    assert slab.view_runs(pages, odd, counts, sizes, found["checksum"].copy())[0] is None
    seq, at = tier._index._fields["seq"], tier._index._where[keys[3]]
    seq[at] += 1  # the daemon is writing slot 3: readers must not trust it
    assert len(index.find(keys, slab.generations)[0]) == 3
    seq[at] += 1
    assert len(index.find(keys, slab.generations)[0]) == 6
    assert len(index.find(keys[:2] + [key_of(999)] + keys[3:], slab.generations)[0]) == 2
    del seq  # the writer's view: the tier cannot unmap its index while one is held
    tier.close()
    index.close()
    slab.close()


def test_a_key_put_again_is_found_though_its_old_slot_still_holds_its_bytes(shm_dir):
    """Unpublishing leaves a slot's key bytes; readers take the first slot whose key word matches,
    so the daemon must put a key back into the lowest free slot, never after a stale copy of it."""
    tier = tier_of(shm_dir, 64)
    same_bucket = [bytes(8) + hashlib.blake2b(bytes([i]), digest_size=24).digest() for i in range(3)]
    a, k, b = (Block(dataclasses.replace(block_of(i, PAGE).meta, key=key), payload_of(key, PAGE))
               for i, key in enumerate(same_bucket))
    a, k, b = (Block(dataclasses.replace(x.meta, checksum=checksum(x.payload)), x.payload) for x in (a, k, b))
    tier.put(a)
    tier.put(k)  # slot 1
    tier.remove(a.meta.key)
    tier.remove(k.meta.key)  # slots 0 and 1 free; slot 1 still holds k's key bytes
    tier.put(b)  # slot 0
    tier.put(k)  # the lowest free slot is 1 again: k's live slot is its old one
    tier.remove(b.meta.key)
    tier.remove(k.meta.key)
    tier.put(k)  # slot 0 now, with the stale copy in slot 1 after it
    index, slab = IndexReader(tier.index_path), SlabReader(tier.slab_path)
    found, _, _ = index.find([k.meta.key], slab.generations)
    assert len(found) == 1 and found[0]["key"].tobytes() == k.meta.key
    tier.close()


def test_the_slot_layout_is_that_of_its_version():
    """Same-host readers of an older daemon map its slots with their own SLOT: a layout change
    (a field added to the slot, a type widened) must come with VERSION + 1, and this table with it."""
    assert VERSION == 2
    assert SLOT.itemsize == 224
    assert {name: (str(SLOT.fields[name][0]), SLOT.fields[name][1]) for name in SLOT.names} == {
        "seq": ("uint64", 0), "used": ("uint32", 8), "num_pages": ("uint32", 12), "key": ("('u1', (32,))", 16),
        "parent": ("('u1', (32,))", 48), "namespace": ("('u1', (32,))", 80), "nbytes": ("uint64", 112),
        "checksum": ("uint64", 120), "num_tokens": ("uint32", 128), "dtype": ("uint32", 132),
        "shape": ("('<u4', (5,))", 136), "extents": ("('<u4', (8, 2))", 156)}


def test_slots_written_by_0_2_read_back_and_are_written_again_byte_for_byte():
    """The slots tiercache 0.2.0 published (tests/fixtures/datadir-0.2.0) read back as their metas,
    and the current code publishes the same metas as the same bytes."""
    expected = json.loads((pathlib.Path(__file__).parent / "fixtures" / "datadir-0.2.0" / "expected.json").read_text())
    num_pages = 64
    index = HostIndex(mmap.mmap(-1, index_size(num_pages)[1]), num_pages)
    for item in expected:
        meta = BlockMeta.from_dict(item["meta"])
        old = bytes.fromhex(item["slot_hex"])
        slot = np.frombuffer(old, dtype=SLOT)
        # A slot keeps neither tenant nor preview; the reader names the keys (here the store's own).
        assert slot_metas(slot, [meta.key], [meta.parent]) == [dataclasses.replace(meta, tenant="", preview="")]
        assert index.publish(meta, item["slot_pages"])
        assert index._slots[index._where[meta.key]].tobytes() == old
    index.close()
