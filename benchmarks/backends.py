"""One adapter per storage backend, each a tiercache.client.CacheClient: what tiercache's Worker calls on its client.

The baselines store the raw block tensor bytes (the canonical [layers, 2, kv_heads, tokens, head_dim]
layout) under the same 32-byte chained keys as tiercache, so only the storage differs. They verify
nothing on read (tiercache checks a checksum on every fetch): that favours the baselines, never them less.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from tiercache.block import Block, BlockMeta
from tiercache.client.protocol import CacheClient, Copies, Fetched
from tiercache.errors import InvalidArgument
from tiercache.keys import Namespace, block_keys, tail_keys
from tiercache.layout import BlockLayout, as_uint8

logger = logging.getLogger(__name__)

KINDS = ("none", "inproc", "redis", "files", "tiercache")


class _Baseline:
    """What the baselines have no use for. Their fetch copies, or hands over memory nothing recycles:
    fetch_views is fetch. No metrics endpoint: the Worker's per-request report goes nowhere. Nothing
    to pin: a baseline keeps what it stored (the benchmark's requests pin nothing anyway)."""

    def fetch(self, keys: Sequence[bytes]) -> Copies:
        raise NotImplementedError

    def fetch_views(self, keys: Sequence[bytes]) -> Copies:
        return self.fetch(keys)

    def pin(self, keys: Sequence[bytes], ttl_s: float | None = None) -> int:
        return 0

    def report(self, *, prompt_tokens: int, cached_tokens: int, ttft_s: float, prefill_s: float) -> None:
        pass


def _block(key: bytes, payload: torch.Tensor, layout: BlockLayout, digest: bytes) -> Block:
    """A Block around raw tensor bytes; the token count follows from the size (a breakpoint tail is shorter)."""
    per_token = layout.nbytes(1)
    if payload.numel() % per_token:
        raise InvalidArgument(f"stored value of {payload.numel()} bytes is not a whole number of "
                              f"{per_token}-byte tokens for key {key.hex()[:16]}")
    tokens = payload.numel() // per_token
    meta = BlockMeta(key=key, namespace=digest, num_tokens=tokens, dtype=layout.dtype, shape=layout.shape(tokens),
                     nbytes=payload.numel(), checksum=0)
    return Block(meta, payload)


class InProcessBackend(_Baseline):
    """A per-process dict key -> block tensor: what an engine's own prefix cache keeps; nothing shared."""

    tier = "host"

    def __init__(self, layout: BlockLayout, digest: bytes) -> None:
        self._layout, self._digest = layout, digest
        self._blocks: dict[bytes, torch.Tensor] = {}

    def lookup(self, keys: Sequence[bytes], *, probe: bool = False, holes: bool = False) -> list[str]:
        n = 0
        while n < len(keys) and keys[n] in self._blocks:
            n += 1
        return [self.tier] * n

    def fetch(self, keys: Sequence[bytes]) -> Copies:
        out = Copies()
        for key in keys:
            payload = self._blocks.get(key)
            if payload is None:
                break
            out.append(_block(key, payload, self._layout, self._digest))  # no copy: the engine reads its own memory
        return out

    def put(self, blocks: Sequence[Block], *, namespace: Namespace | None = None) -> None:
        for block in blocks:
            # Worker hands over fresh tensors cut from its cache, so keeping them aliases nothing.
            self._blocks.setdefault(block.meta.key, block.payload)

    def close(self) -> None:
        self._blocks.clear()


class RedisBackend(_Baseline):
    """Blocks as Redis strings over a Unix socket: a pipelined EXISTS for lookup, one MGET for the prefix."""

    tier = "host"

    def __init__(self, socket_path: str, layout: BlockLayout, digest: bytes) -> None:
        import redis  # optional: only this row needs it

        self._layout, self._digest = layout, digest
        self._redis = redis.Redis(unix_socket_path=socket_path, socket_timeout=60)

    def lookup(self, keys: Sequence[bytes], *, probe: bool = False, holes: bool = False) -> list[str]:
        pipe = self._redis.pipeline(transaction=False)
        for key in keys:
            pipe.exists(key)
        found = pipe.execute()
        n = next((i for i, hit in enumerate(found) if not hit), len(found))
        return [self.tier] * n

    def fetch(self, keys: Sequence[bytes]) -> Copies:
        out = Copies()
        for key, value in zip(keys, self._redis.mget(list(keys)) if keys else []):
            if not isinstance(value, bytes):  # None: not stored (replies are bytes: decode_responses is off)
                break
            out.append(_block(key, as_uint8(value), self._layout, self._digest))  # zero-copy view of the reply
        return out

    def put(self, blocks: Sequence[Block], *, namespace: Namespace | None = None) -> None:
        pipe = self._redis.pipeline(transaction=False)
        for block in blocks:
            pipe.set(block.meta.key, block.payload.numpy().data, nx=True)
        pipe.execute()

    def close(self) -> None:
        self._redis.close()


class FileBackend(_Baseline):
    """One file per block, named by its key: written to a temp name and renamed (atomic), read with one read."""

    tier = "disk"

    def __init__(self, directory: str, layout: BlockLayout, digest: bytes) -> None:
        self._dir, self._layout, self._digest = directory, layout, digest
        os.makedirs(directory, exist_ok=True)

    def _path(self, key: bytes) -> str:
        return os.path.join(self._dir, key.hex())

    def lookup(self, keys: Sequence[bytes], *, probe: bool = False, holes: bool = False) -> list[str]:
        n = 0
        while n < len(keys) and os.path.exists(self._path(keys[n])):
            n += 1
        return [self.tier] * n

    def fetch(self, keys: Sequence[bytes]) -> Copies:
        out = Copies()
        for key in keys:
            try:
                fd = os.open(self._path(key), os.O_RDONLY)
            except FileNotFoundError:
                break
            try:
                size = os.fstat(fd).st_size
                payload = torch.empty(size, dtype=torch.uint8)
                # One read straight into the tensor: the single copy out of the page cache.
                got = os.readv(fd, [payload.numpy().data])
            finally:
                os.close(fd)
            if got != size:
                raise InvalidArgument(f"short read of {self._path(key)}: {got} of {size} bytes")
            out.append(_block(key, payload, self._layout, self._digest))
        return out

    def put(self, blocks: Sequence[Block], *, namespace: Namespace | None = None) -> None:
        for block in blocks:
            path = self._path(block.meta.key)
            if os.path.exists(path):
                continue
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "wb") as f:
                f.write(block.payload.numpy().data)
            os.replace(tmp, path)  # readers see the whole file or none

    def close(self) -> None:
        pass


