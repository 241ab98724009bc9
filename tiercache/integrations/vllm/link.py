"""The connector's calls to the daemon, best effort (tiercache.client.best_effort): any failure is a
miss, and a daemon that failed is left alone for a while (vLLM recomputes meanwhile), then tried
again on a fresh channel."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import torch

from tiercache.block import Block, BlockMeta
from tiercache.client import Client
from tiercache.client.best_effort import BestEffort
from tiercache.client.protocol import Copies, Fetched, Room
from tiercache.errors import InvalidArgument, Unimplemented
from tiercache.integrations.vllm.settings import ConnectorSettings
from tiercache.keys import Namespace
from tiercache.layout import DTYPE_NAMES, checksum

# What fetch_into writes one block into (Client.fetch_into).
Destination = torch.Tensor | np.ndarray | Sequence[torch.Tensor] | Sequence[np.ndarray]


class DaemonLink:
    """One process's client of the daemon, used by both connector roles. Thread-safe.

    A daemon that failed is left alone for settings.retry_after_s, longer in a long outage
    (BestEffort). Counters (read them, never reset): num_failures, num_skipped (calls not made
    while the daemon was left alone)."""

    def __init__(self, settings: ConnectorSettings, *, timeout_ms: int | None = None,
                 client_factory: Callable[[], Client] | None = None) -> None:
        self.settings = settings
        timeout_s = (timeout_ms or settings.timeout_ms) / 1000
        factory = client_factory or (lambda: Client(settings.target, token=settings.read_token(),
                                                    timeout_s=timeout_s))
        self._daemon = BestEffort(factory, settings.retry_after_s)

    @property
    def num_failures(self) -> int:
        return self._daemon.num_failures

    @property
    def num_skipped(self) -> int:
        return self._daemon.num_skipped

    def lookup(self, chains: Sequence[Sequence[bytes]]) -> int:
        """How many leading blocks the daemon holds in every chain (one chain per rank); 0 on failure."""
        return self._daemon.call("lookup", lambda client: min(len(client.lookup(list(chain))) for chain in chains), 0)

    def fetch_views(self, keys: Sequence[bytes]) -> Fetched:
        """The cached prefix of `keys`, verified: on the same host read-only views into the daemon's
        shared memory (check still_valid() on the result after reading them), else copies; none on failure."""
        nothing: Fetched = Copies()
        return self._daemon.call("fetch", lambda client: client.fetch_views(list(keys)), nothing)

    def fetch_into(self, keys: Sequence[bytes], outs: Sequence[Destination]) -> int:
        """Copy the cached prefix of `keys` into `outs` (each a contiguous tensor, or the pieces of a
        block in vLLM's own layout: see Client.fetch_into), each verified; how many blocks it covers."""
        return self._daemon.call("fetch", lambda client: len(client.fetch_into(list(keys), outs)), 0)

    def reserve(self, keys: Sequence[bytes], parent: bytes, namespace: Namespace, shape: tuple[int, ...],
                dtype: torch.dtype) -> Room | None:
        """Room in the daemon's slab for one chain's blocks (each of `shape` and `dtype`), to copy them
        into and commit; None when puts in place do not work from here or the daemon failed."""
        digest = namespace.digest()
        nbytes = dtype.itemsize * math.prod(shape)
        metas = [BlockMeta(key=key, namespace=digest, num_tokens=namespace.block_tokens, dtype=DTYPE_NAMES[dtype],
                           shape=shape, nbytes=nbytes, checksum=0, parent=keys[i - 1] if i else parent)
                 for i, key in enumerate(keys)]

        def reserve(client: Client) -> Room | None:
            if not client.puts_in_place:
                return None
            try:
                return client.reserve(metas, namespace=namespace)
            except (InvalidArgument, Unimplemented):  # not from here after all: puts_in_place says so now
                return None
        return self._daemon.call("reserve", reserve, None)

    def commit(self, room: Room) -> bool:
        """Store what was copied into `room`; whether the daemon took it."""
        return self._daemon.call("commit", lambda client: bool(room.commit()), False)

    def put(self, keys: Sequence[bytes], parent: bytes, payloads: Sequence[torch.Tensor], namespace: Namespace) -> bool:
        """Store one chain's blocks (each payload a contiguous CPU block tensor); whether the daemon took them."""
        return self._daemon.call("put", lambda client: self._put(client, keys, parent, payloads, namespace), False)

    def _put(self, client: Client, keys: Sequence[bytes], parent: bytes, payloads: Sequence[torch.Tensor],
             namespace: Namespace) -> bool:
        digest = namespace.digest()
        blocks = []
        for i, key in enumerate(keys):
            payload = payloads[i].reshape(-1).view(torch.uint8)
            meta = BlockMeta(key=key, namespace=digest, num_tokens=namespace.block_tokens,
                             dtype=DTYPE_NAMES[payloads[i].dtype], shape=tuple(payloads[i].shape),
                             nbytes=payload.numel(), checksum=checksum(payload),
                             parent=keys[i - 1] if i else parent)
            blocks.append(Block(meta, payload))
        client.put(blocks, namespace=namespace)
        return True

    def close(self) -> None:
        self._daemon.close()
