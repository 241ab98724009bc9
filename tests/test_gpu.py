"""Gpu tier: the shared pool contract and the device-side verification of reads, on a CPU tensor everywhere
and on CUDA when a device is present; a damaged gpu copy met through a real TieredStore."""

from __future__ import annotations

import pathlib
from collections.abc import Callable

import pytest
import torch
from test_host import PAGE, PagedTierContract, key_of, make_block
from test_store import make_store

from tests.blocks import make_chain
from tiercache.config import GpuConfig
from tiercache.device_checksum import device_checksum
from tiercache.errors import CorruptBlock, InvalidArgument, NotFound
from tiercache.tiers.gpu import GpuEntry, GpuTier


def gpu_tier(num_pages: int, device: str) -> GpuTier:
    return GpuTier(GpuConfig(capacity_bytes=num_pages * PAGE, page_bytes=PAGE), device=device)


class TestGpuTierOnCpu(PagedTierContract):
    device = "cpu"

    def new_tier(self, num_pages: int) -> GpuTier:
        return gpu_tier(num_pages, self.device)

    def test_get_device_returns_bytes_on_the_pool_device(self) -> None:
        tier = self.new_tier(8)
        block = make_block(1, 3 * PAGE + 11)
        tier.put(block)
        tier.put(make_block(2, PAGE))
        on_device = tier.get_device(key_of(1))
        assert on_device.device == tier.device and on_device.device.type == self.device
        assert on_device.is_contiguous() and on_device.dtype == torch.uint8
        assert torch.equal(on_device.cpu(), block.payload)
        assert list(tier.lru_keys()) == [key_of(2), key_of(1)]  # get_device counts as a use
        assert tier.stats().hits == 1
        with pytest.raises(NotFound):
            tier.get_device(key_of(3))
        tier.close()

    def test_each_entry_keeps_the_device_checksum_of_its_bytes(self) -> None:
        tier = self.new_tier(8)
        block = make_block(1, 2 * PAGE + 5)
        tier.put(block)
        entry = tier._entries[key_of(1)]
        assert isinstance(entry, GpuEntry) and entry.device_sum == device_checksum(block.payload)
        assert GpuTier.verifies_reads, "the store would check every gpu read again on the host"
        tier.check_integrity()
        tier.close()

    @pytest.mark.parametrize("read", ["get", "get_device"])
    @pytest.mark.parametrize("damage", ["flipped bit", "swapped pages", "stale page"])
    def test_damage_in_the_pool_is_dropped_counted_and_raised(self, read: str, damage: str) -> None:
        tier = self.new_tier(8)
        tier.put(make_block(1, PAGE))  # so that block 2's pages do not start at 0
        block = make_block(2, 3 * PAGE + 5)
        tier.put(block)
        tier.put(make_block(3, 2 * PAGE))
        pages = tier._entries[key_of(2)].pages
        pool = tier._pool.pages
        if damage == "flipped bit":
            pool[pages[2], 1234] ^= 0x10
        elif damage == "swapped pages":
            first, second = pool[pages[0]].clone(), pool[pages[1]].clone()
            pool[pages[0]], pool[pages[1]] = second, first
        else:  # the page holds what an older block left there
            pool[pages[1]] = make_block(9, PAGE).payload.to(pool.device)
        used, hits = tier.used_bytes, tier.stats().hits
        reader: Callable[[bytes], object] = getattr(tier, read)
        with pytest.raises(CorruptBlock, match="device checksum"):
            reader(key_of(2))
        stats = tier.stats()
        assert stats.verification_failures == 1 and stats.hits == hits  # no hit: nothing was served
        assert not tier.contains(key_of(2)) and tier.used_bytes == used - 4 * PAGE
        with pytest.raises(NotFound):
            reader(key_of(2))
        for i, nbytes in ((1, PAGE), (3, 2 * PAGE)):  # the neighbours are intact and still served
            assert torch.equal(tier.get(key_of(i)).payload, make_block(i, nbytes).payload)
        tier.check_integrity()
        tier.close()

    def test_bytes_past_the_block_in_its_last_page_are_not_its_damage(self) -> None:
        tier = self.new_tier(8)
        block = make_block(1, PAGE + 100)
        tier.put(block)
        tier._pool.pages[tier._entries[key_of(1)].pages[1], 100:] ^= 0xFF  # the unused rest of the page
        assert torch.equal(tier.get_device(key_of(1)).cpu(), block.payload)
        assert tier.stats().verification_failures == 0
        tier.close()

    def test_close_releases_the_pool(self) -> None:
        tier = self.new_tier(8)
        tier.put(make_block(1, PAGE))
        tier.close()
        assert tier.used_bytes == 0 and not tier.contains(key_of(1))
        tier.check_integrity()
        tier.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
