"""Best-effort access to the daemon: any failure is a miss, and a daemon that failed is left alone
for retry_after_s (vLLM recomputes meanwhile), then tried again on a fresh channel."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

import torch

from tiercache.client import Client
from tiercache.errors import TierCacheError
from tiercache.keys import Namespace
from tiercache.layout import DTYPE_NAMES, checksum
from tiercache.block import Block, BlockMeta

from tiercache.integrations.vllm.settings import ConnectorSettings

logger = logging.getLogger(__name__)

# What a call to a daemon that is down, slow or restarting raises; ValueError: a closed channel.
DAEMON_ERRORS = (TierCacheError, OSError, ValueError)


class DaemonLink:
    """One process's client of the daemon, used by both connector roles. Thread-safe.

    Counters (read them, never reset): num_failures, num_skipped (calls not made while the daemon
    was left alone)."""

    def __init__(self, settings: ConnectorSettings, *, timeout_ms: int | None = None,
                 client_factory: Callable[[], Client] | None = None) -> None:
        self.settings = settings
        timeout_s = (timeout_ms or settings.timeout_ms) / 1000
        self._factory = client_factory or (lambda: Client(settings.target, token=settings.read_token(),
                                                          timeout_s=timeout_s))
        self._client: Client | None = None
        self._down_until = 0.0
        self._lock = threading.Lock()
        self.num_failures = 0
        self.num_skipped = 0

    def _get(self) -> Client | None:
        if time.monotonic() < self._down_until:
            self.num_skipped += 1
            return None
        with self._lock:
            if self._client is None:
                self._client = self._factory()
            return self._client

    def _failed(self, what: str, error: Exception) -> None:
        self.num_failures += 1
        logger.warning("tiercache %s failed (%s); vLLM recomputes, daemon retried in %.1fs", what, error,
                       self.settings.retry_after_s)
        with self._lock:
            self._down_until = time.monotonic() + self.settings.retry_after_s
            client, self._client = self._client, None
        if client is not None:
            client.close()  # gRPC's own reconnect backoff grows to minutes: a fresh channel next time

    def lookup(self, chains: Sequence[Sequence[bytes]]) -> int:
        """How many leading blocks the daemon holds in every chain (one chain per rank); 0 on failure."""
        client = self._get()
        if client is None:
            return 0
        try:
            return min(len(client.lookup(list(chain))) for chain in chains)
        except DAEMON_ERRORS as e:
            self._failed("lookup", e)
            return 0

    def fetch_views(self, keys: Sequence[bytes]) -> list[Block]:
        """The cached prefix of `keys`, verified: on the same host read-only views into the daemon's
        shared memory (check still_valid() on the result after reading them), else copies; [] on failure."""
        client = self._get()
        if client is None:
            return []
        try:
            return client.fetch_views(list(keys))
        except DAEMON_ERRORS as e:
            self._failed("fetch", e)
            return []

    def fetch_into(self, keys: Sequence[bytes], outs: Sequence[torch.Tensor]) -> int:
        """Copy the cached prefix of `keys` into `outs` (each verified); how many blocks it covers."""
        client = self._get()
        if client is None:
            return 0
        try:
            return len(client.fetch_into(list(keys), outs))
        except DAEMON_ERRORS as e:
            self._failed("fetch", e)
            return 0

    def put(self, keys: Sequence[bytes], parent: bytes, payloads: Sequence[torch.Tensor], namespace: Namespace) -> bool:
        """Store one chain's blocks (each payload a contiguous CPU block tensor); whether the daemon took them."""
        client = self._get()
        if client is None:
            return False
        digest = namespace.digest()
        blocks = []
        for i, key in enumerate(keys):
            payload = payloads[i].reshape(-1).view(torch.uint8)
            meta = BlockMeta(key=key, namespace=digest, num_tokens=namespace.block_tokens,
                             dtype=DTYPE_NAMES[payloads[i].dtype], shape=tuple(payloads[i].shape),
                             nbytes=payload.numel(), checksum=checksum(payload),
                             parent=keys[i - 1] if i else parent)
            blocks.append(Block(meta, payload))
        try:
            client.put(blocks, namespace=namespace)
            return True
        except DAEMON_ERRORS as e:
            self._failed("put", e)
            return False

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()
