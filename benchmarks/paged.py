"""LMCache's benchmark shape against a same-host daemon: a prompt's KV gathered out of a vLLM-shaped
paged pool and stored, then looked up, fetched and scattered into the pool again, verified.

The pool is vLLM's FLASH_ATTN layout on the CPU: per layer a K and a V tensor [num_blocks,
block_tokens, num_kv_heads, head_dim]; a block of the prompt sits at a pool block chosen at random,
and a block in the canonical layout [num_layers, 2, num_kv_heads, tokens, head_dim] is gathered from
(scattered to) 2 x num_layers strided views of it. Each path ends its timed window in the same state:
the chain stored (store), or the chain's bytes in the pool at fresh block ids and verified (retrieve).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from tiercache.block import Block, BlockMeta
from tiercache.client import Client
from tiercache.keys import Namespace, block_keys
from tiercache.layout import BlockLayout, checksum

PUT_ALONE = "put alone: reserve + commit"
GPT2 = Namespace(model="gpt2", weights="bench-paged", dtype="float32", num_layers=12, num_kv_heads=12, head_dim=64,
                 block_tokens=16)


class PagedPool:
    """A paged KV pool in vLLM's FLASH_ATTN layout, and the views of one of its blocks in the
    canonical order (layer by layer, K then V, each [num_kv_heads, tokens, head_dim], strided)."""

    def __init__(self, ns: Namespace, num_blocks: int) -> None:
        self.layout = BlockLayout.of(ns)
        shape = (num_blocks, ns.block_tokens, ns.num_kv_heads, ns.head_dim)
        dtype = self.layout.torch_dtype
        self.layers = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(ns.num_layers)]
        # numpy views of each layer's K and V, made once: a block's pieces are then cheap slices of
        # them (a torch view and .numpy() per piece cost as much as copying it, at these sizes).
        self._numpy = [kv.numpy() for layer in self.layers for kv in layer]
        self.num_blocks = num_blocks

    def views(self, block_id: int) -> list[torch.Tensor]:
        """Block `block_id`'s 2 x num_layers pieces, canonical order; writing them writes the pool."""
        return [kv[block_id].transpose(0, 1) for layer in self.layers for kv in layer]

    def arrays(self, block_id: int) -> list[np.ndarray]:
        """views() as numpy arrays (numpy's strided copy beats torch's copy_ per piece here)."""
        return [kv[block_id].transpose(1, 0, 2) for kv in self._numpy]

    def fill_random(self, block_ids: list[int], seed: int) -> None:
        rng = torch.Generator().manual_seed(seed)
        for block_id in block_ids:
            for view in self.views(block_id):
                view.copy_(torch.randn(view.shape, generator=rng))

    def gather(self, block_id: int, out: np.ndarray) -> None:
        """Block `block_id` into `out`, the canonical block's bytes (a contiguous array of them)."""
        shape = self.layers[0][0].shape
        pieces = out.view(self._numpy[0].dtype).reshape(-1, shape[2], shape[1], shape[3])
        for piece, view in zip(pieces, self.arrays(block_id)):
            np.copyto(piece, view)

    def scatter(self, block_id: int, src: torch.Tensor) -> None:
        """The canonical block `src` into block `block_id` of the pool."""
        for piece, view in zip(src.numpy().reshape(-1, *src.shape[2:]), self.arrays(block_id)):
            np.copyto(view, piece)

    def equal(self, a: int, b: int) -> bool:
        return all(torch.equal(x, y) for x, y in zip(self.views(a), self.views(b)))


@dataclasses.dataclass
class Paths:
    """The timed paths, each a callable that does the whole work once and returns what it stored or
    fetched (blocks); `setup` runs before each repetition, untimed (evictions, fresh state)."""

    store: dict[str, Callable[[], int]]
    retrieve: dict[str, Callable[[], int]]


