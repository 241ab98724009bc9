"""The worker side's copies: blocks from the daemon into vLLM's paged KV before the forward pass,
and new full blocks out of it after, written back by a thread so the forward pass never waits."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from tiercache.client.protocol import Room
from tiercache.integrations.vllm.link import DaemonLink
from tiercache.integrations.vllm.packing import KVPacking
from tiercache.integrations.vllm.plan import Transfer
from tiercache.keys import Namespace

logger = logging.getLogger(__name__)


class BlockSlots:
    """Block-sized CPU tensors for write-backs, each allocated on first use and kept (touching fresh
    memory costs more than the copy). Invariant: free + taken == allocated <= capacity."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, capacity: int) -> None:
        self.shape, self.dtype, self.capacity = shape, dtype, capacity
        self._tensors: list[torch.Tensor] = []
        self._free: list[int] = []
        self._lock = threading.Lock()

    def take(self, n: int) -> list[int] | None:
        """n slot numbers, or None when fewer than n are left (nothing taken)."""
        with self._lock:
            while len(self._free) < n and len(self._tensors) < self.capacity:
                self._tensors.append(torch.empty(self.shape, dtype=self.dtype))
                self._free.append(len(self._tensors) - 1)
            if len(self._free) < n:
                return None
            taken, self._free = self._free[:n], self._free[n:]
            return taken

    def __getitem__(self, slot: int) -> torch.Tensor:
        return self._tensors[slot]

    def give(self, slots: list[int]) -> None:
        with self._lock:
            self._free.extend(slots)


@dataclass(frozen=True)
class Copied:
    """A write-back copied into kept slots, to be put by the writer thread."""

    parent: bytes
    slots: list[int]
    namespace: Namespace