class TierCacheBackend:
    """tiercache's own Client, with the Fetch path pinned: shared memory or bytes over the stream.

    The Worker fetches with fetch_views. With `views` (shared memory only) those are read-only views
    into the daemon's slab, no copy. Without it fetch_views is fetch, which copies each block out of
    the slab into memory of its own: the like-for-like row against the baselines, whose fetch also
    ends with the bytes in the caller's own memory.
    """

    def __init__(self, address: str, shared_memory: bool, views: bool = False) -> None:
        from tiercache.client import Client

        if views and not shared_memory:
            raise InvalidArgument("views need shared memory: over the byte stream every block is a copy")
        self._client = Client(address, timeout_s=60.0, shared_memory=shared_memory, tune_allocator=True)
        self._shared_memory = shared_memory
        self._views = views

    def lookup(self, keys: Sequence[bytes], *, probe: bool = False, holes: bool = False) -> list[str]:
        return self._client.lookup(keys, probe=probe)

    def fetch(self, keys: Sequence[bytes]) -> Copies:
        return Copies(self._client.fetch(keys, shared_memory=self._shared_memory))

    def fetch_views(self, keys: Sequence[bytes]) -> Fetched:
        return self._client.fetch_views(keys) if self._views else self.fetch(keys)

    def put(self, blocks: Sequence[Block], *, namespace: Namespace | None = None) -> object:
        return self._client.put(blocks, namespace=namespace)

    def pin(self, keys: Sequence[bytes], ttl_s: float | None = None) -> int:
        return self._client.pin(keys, ttl_s=ttl_s)

    def report(self, *, prompt_tokens: int, cached_tokens: int, ttft_s: float, prefill_s: float) -> None:
        self._client.report(prompt_tokens=prompt_tokens, cached_tokens=cached_tokens, ttft_s=ttft_s,
                            prefill_s=prefill_s)

    def flush(self, tier: str | None = None) -> int:
        return self._client.flush(tier)

    def close(self) -> None:
        self._client.close()


@dataclass
class Meter:
    """What the storage calls of one worker cost, summed over every adapter it used.

    fetch_s ends when fetch returns; build_s is the Worker's kvcache.blocks_to_cache of what it
    fetched (timed by the worker process, see benchmarks/runner.py) plus, for slab views, the
    still_valid() check that follows it: fetch_s + build_s ends, in every row, with the model's
    KV cache built from the fetched blocks.
    """

    lookups: int = 0
    lookup_s: float = 0.0
    fetches: int = 0
    fetch_s: float = 0.0
    fetch_bytes: int = 0
    builds: int = 0
    build_s: float = 0.0
    puts: int = 0
    put_s: float = 0.0
    put_bytes: int = 0

    def snapshot(self) -> dict[str, float]:
        return dict(vars(self))


