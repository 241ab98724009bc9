"""The inference worker: reuse the longest cached prefix from the daemon, prefill only the suffix."""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from tiercache.errors import InvalidArgument, TierCacheError
from tiercache.keys import Namespace, block_keys, tail_keys
from tiercache.worker.kvcache import (blocks_to_cache, cache_to_blocks, first_held_token, hold_sliding_layers,
                                      new_cache, prefill)
from tiercache.worker.sampling import Sampling, generate
from tiercache.layout import BlockLayout, checksum, dtype_of
from tiercache.worker.model import LoadedModel, namespace_for
from tiercache.block import Block, BlockMeta

logger = logging.getLogger(__name__)

_PLAIN_PREFIX = re.compile(r"[ !#-\[\]-~]*")
GENERATE_RESERVE_TOKENS = 512  # the most generated tokens a request's KV cache sets room aside for


@dataclass(frozen=True)
class Request:
    """One prompt. `breakpoints` are token positions to cache up to (like a hosted API's cache_control)."""

    tokens: tuple[int, ...]
    max_new_tokens: int = 16
    breakpoints: tuple[int, ...] = ()
    salt: str = ""
    cache: bool = True  # False: bypass the daemon entirely
    return_scores: int = 0  # top-k next-token scores at the first generated position
    # Short text the admin CLI shows for the cached prefix: stored only when the worker's previews are on
    # and the request has no salt.
    preview: str = ""
    sampling: Sampling = Sampling()  # greedy unless temperature > 0
    # Seconds to pin the prefix up to the last breakpoint for (a hosted API's cache TTL); 0: no pin.
    # Re-pinned by every request that sends it, so a prefix in use stays.
    pin_ttl_s: float = 0.0


@dataclass
class Result:
    text: str
    tokens: list[int]
    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    tiers: list[str]
    ttft_s: float
    total_s: float
    scores: list[tuple[int, float]] = field(default_factory=list)
    degraded: str = ""  # why the cache was not used, when it failed
    prefill_s: float = 0.0  # seconds spent prefilling the computed tokens
    finish_reason: str = ""  # "stop" (EOS), "length" (max_new_tokens) or "cancelled" (on_token said stop)


class CostModel:
    """Fetch-or-recompute, from speeds measured at run time (exponential moving averages).

    Until a tier's bandwidth has been measured, fetching is assumed worth it: the first fetch
    measures it. Fetching n bytes costs n / bandwidth + the measured per-call latency;
    recomputing t tokens costs t / prefill_tokens_per_s.
    """

    ALPHA = 0.3

    def __init__(self) -> None:
        self.prefill_tokens_per_s: float | None = None
        self.bytes_per_s: dict[str, float] = {}
        self.call_latency_s = 0.0

    def _blend(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.ALPHA) * old + self.ALPHA * new

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens >= 8 and seconds > 0:
            self.prefill_tokens_per_s = self._blend(self.prefill_tokens_per_s, tokens / seconds)

    def observe_fetch(self, tier: str, nbytes: int, seconds: float) -> None:
        if nbytes and seconds > 0:
            self.bytes_per_s[tier] = self._blend(self.bytes_per_s.get(tier), nbytes / seconds)

    def observe_call(self, seconds: float) -> None:
        self.call_latency_s = self._blend(self.call_latency_s or None, seconds)

    def worth_fetching(self, tier: str, nbytes: int, tokens: int) -> bool:
        bandwidth = self.bytes_per_s.get(tier)
        if bandwidth is None or self.prefill_tokens_per_s is None:
            return True
        return nbytes / bandwidth + self.call_latency_s < tokens / self.prefill_tokens_per_s


