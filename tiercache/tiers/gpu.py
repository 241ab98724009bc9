"""The gpu tier: blocks in fixed-size pages of one preallocated device tensor, checked on the device."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from tiercache.block import Block
from tiercache.config import GpuConfig
from tiercache.device_checksum import device_checksum
from tiercache.errors import CorruptBlock, InvalidArgument, NotFound
from tiercache.page_pool import PagePool, payload_bytes
from tiercache.pages import PageAllocator
from tiercache.tiers.paged import PagedEntry, PagedTier

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GpuEntry(PagedEntry):
    """A PagedEntry with the device_checksum of the block's bytes, taken as they entered the pool."""

    device_sum: int = 0


class GpuTier(PagedTier):
    """The device pool. Runs on any torch device, so tests exercise the pool logic on "cpu".

    Every block is checksummed on the device when it enters (device_checksum, kept in its GpuEntry)
    and checked on the device when it leaves (get, get_device): a damaged copy is dropped, counted in
    verification_failures and raised as CorruptBlock, so the store need not re-check it with XXH3 on
    the host (verifies_reads). Invariant (check_integrity): every entry is a GpuEntry.
    """

    verifies_reads = True

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

    def put(self, block: Block) -> bool:
        if block.meta.key in self._entries:
            return False
        # Onto the device first (a no-op for a payload already there), so that the checksum is taken
        # where it will be checked, from the bytes the pool receives: one device-to-device copy more
        # than a scatter straight from the host, which is small beside the checksum's own passes.
        src = payload_bytes(block.payload).to(self.device)
        if not super().put(Block(block.meta, src)):
            return False
        entry = self._entries[block.meta.key]
        # Assigning to a present key keeps its place in the LRU order.
        self._entries[block.meta.key] = GpuEntry(entry.meta, entry.pages, entry.index, device_checksum(src))
        return True

    def get(self, key: bytes) -> Block:
        entry, payload = self._verified_read(key)
        return Block(entry.meta, payload if payload.device.type == "cpu" else payload.cpu())

    def get_device(self, key: bytes) -> torch.Tensor:
        """The block's bytes, verified on the device, as a new contiguous uint8 tensor on the pool's
        device, marking it most recently used. Raises NotFound if absent; CorruptBlock (the copy
        dropped and counted) if it fails its checksum."""
        return self._verified_read(key)[1]

    def _verified_read(self, key: bytes) -> tuple[GpuEntry, torch.Tensor]:
        """The entry and its bytes on the device, checked against the checksum taken at put; only an
        intact read counts as a hit and a use (as on the disk tier)."""
        entry = self._entries.get(key)
        if entry is None:
            self._stats.misses += 1
            raise NotFound(f"block {key.hex()} is not in the {self.name} tier")
        assert isinstance(entry, GpuEntry), f"gpu entry {key.hex()} has no device checksum"
        payload = self._read(entry)
        if device_checksum(payload) != entry.device_sum:
            logger.warning("gpu tier on %s: dropped block %s that failed its device checksum", self.device, key.hex())
            self._stats.verification_failures += 1
            self._drop(key)
            raise CorruptBlock(f"gpu copy of block {key.hex()[:16]} fails its device checksum")
        self._stats.hits += 1
        self._entries.move_to_end(key)
        return entry, payload

    def check_integrity(self) -> None:
        super().check_integrity()
        for key, entry in self._entries.items():
            assert isinstance(entry, GpuEntry), f"gpu entry {key.hex()} has no device checksum"

    def close(self) -> None:
        # Drop the pool's memory; the tier is empty afterwards and must not be used again.
        self._entries.clear()
        self._allocator = PageAllocator(self.num_pages)
        self._pool = PagePool(torch.empty((0, self.page_bytes), dtype=torch.uint8, device=self._pool.device))
