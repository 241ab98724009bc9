"""The worker side's copies: blocks from the daemon into vLLM's paged KV before the forward pass,
and new full blocks out of it after, written back by a thread so the forward pass never waits."""

from __future__ import annotations

import logging
import queue
import threading

import torch

from tiercache.keys import Namespace

from tiercache.integrations.vllm.link import DaemonLink
from tiercache.integrations.vllm.packing import KVPacking
from tiercache.integrations.vllm.plan import Transfer

logger = logging.getLogger(__name__)


class KVTransfer:
    """Loads and saves of one worker (one tensor-parallel rank).

    load() copies the blocks it can into vLLM and returns the vLLM block ids it could not fill
    (vLLM recomputes those). save() copies blocks out at once (vLLM may reuse them after this step)
    and queues the write; past `max_queue_blocks` queued blocks a save is dropped and counted.
    Counters: num_loaded, num_load_failed, num_saved, num_save_dropped (blocks).
    """

    def __init__(self, link: DaemonLink, packing: KVPacking, rank: int, max_queue_blocks: int) -> None:
        self.link = link
        self.packing = packing
        self.rank = rank
        self.max_queue_blocks = max_queue_blocks
        self._staging = torch.empty(0)
        self._queue: queue.Queue[tuple[list[bytes], bytes, torch.Tensor, Namespace] | None] = queue.Queue()
        self._queued_blocks = 0
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._writer = threading.Thread(target=self._write_loop, name="tiercache-save", daemon=True)
        self._writer.start()
        self.num_loaded = self.num_load_failed = self.num_saved = self.num_save_dropped = 0

    def _staging_for(self, n: int) -> torch.Tensor:
        """A CPU buffer for n blocks, grown when needed and kept (allocated once per size reached)."""
        if self._staging.shape[0] < n:
            self._staging = torch.empty((n, *self.packing.block_shape), dtype=self.packing.dtype)
        return self._staging[:n]

    def load(self, transfer: Transfer) -> list[int]:
        """Copy `transfer`'s blocks into vLLM; the vLLM block ids that could not be loaded."""
        keys = transfer.chains[self.rank]
        staging = self._staging_for(len(keys))
        num_got = self.link.fetch_into(keys, [staging[i] for i in range(len(keys))]) if keys else 0
        if num_got:
            self.packing.scatter(staging[:num_got], transfer.block_ids[:num_got])
        self.num_loaded += num_got
        failed = transfer.block_ids[num_got:]
        if failed:
            self.num_load_failed += len(failed)
            logger.info("tiercache: %d of %d blocks of request %s could not be loaded; vLLM recomputes them",
                        len(failed), len(keys), transfer.req_id)
        return list(failed)

    def save(self, transfer: Transfer) -> None:
        """Copy `transfer`'s blocks out of vLLM now and queue their write-back."""
        keys = transfer.chains[self.rank]
        with self._lock:
            if self._queued_blocks + len(keys) > self.max_queue_blocks:
                self.num_save_dropped += len(keys)
                logger.debug("tiercache: write-back queue full, %d blocks of request %s not stored",
                             len(keys), transfer.req_id)
                return
            self._queued_blocks += len(keys)
        payloads = self.packing.gather(transfer.block_ids)
        namespace = Namespace.from_dict(transfer.namespaces[self.rank])
        self._queue.put((list(keys), transfer.parents[self.rank], payloads, namespace))

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            keys, parent, payloads, namespace = item
            if payloads.device.type != "cpu":
                payloads = payloads.cpu()
            stored = self.link.put(keys, parent, payloads, namespace)
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
