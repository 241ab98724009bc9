"""The gpu tier: blocks in fixed-size pages of one preallocated device tensor."""

from __future__ import annotations

import logging

import torch

from tiercache.config import GpuConfig
from tiercache.errors import InvalidArgument
from tiercache.pages import PageAllocator
from tiercache.page_pool import PagePool
from tiercache.tiers.paged import PagedTier

logger = logging.getLogger(__name__)


class GpuTier(PagedTier):
    """The device pool. Runs on any torch device, so tests exercise the pool logic on "cpu"."""

    def __init__(self, cfg: GpuConfig, *, device: str | torch.device | None = None) -> None:
        num_pages = cfg.capacity_bytes // cfg.page_bytes
        if num_pages < 1:
            raise InvalidArgument(f"gpu tier needs at least one page, got capacity_bytes={cfg.capacity_bytes} "
                                  f"page_bytes={cfg.page_bytes}")
        try:
            target = torch.device(cfg.device if device is None else device)
        except RuntimeError as e:
            raise InvalidArgument(f"gpu tier device {device or cfg.device!r}: {e}") from None
        if target.type == "cuda" and not torch.cuda.is_available():
            raise InvalidArgument(f"gpu tier device {target} requested but CUDA is not available")
        # zeros, not empty: the whole pool is committed at start rather than on first use.
        pool = torch.zeros((num_pages, cfg.page_bytes), dtype=torch.uint8, device=target)
        super().__init__("gpu", pool)
        logger.info("gpu pool on %s: pages=%d page_bytes=%d", target, num_pages, cfg.page_bytes)

    @property
    def device(self) -> torch.device:
        return self._pool.device

    def get_device(self, key: bytes) -> torch.Tensor:
        """The block's bytes as a new contiguous uint8 tensor on the pool's device, marking it most
        recently used. Raises NotFound if absent."""
        return self._read(self._entry(key))

    def close(self) -> None:
        # Drop the pool's memory; the tier is empty afterwards and must not be used again.
        self._entries.clear()
        self._allocator = PageAllocator(self.num_pages)
        self._pool = PagePool(torch.empty((0, self.page_bytes), dtype=torch.uint8, device=self._pool.device))