class Prompt:
    """One prompt's chain of blocks in a pool: its tokens, keys, where each block sits (`source`) and
    where a retrieve puts it (`target`)."""

    def __init__(self, ns: Namespace, pool: PagedPool, num_tokens: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.ns, self.pool = ns, pool
        self.tokens = rng.integers(3, 50_000, num_tokens).tolist()
        self.keys = block_keys(ns, self.tokens)
        n = len(self.keys)
        ids = rng.permutation(pool.num_blocks).tolist()
        self.source, self.target = ids[:n], ids[n : 2 * n]
        pool.fill_random(self.source, seed)
        self.layout = BlockLayout.of(ns)
        self.digest = ns.digest()

    def metas(self, checksums: list[int]) -> list[BlockMeta]:
        shape, nbytes = self.layout.shape(), self.layout.nbytes()
        return [BlockMeta(key=key, namespace=self.digest, num_tokens=self.ns.block_tokens, dtype=self.ns.dtype,
                          shape=shape, nbytes=nbytes, checksum=sums, parent=parent)
                for key, sums, parent in zip(self.keys, checksums, [b""] + self.keys[:-1])]

    # ---- store ----------------------------------------------------------------------------------

    def store_by_put(self, client: Client) -> int:
        """Gather each block into a tensor of its own, checksum it, Client.put the chain."""
        outs = [torch.empty(self.layout.shape(), dtype=self.layout.torch_dtype) for _ in self.keys]
        for block_id, out in zip(self.source, outs):
            self.pool.gather(block_id, out.numpy())
        payloads = [out.view(-1).view(torch.uint8) for out in outs]
        blocks = [Block(meta, payload) for meta, payload in zip(self.metas([checksum(p) for p in payloads]), payloads)]
        return len(client.put(blocks))

    def store_in_place(self, client: Client, split: list[float]) -> int:
        """Reserve room in the daemon's slab, gather each block straight into it, commit (the daemon
        hashes in place); appends (reserve + commit seconds, the gather's seconds) to `split`."""
        t0 = time.perf_counter()
        with client.reserve(self.metas([0] * len(self.keys))) as room:
            t1 = time.perf_counter()
            for i, block_id in enumerate(self.source):
                runs = room.runs(i)
                if len(runs) == 1:
                    self.pool.gather(block_id, runs[0])
                elif runs:  # pages in several runs: gathered aside, then copied in
                    aside = torch.empty(self.layout.shape(), dtype=self.layout.torch_dtype)
                    self.pool.gather(block_id, aside.numpy())
                    room.fill(i, [aside])
            t2 = time.perf_counter()
            stored = len(room.commit())
        t3 = time.perf_counter()
        split += [(t1 - t0) + (t3 - t2), t2 - t1]
        return stored

    # ---- retrieve -------------------------------------------------------------------------------

    def retrieve_into_pool(self, client: Client) -> int:
        """Keys, lookup, fetch_into the pool's own blocks (their per-layer K and V views): each block
        copied out of the slab into the pool and hashed in the same pass."""
        keys = block_keys(self.ns, self.tokens)
        n = len(client.lookup(keys))
        return len(client.fetch_into(keys[:n], [self.pool.arrays(block_id) for block_id in self.target[:n]]))

    def retrieve_by_fetch_into(self, client: Client, staging: torch.Tensor) -> int:
        """Keys, lookup, fetch_into a contiguous staging tensor (verified there), scatter into the pool."""
        keys = block_keys(self.ns, self.tokens)
        n = len(client.lookup(keys))
        got = client.fetch_into(keys[:n], [staging[i] for i in range(n)])
        for i, block_id in enumerate(self.target[: len(got)]):
            self.pool.scatter(block_id, staging[i].view(self.layout.torch_dtype).view(self.layout.shape()))
        return len(got)

    def retrieve_by_views(self, client: Client) -> int:
        """Keys, lookup, fetch_views (verified in place), scatter into the pool, still_valid()."""
        keys = block_keys(self.ns, self.tokens)
        n = len(client.lookup(keys))
        blocks = client.fetch_views(keys[:n])
        shape, dtype = self.layout.shape(), self.layout.torch_dtype
        for block, block_id in zip(blocks, self.target):
            self.pool.scatter(block_id, block.payload.view(dtype).view(shape))
        if not blocks.still_valid():
            raise SystemExit("paged: a view's pages were recycled during the run")
        return len(blocks)

    def retrieved_right(self) -> bool:
        return all(self.pool.equal(s, t) for s, t in zip(self.source, self.target))

    def clear_target(self) -> None:
        for block_id in self.target:
            for view in self.pool.views(block_id):
                view.zero_()


class Memcpy:
    """The baseline: the same bytes copied block by block into preallocated, touched memory (torch
    copy_, one thread), as bench_sizes measures it."""

    def __init__(self, nbytes: int, blocks: int) -> None:
        self.src = torch.full((blocks, nbytes // blocks), 7, dtype=torch.uint8)
        self.dst = torch.zeros_like(self.src)

    def seconds(self) -> float:
        t = time.perf_counter()
        for src, dst in zip(self.src, self.dst):
            dst.copy_(src)
        return time.perf_counter() - t


def median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def measure(client: Client, *, num_tokens: int = 2000, reps: int = 5, ns: Namespace = GPT2, in_place: bool = True,
            lookups: int = 50) -> tuple[dict[str, list[float]], dict[str, str], list[float], int]:
    """Every path, `reps` times each, interleaved with the memcpy baseline; returns (seconds per path,
    what each path does, memcpy seconds, bytes moved per run). Each store starts with the chain
    absent (evicted, disk writer idle); each retrieve with the chain in host and its target blocks
    zeroed, and ends with the pool's target blocks checked against the source. `in_place`: also the
    paths of puts in place and fetches into the pool (False: a client that has neither, an older
    version's, measured the same way); `lookups`: lookups timed a round."""
    n_blocks = num_tokens // ns.block_tokens
    pool = PagedPool(ns, 2 * n_blocks + 8)
    prompt = Prompt(ns, pool, n_blocks * ns.block_tokens, seed=11)
    layout = BlockLayout.of(ns)
    staging = torch.empty(n_blocks, layout.nbytes(), dtype=torch.uint8)
    baseline = Memcpy(n_blocks * layout.nbytes(), n_blocks)
    split: list[float] = []
    stores: dict[str, Callable[[], int]] = {"store: gather, checksum, Client.put": lambda: prompt.store_by_put(client)}
    retrieves: dict[str, Callable[[], int]] = {}
    if in_place:
        stores["store: reserve, gather into the slab, commit"] = lambda: prompt.store_in_place(client, split)
        retrieves["retrieve: keys, lookup, fetch_into the pool (copy and hash in one pass)"] = \
            lambda: prompt.retrieve_into_pool(client)
    retrieves.update({
        "retrieve: keys, lookup, fetch_into a staging tensor, scatter": lambda: prompt.retrieve_by_fetch_into(
            client, staging),
        "retrieve: keys, lookup, fetch_views, scatter, still_valid": lambda: prompt.retrieve_by_views(client),
    })
    what = {name: name.split(": ", 1)[1] for name in [*stores, *retrieves]}
    seconds: dict[str, list[float]] = {name: [] for name in what}
    seconds["lookup of the prompt, keys included"] = []
    what[PUT_ALONE] = "Client.reserve and Reservation.commit of the in-place store, the caller's gather not counted"
    what["lookup of the prompt, keys included"] = "block_keys of the tokens, then Client.lookup (shared index)"
    memcpy: list[float] = []

    tiny = Namespace(model="sentinel", weights="bench-paged", dtype="float32", num_layers=1, num_kv_heads=1,
                     head_dim=4, block_tokens=1)
    sentinel = [Block(BlockMeta(key=block_keys(tiny, [1])[0], namespace=tiny.digest(), num_tokens=1,
                                dtype="float32", shape=(1, 2, 1, 1, 4), nbytes=32, checksum=checksum(
                                    torch.zeros(32, dtype=torch.uint8))), torch.zeros(32, dtype=torch.uint8))]

    def settle() -> None:  # the disk writer idle: a durable put returns once every queued write is committed
        client.put(sentinel, durable=True)

    for rep in range(reps + 1):  # the first round unmeasured (first touches)
        for name, fn in stores.items():
            client.evict(prompt.keys)
            settle()
            t = time.perf_counter()
            del split[:]
            stored = fn()
            if rep:
                seconds[name].append(time.perf_counter() - t)
                if split:
                    seconds.setdefault(PUT_ALONE, []).append(split[0])
            if stored != n_blocks:
                raise SystemExit(f"paged: {name} stored {stored} of {n_blocks} blocks")
            settle()
        for name, fn in retrieves.items():
            prompt.clear_target()
            t = time.perf_counter()
            got = fn()
            if rep:
                seconds[name].append(time.perf_counter() - t)
            if got != n_blocks or not prompt.retrieved_right():
                raise SystemExit(f"paged: {name} retrieved {got} of {n_blocks} blocks, or other bytes")
        for _ in range(lookups):
            t = time.perf_counter()
            found = len(client.lookup(block_keys(ns, prompt.tokens)))
            if rep:
                seconds["lookup of the prompt, keys included"].append(time.perf_counter() - t)
            if found != n_blocks:
                raise SystemExit(f"paged: lookup found {found} of {n_blocks} blocks")
        if rep:
            memcpy.append(baseline.seconds())
    return seconds, what, memcpy, n_blocks * layout.nbytes()