class Timed:
    """Wraps a backend and charges each call's wall time to a Meter (KV fetch rate = fetch_bytes / fetch_s)."""

    def __init__(self, inner: CacheClient, meter: Meter) -> None:
        self.inner, self.meter = inner, meter

    def lookup(self, keys: Sequence[bytes], *, probe: bool = False, holes: bool = False) -> list[str]:
        t0 = time.perf_counter()
        try:
            return self.inner.lookup(keys, probe=probe)
        finally:
            self.meter.lookups += 1
            self.meter.lookup_s += time.perf_counter() - t0

    def fetch(self, keys: Sequence[bytes]) -> Sequence[Block]:
        t0 = time.perf_counter()
        blocks = self.inner.fetch(keys)
        self._fetched(t0, blocks)
        return blocks

    def fetch_views(self, keys: Sequence[bytes]) -> Fetched:
        t0 = time.perf_counter()
        blocks = self.inner.fetch_views(keys)
        self._fetched(t0, blocks)
        return _CheckTimed(blocks, self.meter)

    def _fetched(self, t0: float, blocks: Iterable[Block]) -> None:
        self.meter.fetch_s += time.perf_counter() - t0
        self.meter.fetches += 1
        self.meter.fetch_bytes += sum(b.meta.nbytes for b in blocks)

    def put(self, blocks: Sequence[Block], *, namespace: Namespace | None = None) -> object:
        t0 = time.perf_counter()
        result = self.inner.put(blocks, namespace=namespace)
        self.meter.put_s += time.perf_counter() - t0
        self.meter.puts += 1
        self.meter.put_bytes += sum(b.meta.nbytes for b in blocks)
        return result

    def pin(self, keys: Sequence[bytes], ttl_s: float | None = None) -> int:
        return self.inner.pin(keys, ttl_s=ttl_s)

    def report(self, *, prompt_tokens: int, cached_tokens: int, ttft_s: float, prefill_s: float) -> None:
        self.inner.report(prompt_tokens=prompt_tokens, cached_tokens=cached_tokens, ttft_s=ttft_s, prefill_s=prefill_s)

    def close(self) -> None:
        self.inner.close()


class _CheckTimed:
    """Fetched blocks whose still_valid() is charged to the build: the Worker checks views after its
    copy into the cache, and for slab views that check is part of ending with the model's cache."""

    def __init__(self, inner: Fetched, meter: Meter) -> None:
        self._inner, self._meter = inner, meter

    def __iter__(self) -> Iterator[Block]:
        return iter(self._inner)

    def __len__(self) -> int:
        return len(self._inner)

    def still_valid(self) -> bool:
        t0 = time.perf_counter()
        try:
            return self._inner.still_valid()
        finally:
            self._meter.build_s += time.perf_counter() - t0


if TYPE_CHECKING:  # mypy checks that the wrapper the Worker is given satisfies the Protocol; nothing runs
    def _timed_is_a_cache_client(timed: Timed) -> CacheClient:
        return timed


def make_backend(spec: dict[str, Any], layout: BlockLayout, digest: bytes) -> CacheClient:
    """The backend a spec names: {"kind": "inproc"|"redis"|"files"|"tiercache", ...its location}
    (tiercache: "address", "shared_memory", and "views" for the zero-copy row)."""
    kind = spec.get("kind")
    if kind == "inproc":
        return InProcessBackend(layout, digest)
    if kind == "redis":
        return RedisBackend(spec["socket"], layout, digest)
    if kind == "files":
        return FileBackend(spec["dir"], layout, digest)
    if kind == "tiercache":
        return TierCacheBackend(spec["address"], bool(spec["shared_memory"]), bool(spec.get("views", False)))
    raise InvalidArgument(f"unknown backend kind {kind!r}; expected one of {', '.join(KINDS[1:])}")


def count_cached(store: CacheClient, namespace: Namespace, tokens: list[int], breakpoints: list[int]) -> dict[str, int]:
    """Blocks of the prompt's longest cached prefix in `store`, plus its breakpoint tails when all full blocks are."""
    keys = block_keys(namespace, tokens)
    tails = tail_keys(namespace, tokens, breakpoints, keys)
    found = len(store.lookup(keys))
    if found == len(keys):
        found += sum(len(store.lookup([key])) for key in tails.values())
    return {"found": found, "keys": len(keys) + len(tails)}