class TestGpuTierOnCuda(TestGpuTierOnCpu):
    device = "cuda"

    def test_put_from_a_device_tensor(self) -> None:
        tier = self.new_tier(8)
        block = make_block(1, 2 * PAGE + 1)
        tier.put(type(block)(block.meta, block.payload.cuda()))
        assert torch.equal(tier.get(key_of(1)).payload, block.payload)
        tier.close()


def test_device_argument_overrides_config() -> None:
    tier = GpuTier(GpuConfig(capacity_bytes=4 * PAGE, page_bytes=PAGE, device="cuda:7"), device="cpu")
    assert tier.device == torch.device("cpu") and tier.num_pages == 4 and tier.name == "gpu"
    tier.close()


def test_bad_device_or_size_is_rejected() -> None:
    with pytest.raises(InvalidArgument, match="device"):
        gpu_tier(4, "no-such-device")
    with pytest.raises(InvalidArgument, match="at least one page"):
        GpuTier(GpuConfig(capacity_bytes=PAGE - 1, page_bytes=PAGE), device="cpu")
    if not torch.cuda.is_available():
        with pytest.raises(InvalidArgument, match="CUDA is not available"):
            gpu_tier(4, "cuda")


def test_a_damaged_gpu_copy_is_never_served_and_the_host_copy_serves(tmp_path: pathlib.Path,
                                                                      shm_dir: pathlib.Path) -> None:
    store = make_store(tmp_path, shm_dir, gpu_blocks=4)  # the gpu tier on a CPU tensor
    chain = make_chain(list(range(48)))
    keys = [b.meta.key for b in chain]
    store.put_many(chain)
    store.flush_writes()
    for _ in range(2):  # the second host hit promotes the block into gpu
        store.get(keys[1])
    assert store.lookup(keys) == ["host", "gpu", "host"]
    gpu = store.gpu
    assert isinstance(gpu, GpuTier)
    gpu._pool.pages[gpu._entries[keys[1]].pages[0], 77] ^= 0x01  # one bit of device memory
    got = store.get(keys[1])
    assert torch.equal(got.payload, chain[1].payload)
    assert store.snapshot_counters()["verification_failures"] == 1
    assert gpu.stats().verification_failures == 1
    # The host hit that served it earned a promotion again: a fresh copy, intact.
    assert gpu.stats().puts == 2 and {e.meta.key: e.tiers for e in store.entries()}[keys[1]] == ("gpu", "host", "disk")
    assert torch.equal(gpu.get_device(keys[1]), chain[1].payload)
    store.check_integrity()
    store.close()


def test_verify_finds_a_damaged_gpu_copy_and_keeps_the_others(tmp_path: pathlib.Path, shm_dir: pathlib.Path) -> None:
    store = make_store(tmp_path, shm_dir, gpu_blocks=4)
    chain = make_chain(list(range(32)))
    keys = [b.meta.key for b in chain]
    store.put_many(chain)
    store.flush_writes()
    for key in keys:
        for _ in range(2):
            store.get(key)
    assert store.lookup(keys) == ["gpu", "gpu"]
    gpu = store.gpu
    assert isinstance(gpu, GpuTier)
    pages = gpu._entries[keys[0]].pages
    gpu._pool.pages[pages[0], :8] = gpu._pool.pages[pages[0], 8:16].clone()  # a stale word pair
    report = store.verify()
    assert report.failed == 1 and report.dropped_keys == (keys[0],)
    assert store.lookup(keys) == ["host", "gpu"]
    assert torch.equal(store.get(keys[0]).payload, chain[0].payload)
    store.check_integrity()
    store.close()
