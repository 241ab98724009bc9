"""The worker's I/O with the daemon: fetch the planned prefix (views, copies when a page was recycled),
cut new blocks out of the KV cache and put them, pin, report; writes go through one thread, off the
request's critical path."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple, TypeVar

import torch
from transformers.cache_utils import Cache

from tiercache.block import Block, BlockMeta
from tiercache.client.best_effort import DAEMON_ERRORS, BestEffort
from tiercache.client.protocol import CacheClient, Fetched, ReservingClient, Room
from tiercache.errors import CapacityExceeded, InvalidArgument, QuotaExceeded, Unimplemented
from tiercache.keys import Namespace
from tiercache.layout import BlockLayout, checksum
from tiercache.worker.cost import CostModel
from tiercache.worker.kvcache import cache_into, cache_to_blocks
from tiercache.worker.plan import FetchPlan, Prompt, WritePlan, plan_fetch, slowest_tier

logger = logging.getLogger(__name__)

T = TypeVar("T")


class CacheTransfer:
    """Moves one worker's blocks between the daemon and its model's KV cache.

    fetch() runs on the request's thread; write_back(), pin() and report() queue their calls on one
    writer thread, in order (a pin after the Put it pins). A failed Put is the daemon's failure
    (`daemon` leaves it alone a while); a failed pin or report costs only itself; a fetch that
    raises is the caller's to handle. Counter: num_view_retries (fetches whose slab views were
    recycled while they were copied).
    """

    def __init__(self, daemon: BestEffort[CacheClient], cost: CostModel, *,
                 synchronize: Callable[[], None] | None = None, read_own_writes_s: float = 0.5) -> None:
        self.daemon = daemon
        self.cost = cost
        self.read_own_writes_s = read_own_writes_s
        self.num_view_retries = 0
        self._synchronize = synchronize  # waits for the device's copies (CUDA), if they run asynchronously
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tiercache-put")
        self._pending: list[tuple[Future[None], frozenset[bytes]]] = []  # (write, keys it stores)

    # ---- the request's thread -------------------------------------------------------------------

    def fetch(self, client: CacheClient, prompt: Prompt, layout: BlockLayout,
              build: Callable[[list[torch.Tensor], int], T]) -> tuple[T | None, int, list[str], list[LaterRun]]:
        """Look up, plan (plan.plan_fetch) and fetch the prompt's cached prefix, and build(blocks,
        tokens they hold) from it: the blocks are views into the daemon's slab where the client
        offers them, so once build has read them they are checked, and when a page was recycled
        meanwhile the prefix is fetched again as copies and built again. Then the plan's runs after
        holes, as copies (the caller computes each hole before it adds the run).
        Returns (what build made or None when no prefix was fetched, tokens it holds, their tiers,
        the runs after holes)."""
        blocks, tiers, viewed, plan = self._fetch(client, prompt, layout)
        built = build(blocks, _num_tokens(blocks)) if blocks else None
        if viewed is not None and not self._views_held(viewed):
            built = None  # its rooms go before the second copy's are made
            blocks, tiers, _, plan = self._fetch(client, prompt, layout, copies=True)
            built = build(blocks, _num_tokens(blocks)) if blocks else None
        if len(blocks) < len(plan.keys):
            return built, _num_tokens(blocks), tiers, []  # the prefix was cut short: no later runs
        return built, _num_tokens(blocks), tiers, self._fetch_later(client, plan, layout)

    def _fetch_later(self, client: CacheClient, plan: FetchPlan, layout: BlockLayout) -> list[LaterRun]:
        """The plan's runs after holes, as copies, up to the first one the daemon no longer holds whole
        (evicted since the lookup): a run cut short ends them all there."""
        out = []
        for run in plan.later:
            t0 = time.perf_counter()
            fetched = client.fetch(run.keys)
            seconds = time.perf_counter() - t0
            self.cost.observe_fetch(slowest_tier(run.tiers), sum(b.meta.nbytes for b in fetched), seconds)
            if fetched:
                start = run.first * layout.block_tokens
                out.append(LaterRun(start, _tensors(fetched, layout), run.tiers[: len(fetched)]))
            if len(fetched) < len(run.keys):
                break
        return out

    def _fetch(self, client: CacheClient, prompt: Prompt, layout: BlockLayout, *, copies: bool = False
               ) -> tuple[list[torch.Tensor], list[str], Fetched | None, FetchPlan]:
        """Lookup (with holes), plan, Fetch the prefix: views of what the cost model says is worth
        fetching, or with `copies` (the retry after stale views: the decision is made) copies of
        whatever is cached. Returns the blocks as tensors of the layout, their tiers, the views
        (None: copies, or nothing fetched) and the plan."""
        query = prompt.query()
        t0 = time.perf_counter()
        tiers = client.lookup(query, holes=True) if query else []
        self.cost.observe_call(time.perf_counter() - t0)
        plan = plan_fetch(prompt, tiers, lambda key: client.lookup([key]), None if copies else self.cost)
        if not plan.keys:
            return [], [], None, plan
        t0 = time.perf_counter()
        viewed = None if copies else client.fetch_views(plan.keys)
        fetched: Iterable[Block] = client.fetch(plan.keys) if viewed is None else viewed
        self.cost.observe_fetch(plan.slowest, sum(b.meta.nbytes for b in fetched), time.perf_counter() - t0)
        out = _tensors(fetched, layout)
        return out, plan.tiers[: len(out)], viewed, plan

    def _views_held(self, fetched: Fetched) -> bool:
        """After the blocks were copied into the cache: whether blocks fetched as views into the
        daemon's slab were left alone meanwhile (else the copy may hold a recycled page's bytes)."""
        if self._synchronize is not None:
            self._synchronize()  # the host-to-device copies must have read the views
        if fetched.still_valid():
            return True
        self.num_view_retries += 1
        logger.info("the daemon recycled a block while it was copied out of its slab; fetching copies")
        return False

    def await_own_writes(self, wanted: Collection[bytes]) -> None:
        """Let this worker read its own writes: a request that needs blocks a previous request is
        still putting waits (briefly, bounded) for that Put instead of missing them. Puts of other
        blocks (and reports) are not waited for."""
        deadline = time.monotonic() + self.read_own_writes_s
        for future, keys in list(self._pending):
            if keys.isdisjoint(wanted):
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            try:
                future.result(timeout=remaining)
            except Exception:  # noqa: BLE001 - a failed or slow put is the put's business, not this request's
                return

    def write_back(self, client: CacheClient, cache: Cache, plan: WritePlan, namespace: Namespace,
                   layout: BlockLayout, preview: str) -> None:
        """Cut `plan`'s blocks out of `cache` now, as generation appends to
        it and the copy is cheap next to the prefill, and queue their Put. `preview` goes with the
        chain's first block. InvalidArgument when the cache cannot be cut (kvcache.cache_to_blocks).
        On the same host the blocks are cut straight into room reserved in the daemon's slab (one
        copy, the daemon hashes them) and only their commit is queued."""
        if not plan.blocks:
            return
        if isinstance(client, ReservingClient) and client.puts_in_place:
            if self._write_back_in_place(client, cache, plan, namespace, layout, preview):
                return
        full = plan.blocks[: plan.num_full]
        tensors = cache_to_blocks(cache, layout, full[0].start, full[-1].end) if full else []
        tensors += [cache_to_blocks(cache, layout, b.start, b.end)[0] for b in plan.blocks[plan.num_full:]]
        digest = namespace.digest()
        blocks = []
        for (key, parent, start, end), tensor in zip(plan.blocks, tensors):
            payload = tensor.reshape(-1).view(torch.uint8)
            meta = BlockMeta(key=key, namespace=digest, num_tokens=end - start, dtype=layout.dtype,
                             shape=tuple(tensor.shape), nbytes=payload.numel(), checksum=checksum(payload),
                             parent=parent, preview="" if parent else preview)
            blocks.append(Block(meta, payload))
        self._submit(frozenset(b.meta.key for b in blocks), self._put, client, blocks, namespace, plan.maybe_present)

    def _write_back_in_place(self, client: ReservingClient, cache: Cache, plan: WritePlan, namespace: Namespace,
                             layout: BlockLayout, preview: str) -> bool:
        """write_back into reserved room; False when the daemon will not reserve for this client
        (the caller then puts copies). A daemon that fails is left alone, as for a failed put."""
        digest = namespace.digest()
        metas = [BlockMeta(key=key, namespace=digest, num_tokens=end - start, dtype=layout.dtype,
                           shape=layout.shape(end - start), nbytes=layout.nbytes(end - start), checksum=0,
                           parent=parent, preview="" if parent else preview)
                 for key, parent, start, end in plan.blocks]
        try:
            room = client.reserve(metas, namespace=namespace)
        except (InvalidArgument, Unimplemented) as e:  # not from here after all: puts_in_place now says so
            logger.debug("no room in place: %s", e)
            return False
        except CapacityExceeded as e:
            if isinstance(e, QuotaExceeded):  # the tenant's limit: copies would be refused too
                self.daemon.failed(client, "reserve", e)
                return True
            logger.debug("no room in place for the whole chain: %s", e)  # Client.put goes in halves
            return False
        except DAEMON_ERRORS as e:
            self.daemon.failed(client, "reserve", e)
            return True
        try:
            for i, (_, _, start, end) in enumerate(plan.blocks):
                if room.present(i):
                    continue
                out = room.tensor(i)
                if out is not None:
                    cache_into(cache, layout, start, [out])
                else:  # pages in several runs: cut aside, then copied in
                    room.fill(i, cache_to_blocks(cache, layout, start, end))
        except BaseException:
            room.release()
            raise
        self._submit(frozenset(m.key for m in metas), self._commit, client, room)
        return True

    def pin(self, client: CacheClient, keys: list[bytes], ttl_s: float) -> None:
        """Queue a pin of `keys` for ttl_s, after the Puts queued before it; a failure only costs the pin."""
        if keys:
            self._submit(frozenset(), self._pin, client, keys, ttl_s)

    def report(self, client: CacheClient, *, prompt_tokens: int, cached_tokens: int, ttft_s: float,
               prefill_s: float) -> None:
        """Queue the request's figures for the daemon's metrics; a failure only costs the figures."""
        self._submit(frozenset(), self._report, client, prompt_tokens, cached_tokens, ttft_s, prefill_s)

    def _submit(self, keys: frozenset[bytes], fn: Callable[..., None], *args: object) -> None:
        self._pending = [(f, k) for f, k in self._pending if not f.done()]
        self._pending.append((self._writer.submit(fn, *args), keys))

    def drain(self, timeout_s: float | None = None) -> None:
        """Wait for queued calls (used before exit and by tests that need the writes visible)."""
        for future, _ in list(self._pending):
            future.result(timeout=timeout_s)

    def close(self) -> None:
        """Finish the queued calls and stop the writer thread."""
        self._writer.shutdown(wait=True)

    # ---- the writer thread ----------------------------------------------------------------------

    def _put(self, client: CacheClient, blocks: list[Block], namespace: Namespace,
             maybe_present: frozenset[bytes]) -> None:
        try:
            # Each tail is a chain of its own: looked up alone (from the shared index, on the same
            # host), as a probe: the writer's checks are not requests' lookups in the daemon's stats.
            blocks = [b for b in blocks
                      if b.meta.key not in maybe_present or not client.lookup([b.meta.key], probe=True)]
            if blocks:
                client.put(blocks, namespace=namespace)  # the namespace's description, for the admin CLI
            self.daemon.succeeded()
        except DAEMON_ERRORS as e:
            self.daemon.failed(client, "put", e)

    def _commit(self, client: CacheClient, room: Room) -> None:
        try:
            room.commit()
            self.daemon.succeeded()
        except DAEMON_ERRORS as e:
            self.daemon.failed(client, "commit", e)

    def _pin(self, client: CacheClient, keys: list[bytes], ttl_s: float) -> None:
        try:
            client.pin(keys, ttl_s=ttl_s)
        except DAEMON_ERRORS as e:
            logger.debug("pinning the prefix failed: %s", e)

    def _report(self, client: CacheClient, prompt_tokens: int, cached_tokens: int, ttft_s: float,
                prefill_s: float) -> None:
        try:
            client.report(prompt_tokens=prompt_tokens, cached_tokens=cached_tokens, ttft_s=ttft_s,
                          prefill_s=prefill_s)
        except DAEMON_ERRORS as e:  # ValueError: a failed put closed the channel
            logger.debug("report to the daemon failed: %s", e)


def _num_tokens(blocks: list[torch.Tensor]) -> int:
    return sum(b.shape[3] for b in blocks)


def _tensors(fetched: Iterable[Block], layout: BlockLayout) -> list[torch.Tensor]:
    """The blocks' payloads as tensors of the layout; InvalidArgument for a block of another shape."""
    out = []
    for block in fetched:
        expected = layout.shape(block.meta.num_tokens)
        if tuple(block.meta.shape) != expected or block.meta.dtype != layout.dtype:
            raise InvalidArgument(f"daemon returned a block of shape {block.meta.shape} {block.meta.dtype}, "
                                  f"expected {expected} {layout.dtype}")
        out.append(block.payload.view(layout.torch_dtype).view(expected))
    return out


class LaterRun(NamedTuple):
    """Cached blocks after a hole, fetched: the run's first token, its blocks, their tiers."""

    start: int
    blocks: list[torch.Tensor]
    tiers: list[str]