class Worker:
    """Runs requests against one model, with `client_factory` giving a daemon client (or None: no cache).

    The daemon is best effort: any error from it is logged, the request is recomputed, and the
    daemon is skipped for `retry_after_s` before the worker tries it again.

    A request's preview (plain prompt text) is stored with the first block of its chain when
    `previews` is on (config worker.previews) and never for a salted namespace: a salt marks one
    user's prompts, which the operator's `tiercache admin ls` must not show.
    """

    def __init__(self, loaded: LoadedModel, client_factory: Callable[[], object] | None, *, block_tokens: int = 16,
                 adapter: str = "", retry_after_s: float = 2.0,
                 observer: Callable[[Result], None] | None = None, previews: bool = True) -> None:
        self.loaded = loaded
        self.block_tokens = block_tokens
        self.adapter = adapter
        self.previews = previews
        self.retry_after_s = retry_after_s
        self.cost = CostModel()
        self.num_view_retries = 0  # fetches whose slab views were recycled while being copied
        self._client_factory = client_factory
        self._client: object | None = None
        self._down_until = 0.0
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tiercache-put")
        self._pending_puts: list[tuple[Future, frozenset[bytes]]] = []  # (write, keys it stores)
        self.read_own_writes_s = 0.5
        self._lock = threading.Lock()
        self._namespaces: dict[str, Namespace] = {}
        self._observer = observer  # sees every Result (e.g. the worker's own metrics)

    def namespace(self, salt: str = "") -> Namespace:
        ns = self._namespaces.get(salt)
        if ns is None:
            ns = self._namespaces[salt] = namespace_for(self.loaded, block_tokens=self.block_tokens,
                                                        adapter=self.adapter, salt=salt)
        return ns

    # ---- daemon access (best effort) ------------------------------------------------------------

    def _daemon(self) -> object | None:
        if self._client_factory is None or time.monotonic() < self._down_until:
            return None
        with self._lock:
            if self._client is None:
                self._client = self._client_factory()
            return self._client

    def _daemon_failed(self, what: str, error: Exception) -> str:
        logger.warning("daemon %s failed (%s); recomputing, retry in %.1fs", what, error, self.retry_after_s)
        self._down_until = time.monotonic() + self.retry_after_s
        # A fresh channel on the next try: gRPC's own reconnect backoff grows to minutes.
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()  # type: ignore[attr-defined]
        return f"{what}: {error}"

    # ---- the request path -----------------------------------------------------------------------

    def run(self, request: Request, on_token: Callable[[int], bool] | None = None,
            on_prefill: Callable[[int], None] | None = None) -> Result:
        """Run one request. `on_prefill` learns the number of cached prompt tokens once the prompt is
        prefilled; `on_token` sees each generated id as it is chosen, and returning False stops the
        generation there (finish_reason "cancelled")."""
        start = time.perf_counter()
        tokens = list(request.tokens)
        text_config = self.loaded.model.config.get_text_config(decoder=True)
        vocab = text_config.vocab_size
        if not tokens:
            raise InvalidArgument("the prompt is empty")
        context = getattr(text_config, "max_position_embeddings", None)
        if context and len(tokens) + request.max_new_tokens > context:
            raise InvalidArgument(f"the prompt's {len(tokens)} tokens plus max_new_tokens={request.max_new_tokens} "
                                  f"exceed the model's context of {context} tokens")
        bad = next((t for t in tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidArgument(f"token id {bad} is outside the model's vocabulary [0, {vocab})")
        ns = self.namespace(request.salt)
        layout = BlockLayout.of(ns)
        keys = block_keys(ns, tokens)
        tails = tail_keys(ns, tokens, request.breakpoints, keys)
        client = self._daemon() if request.cache and not self.loaded.uncacheable else None
        model = self.loaded.model
        blocks, tiers, degraded, cache = [], [], "", None
        # The tokens the cache will hold: it sets room aside for them (written in place, not appended;
        # kvcache.ReservedLayer). Generated tokens past GENERATE_RESERVE_TOKENS, which an early EOS
        # may never need, make the room grow instead.
        final_tokens = len(tokens) + min(request.max_new_tokens, GENERATE_RESERVE_TOKENS)
        if client is not None:
            self._await_own_writes({*keys, *tails.values()})
            try:
                blocks, tiers, fetched = self._fetch_prefix(client, keys, tails, len(tokens), layout, views=True)
                cache = blocks_to_cache(blocks, model, final_tokens - _num_tokens(blocks)) if blocks else None
                if not self._views_held(fetched):
                    cache = None  # its rooms go before the second copy's are made
                    blocks, tiers, _ = self._fetch_prefix(client, keys, tails, len(tokens), layout, views=False,
                                                          decided=True)
                    cache = blocks_to_cache(blocks, model, final_tokens - _num_tokens(blocks)) if blocks else None
            except (TierCacheError, OSError) as e:
                degraded = self._daemon_failed("lookup/fetch", e)
                blocks, tiers, cache = [], [], None
        cached = _num_tokens(blocks)
        writing = client is not None and not degraded
        if cache is None:
            cache = new_cache(model, final_tokens - len(tokens))
        if writing:  # until the new blocks are cut, sliding-window layers keep the whole prompt
            hold_sliding_layers(cache, True)
        t0 = time.perf_counter()
        logits, cache = prefill(model, tokens[cached:], cache)
        if self.loaded.device.type == "cuda":
            torch.cuda.synchronize()
        prefill_s = time.perf_counter() - t0
        self.cost.observe_prefill(len(tokens) - cached, prefill_s)
        ttft = time.perf_counter() - start
        scores: list[tuple[int, float]] = []
        if request.return_scores:
            top = torch.topk(logits.float(), min(request.return_scores, logits.numel()))
            scores = [(int(i), float(v)) for v, i in zip(top.values.tolist(), top.indices.tolist())]
        if writing:
            try:
                self._write_back(client, cache, ns, layout, tokens, keys, tails, cached, request.preview)
            except TierCacheError as e:  # best effort: the answer does not depend on what is stored
                logger.warning("not caching this prompt's new blocks: %s", e)
            finally:
                hold_sliding_layers(cache, False)
            if request.pin_ttl_s and request.breakpoints:
                self._pending_puts.append((self._writer.submit(self._pin, client, keys, tails, request), frozenset()))
        if on_prefill is not None:
            on_prefill(cached)
        generated, finish = generate(model, cache, logits, request.max_new_tokens,
                                     eos_token_id=getattr(self.loaded.tokenizer, "eos_token_id", None),
                                     sampling=request.sampling, on_token=on_token)
        result = Result(text=self.loaded.tokenizer.decode(generated), tokens=generated, prompt_tokens=len(tokens),
                        cached_tokens=cached, computed_tokens=len(tokens) - cached, tiers=tiers, ttft_s=ttft,
                        total_s=time.perf_counter() - start, scores=scores, degraded=degraded, prefill_s=prefill_s,
                        finish_reason=finish)
        if client is not None and not degraded:
            self._pending_puts.append((self._writer.submit(self._report, client, result), frozenset()))
        if self._observer is not None:
            self._observer(result)
        return result

    def _views_held(self, fetched: object) -> bool:
        """After the blocks were copied into the cache: whether blocks fetched as views into the
        daemon's slab were left alone meanwhile (else the copy may hold a recycled page's bytes)."""
        still_valid = getattr(fetched, "still_valid", None)
        if still_valid is None:
            return True
        if self.loaded.device.type == "cuda":
            torch.cuda.synchronize()  # the host-to-device copies must have read the views
        if still_valid():
            return True
        self.num_view_retries += 1
        logger.info("the daemon recycled a block while it was copied out of its slab; fetching copies")
        return False

    def _fetch_prefix(self, client, keys: list[bytes], tails: dict[int, bytes], num_tokens: int,
                      layout: BlockLayout, *, views: bool, decided: bool = False
                      ) -> tuple[list[torch.Tensor], list[str], object]:
        """Lookup, decide (unless `decided`: a retry), Fetch (views into the daemon's slab when `views`
        and the client offers them); also returns what the client returned. At least one prompt
        token is always left to compute."""
        size = layout.block_tokens
        usable = keys[: (num_tokens - 1) // size]
        t0 = time.perf_counter()
        tiers = client.lookup(usable) if usable else []
        self.cost.observe_call(time.perf_counter() - t0)
        chain = [(key, size) for key in usable[: len(tiers)]]
        # A breakpoint tail extends the chain when every full block before it is cached.
        for point in sorted(tails, reverse=True):
            full = point // size
            if point < num_tokens and full <= len(chain) and point > len(chain) * size:
                found = client.lookup([tails[point]])
                if found:  # else an earlier breakpoint's tail may still be there
                    chain, tiers = chain[:full] + [(tails[point], point - full * size)], tiers[:full] + found
                    break
        if not chain:
            return [], [], None
        cached_tokens = sum(n for _, n in chain)
        nbytes = layout.nbytes(cached_tokens)
        slowest = max(tiers, key=("gpu", "host", "disk").index)
        if not decided and not self.cost.worth_fetching(slowest, nbytes, cached_tokens):
            logger.debug("recomputing %d tokens: cheaper than fetching %d bytes from %s", cached_tokens, nbytes, slowest)
            return [], [], None
        t0 = time.perf_counter()
        fetch = getattr(client, "fetch_views", None) if views else None
        fetched = (fetch or client.fetch)([key for key, _ in chain])
        self.cost.observe_fetch(slowest, sum(b.meta.nbytes for b in fetched), time.perf_counter() - t0)
        dtype = dtype_of(layout.dtype)
        out = []
        for block in fetched:
            expected = layout.shape(block.meta.num_tokens)
            if tuple(block.meta.shape) != expected or block.meta.dtype != layout.dtype:
                raise InvalidArgument(f"daemon returned a block of shape {block.meta.shape} {block.meta.dtype}, "
                                      f"expected {expected} {layout.dtype}")
            out.append(block.payload.view(dtype).view(expected))
        return out, tiers[: len(out)], fetched

    def _write_back(self, client, cache, ns: Namespace, layout: BlockLayout, tokens: list[int], keys: list[bytes],
                    tails: dict[int, bytes], cached: int, preview: str) -> None:
        """Queue a Put of the prompt's new full blocks and breakpoint tails; runs after the first token."""
        size = layout.block_tokens
        first_new = cached // size  # a cached tail's full block is still new
        # Sliding-window layers are held during the prefill (run), so they still hold every new token;
        # a layer that could not be held keeps only its last ones: blocks before them cannot be cut,
        # and blocks after them would have no parents in the store, so nothing new is stored then.
        held = first_held_token(cache)
        if held > first_new * size:
            logger.debug("not caching tokens %d-%d: the model's sliding window let tokens before %d go",
                         first_new * size, len(tokens), held)
            return
        items: list[tuple[bytes, bytes, int, int]] = []  # key, parent, start, end
        for i in range(first_new, len(keys)):
            items.append((keys[i], keys[i - 1] if i else b"", i * size, (i + 1) * size))
        maybe_present = set()
        for point, key in tails.items():
            # A tail inside the cached prefix (other requests cached past it) may be missing still:
            # the cache holds its tokens anyway, and the writer checks before it puts.
            if point != cached and point // size * size >= held:
                full = point // size
                items.append((key, keys[full - 1] if full else b"", full * size, point))
                if point < cached:
                    maybe_present.add(key)
        if not items:
            return
        # Cut the blocks now: generation appends to the cache, and the copy is cheap next to prefill.
        full = [item for item in items if item[3] - item[2] == size]
        tensors = cache_to_blocks(cache, layout, full[0][2], full[-1][3]) if full else []
        tensors += [cache_to_blocks(cache, layout, lo, hi)[0] for _, _, lo, hi in items[len(full):]]
        digest = ns.digest()
        if ns.salt or not self.previews:
            preview = ""
        # A staged Put's header must be the canonical one (tiercache/record_header.py), whose preview is
        # printable ASCII without quotes or backslashes: the preview stops before the first other
        # character, and so stays a prefix of the prompt (`admin explain` tokenizes it).
        preview = _PLAIN_PREFIX.match(preview[:64]).group()
        blocks = []
        for (key, parent, lo, hi), tensor in zip(items, tensors):
            payload = tensor.reshape(-1).view(torch.uint8)
            meta = BlockMeta(key=key, namespace=digest, num_tokens=hi - lo, dtype=layout.dtype,
                             shape=tuple(tensor.shape), nbytes=payload.numel(), checksum=checksum(payload),
                             parent=parent, preview="" if parent else preview)
            blocks.append(Block(meta, payload))
        self._pending_puts = [(f, k) for f, k in self._pending_puts if not f.done()]
        self._pending_puts.append((self._writer.submit(self._put, client, blocks, ns, maybe_present),
                                   frozenset(b.meta.key for b in blocks)))

    def _put(self, client, blocks: Sequence[Block], ns: Namespace, maybe_present: set[bytes] = frozenset()) -> None:
        try:
            # Each tail is a chain of its own: looked up alone (from the shared index, on the same
            # host), as a probe: the writer's checks are not requests' lookups in the daemon's stats.
            blocks = [b for b in blocks
                      if b.meta.key not in maybe_present or not client.lookup([b.meta.key], probe=True)]
            if blocks:
                client.put(blocks, namespace=ns)  # the namespace's description, for the admin CLI
        except (TierCacheError, OSError) as e:
            self._daemon_failed("put", e)

    def _pin(self, client, keys: list[bytes], tails: dict[int, bytes], request: Request) -> None:
        """Pin the chain up to the last breakpoint for request.pin_ttl_s (after this request's Put,
        on the same thread); a failure only costs the pin."""
        last = max((point for point in request.breakpoints if point <= len(request.tokens)), default=0)
        wanted = keys[: last // self.block_tokens] + [tails[p] for p in sorted(tails) if p <= last]
        if not wanted:
            return
        try:
            client.pin(wanted, ttl_s=request.pin_ttl_s)
        except (TierCacheError, OSError, ValueError) as e:
            logger.debug("pinning the prefix failed: %s", e)

    def _report(self, client, result: Result) -> None:
        """Send the request's figures to the daemon's metrics; a failure only costs the figures."""
        try:
            client.report(prompt_tokens=result.prompt_tokens, cached_tokens=result.cached_tokens,
                          ttft_s=result.ttft_s, prefill_s=result.prefill_s)
        except (TierCacheError, OSError, ValueError) as e:  # ValueError: a failed put closed the channel
            logger.debug("report to the daemon failed: %s", e)

    def _await_own_writes(self, wanted: set[bytes]) -> None:
        """Let this worker read its own writes: a request that needs blocks a previous request is
        still putting waits (briefly, bounded) for that Put instead of missing them. Puts of other
        blocks (and reports) are not waited for."""
        deadline = time.monotonic() + self.read_own_writes_s
        for future, keys in list(self._pending_puts):
            if keys.isdisjoint(wanted):
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            try:
                future.result(timeout=remaining)
            except Exception:  # noqa: BLE001 - a failed or slow put is the put's business, not this request's
                return

    def drain(self, timeout_s: float | None = None) -> None:
        """Wait for queued Puts (used before exit and by tests that need the writes visible)."""
        for future, _ in list(self._pending_puts):
            future.result(timeout=timeout_s)

    def close(self) -> None:
        self._writer.shutdown(wait=True)
        if self._client is not None:
            self._client.close()  # type: ignore[attr-defined]


def _num_tokens(blocks: list[torch.Tensor]) -> int:
    return sum(b.shape[3] for b in blocks)
