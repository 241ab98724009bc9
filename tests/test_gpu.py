"""Gpu tier: the shared pool contract on a CPU tensor everywhere, and on CUDA when a device is present."""

from __future__ import annotations

import pytest
import torch

from test_host import PAGE, PagedTierContract, key_of, make_block
from tiercache.config import GpuConfig
from tiercache.errors import InvalidArgument, NotFound
from tiercache.tiers.gpu import GpuTier

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