class KVTransfer:
    """Loads and saves of one worker (one tensor-parallel rank).

    load() copies the blocks it can into vLLM (on the same host straight from the daemon's shared
    memory into vLLM's blocks, verified in the same pass) and returns the vLLM block ids it could not
    fill (vLLM recomputes those). save() copies blocks out at once (vLLM may reuse its blocks after
    this step): on the same host into room reserved in the daemon's slab, else into kept slots, and
    queues the commit or the write; with no slot left (`max_queue_blocks` blocks waiting) a save is
    dropped and counted.

    A block whose load failed holds zeros until vLLM recomputes it, and whatever vLLM computed over
    it meanwhile is wrong: such blocks are "unfilled" from the failed load until recomputing() names
    them (the scheduler learned of the failure and rewound the requests), and a save of blocks that
    are, or were computed over, an unfilled block is not written (the scheduler saves them again
    once recomputed: Planner.load_failed).
    Counters: num_loaded, num_load_failed, num_refetched, num_saved, num_save_dropped, num_save_unfilled
    (blocks); load_s, save_s.
    """

    def __init__(self, link: DaemonLink, packing: KVPacking, rank: int, max_queue_blocks: int) -> None:
        self.link = link
        self.packing = packing
        self.rank = rank
        self._slots = BlockSlots(packing.block_shape, packing.dtype, max_queue_blocks)
        self._staging = torch.empty(0)
        self._queue: queue.Queue[tuple[list[bytes], Copied | Room] | None] = queue.Queue()
        self._queued_blocks = 0
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._writer = threading.Thread(target=self._write_loop, name="tiercache-save", daemon=True)
        self._writer.start()
        self.num_loaded = self.num_load_failed = self.num_refetched = self.num_saved = self.num_save_dropped = 0
        self.num_save_unfilled = 0
        self._unfilled: set[int] = set()  # vLLM block ids: see the class docstring
        self.load_s = self.save_s = 0.0  # time spent in load() and in save()'s copies, on vLLM's critical path

    def load(self, transfer: Transfer) -> list[int]:
        """Copy `transfer`'s blocks into vLLM; the vLLM block ids that could not be loaded."""
        keys = transfer.chains[self.rank]
        started = time.perf_counter()
        if not keys:
            num_got = 0
        elif self.packing.device.type == "cpu":
            # Straight from the daemon's slab into vLLM's blocks, hashed in the same pass (fetch_into
            # refetches a block whose page was recycled meanwhile by itself).
            num_got = self.link.fetch_into(keys, [self.packing.pieces(b) for b in transfer.block_ids])
        else:
            num_got = self._load_views(keys, transfer.block_ids)
            if num_got < 0:  # the daemon recycled a page while it was read: copy the blocks out first
                self.num_refetched += len(keys)
                num_got = self._load_copies(keys, transfer.block_ids)
        self.num_loaded += num_got
        self.load_s += time.perf_counter() - started
        logger.debug("tiercache: loaded %d blocks of request %s in ms=%.1f", num_got, transfer.req_id,
                     (time.perf_counter() - started) * 1000)
        failed = transfer.block_ids[num_got:]
        self._unfilled.difference_update(transfer.block_ids[:num_got])
        self._unfilled.update(failed)
        if failed:
            self.num_load_failed += len(failed)
            logger.info("tiercache: %d of %d blocks of request %s could not be loaded; vLLM recomputes them",
                        len(failed), len(keys), transfer.req_id)
        return list(failed)

    def _load_views(self, keys: list[bytes], block_ids: list[int]) -> int:
        """Blocks written into vLLM from fetch_views; how many, or -1 when the views went stale."""
        blocks = self.link.fetch_views(keys)
        shape, dtype = self.packing.block_shape, self.packing.dtype
        num_got = 0
        for block, block_id in zip(blocks, block_ids):
            if block.meta.nbytes != self.packing.block_bytes:
                logger.warning("tiercache: block of %d bytes where vLLM's are %d; not loaded",
                               block.meta.nbytes, self.packing.block_bytes)
                break
            payload = block.payload
            if payload.storage_offset() % dtype.itemsize:  # not aligned for a view as `dtype`
                payload = payload.clone()
            self.packing.write(payload.view(dtype).view(shape), block_id)
            num_got += 1
        return num_got if blocks.still_valid() else -1

    def _load_copies(self, keys: list[bytes], block_ids: list[int]) -> int:
        if self._staging.shape[0] < len(keys):
            self._staging = torch.empty((len(keys), *self.packing.block_shape), dtype=self.packing.dtype)
        staging = self._staging[: len(keys)]
        num_got = self.link.fetch_into(keys, [staging[i] for i in range(len(keys))])
        self.packing.scatter(staging[:num_got], block_ids[:num_got])
        return num_got

    def recomputing(self, block_ids: Iterable[int]) -> None:
        """vLLM recomputes these blocks, whose load failed, from this step on: no longer unfilled."""
        self._unfilled.difference_update(block_ids)

    def save(self, transfer: Transfer) -> None:
        """Copy `transfer`'s blocks out of vLLM now and queue their write-back: on the same host straight
        into room reserved in the daemon's slab (one copy; only the commit is queued), else into kept slots.
        Not written when a block of it, or one it was computed over, is unfilled (see the class docstring)."""
        keys = transfer.chains[self.rank]
        if self._unfilled and not self._unfilled.isdisjoint([*transfer.prefix_block_ids, *transfer.block_ids]):
            self.num_save_unfilled += len(keys)
            logger.debug("tiercache: %d blocks of request %s computed over a failed load; written back once "
                         "vLLM has recomputed them", len(keys), transfer.req_id)
            return
        namespace = Namespace.from_dict(transfer.namespaces[self.rank])
        started = time.perf_counter()
        room = self.link.reserve(keys, transfer.parents[self.rank], namespace, self.packing.block_shape,
                                 self.packing.dtype)
        if room is not None:
            for i, block_id in enumerate(transfer.block_ids[: len(keys)]):
                if room.present(i):
                    continue
                out = room.tensor(i)
                if out is None:  # pages in several runs: read aside, then copied in
                    out = torch.empty(self.packing.block_shape, dtype=self.packing.dtype)
                    self.packing.read(block_id, out)
                    room.fill(i, [out])
                else:
                    self.packing.read(block_id, out)
            self.save_s += time.perf_counter() - started
            with self._lock:
                self._queued_blocks += len(keys)
            self._queue.put((list(keys), room))
            return
        slots = self._slots.take(len(keys))
        if slots is None:
            self.num_save_dropped += len(keys)
            logger.debug("tiercache: write-back queue full, %d blocks of request %s not stored",
                         len(keys), transfer.req_id)
            return
        for slot, block_id in zip(slots, transfer.block_ids):
            self.packing.read(block_id, self._slots[slot])
        self.save_s += time.perf_counter() - started
        with self._lock:
            self._queued_blocks += len(keys)
        self._queue.put((list(keys), Copied(transfer.parents[self.rank], slots, namespace)))

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            keys, write = item
            if isinstance(write, Copied):
                stored = self.link.put(keys, write.parent, [self._slots[slot] for slot in write.slots],
                                       write.namespace)
                self._slots.give(write.slots)
            else:
                stored = self.link.commit(write)
            with self._lock:
                self._queued_blocks -= len(keys)
                if stored:
                    self.num_saved += len(keys)
                else:
                    self.num_save_dropped += len(keys)
                self._idle.notify_all()

    def flush(self, timeout_s: float) -> bool:
        """Wait up to timeout_s for queued writes; whether the queue emptied."""
        with self._lock:
            return self._idle.wait_for(lambda: self._queued_blocks == 0, timeout=timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Finish queued writes (up to timeout_s), stop the writer, close the link."""
        self.flush(timeout_s)
        self._queue.put(None)
        self._writer.join(timeout=timeout_s)
        self.link.close()
