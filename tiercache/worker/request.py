"""The inference worker: reuse the longest cached prefix from the daemon, prefill only the suffix."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache

from tiercache.client.best_effort import DAEMON_ERRORS, BestEffort
from tiercache.client.protocol import CacheClient
from tiercache.errors import InvalidArgument, TierCacheError
from tiercache.keys import Namespace, block_keys, tail_keys
from tiercache.layout import BlockLayout
from tiercache.worker.cost import CostModel
from tiercache.worker.kvcache import (
    blocks_to_cache,
    extend_cache,
    first_held_token,
    hold_sliding_layers,
    new_cache,
    prefill,
)
from tiercache.worker.model import LoadedModel, namespace_for
from tiercache.worker.plan import Prompt, plan_pin, plan_write_back, stored_preview
from tiercache.worker.sampling import Sampling, generate
from tiercache.worker.transfer import CacheTransfer, LaterRun

logger = logging.getLogger(__name__)

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


class Worker:
    """Runs requests against one model, with `client_factory` giving a daemon client (or None: no cache).

    The daemon is best effort (tiercache.client.best_effort): any error from it is logged, the
    request is recomputed, and the daemon is skipped for `retry_after_s` (longer in a long outage)
    before the worker tries it again, with a fresh client. plan.py decides what to fetch,
    write back and pin; transfer.py moves the blocks; this class runs the model between them.

    A request's preview (plain prompt text) is stored with the first block of its chain when
    `previews` is on (config worker.previews) and never for a salted namespace: a salt marks one
    user's prompts, which the operator's `tiercache admin ls` must not show.
    """

    def __init__(self, loaded: LoadedModel, client_factory: Callable[[], CacheClient] | None, *,
                 block_tokens: int = 16, adapter: str = "", retry_after_s: float = 2.0,
                 observer: Callable[[Result], None] | None = None, previews: bool = True) -> None:
        self.loaded = loaded
        self.block_tokens = block_tokens
        self.adapter = adapter
        self.previews = previews
        self.cost = CostModel()
        self.daemon: BestEffort[CacheClient] = BestEffort(client_factory, retry_after_s)
        synchronize = torch.cuda.synchronize if loaded.device.type == "cuda" else None
        self.transfer = CacheTransfer(self.daemon, self.cost, synchronize=synchronize)
        self._namespaces: dict[str, Namespace] = {}
        self._observer = observer  # sees every Result (e.g. the worker's own metrics)

    @property
    def num_view_retries(self) -> int:
        """Fetches whose slab views were recycled while being copied (and were fetched again as copies)."""
        return self.transfer.num_view_retries

    def namespace(self, salt: str = "") -> Namespace:
        ns = self._namespaces.get(salt)
        if ns is None:
            ns = self._namespaces[salt] = namespace_for(self.loaded, block_tokens=self.block_tokens,
                                                        adapter=self.adapter, salt=salt)
        return ns

    def run(self, request: Request, on_token: Callable[[int], bool] | None = None,
            on_prefill: Callable[[int], None] | None = None) -> Result:
        """Run one request. `on_prefill` learns the number of cached prompt tokens once the prompt is
        prefilled; `on_token` sees each generated id as it is chosen, and returning False stops the
        generation there (finish_reason "cancelled")."""
        start = time.perf_counter()
        tokens = list(request.tokens)
        self._check(request, tokens)
        ns = self.namespace(request.salt)
        layout = BlockLayout.of(ns)
        keys = block_keys(ns, tokens)
        tails = tail_keys(ns, tokens, request.breakpoints, keys)
        prompt = Prompt(keys, tails, len(tokens), layout.block_tokens, layout.nbytes(1), request.breakpoints)
        client = self.daemon.client() if request.cache and not self.loaded.uncacheable else None
        model = self.loaded.model
        tiers: list[str] = []
        cache: Cache | None = None
        cached, degraded = 0, ""
        later: list[LaterRun] = []  # cached runs after holes: each hole is computed, then its run added
        # The tokens the cache will hold: it sets room aside for them (written in place, not appended;
        # kvcache.ReservedLayer). Generated tokens past GENERATE_RESERVE_TOKENS, which an early EOS
        # may never need, make the room grow instead.
        final_tokens = len(tokens) + min(request.max_new_tokens, GENERATE_RESERVE_TOKENS)
        if client is not None:
            self.transfer.await_own_writes({*keys, *tails.values()})
            try:
                cache, cached, tiers, later = self.transfer.fetch(
                    client, prompt, layout, lambda blocks, n: blocks_to_cache(blocks, model, final_tokens - n))
                self.daemon.succeeded()
            except DAEMON_ERRORS as e:
                degraded = self.daemon.failed(client, "lookup/fetch", e)
                cache, cached, tiers, later = None, 0, [], []
        writer = None if degraded else client  # the client the new blocks are written back with
        if cache is None:  # room for all but what the first prefill adds (the prompt, or the first hole)
            cache = new_cache(model, final_tokens - (later[0].start if later else len(tokens)))
        if writer is not None:  # until the new blocks are cut, sliding-window layers keep the whole prompt
            hold_sliding_layers(cache, True)
        t0 = time.perf_counter()
        end, filled = cached, list[int]()  # end: the first token after the last cached one in the cache
        for run in later:  # each hole computed from the tokens before it, then the run after it added
            _, cache = prefill(model, tokens[end : run.start], cache)
            filled += range(end // layout.block_tokens, run.start // layout.block_tokens)
            extend_cache(cache, run.blocks, model)
            end = run.start + sum(block.shape[3] for block in run.blocks)
            cached += end - run.start
            tiers = tiers + run.tiers
        t1 = time.perf_counter()
        logits, cache = prefill(model, tokens[end:], cache)
        if self.loaded.device.type == "cuda":
            torch.cuda.synchronize()
        prefill_s = time.perf_counter() - t0
        self.cost.observe_prefill(len(tokens) - end, time.perf_counter() - t1)
        ttft = time.perf_counter() - start
        scores: list[tuple[int, float]] = []
        if request.return_scores:
            top = torch.topk(logits.float(), min(request.return_scores, logits.numel()))
            scores = [(int(i), float(v)) for v, i in zip(top.values.tolist(), top.indices.tolist())]
        if writer is not None:
            try:
                preview = stored_preview(request.preview, salted=bool(ns.salt), previews=self.previews)
                plan = plan_write_back(prompt, end, first_held_token(cache), filled)
                self.transfer.write_back(writer, cache, plan, ns, layout, preview)
            except TierCacheError as e:  # best effort: the answer does not depend on what is stored
                logger.warning("not caching this prompt's new blocks: %s", e)
            finally:
                hold_sliding_layers(cache, False)
            if request.pin_ttl_s and request.breakpoints:
                self.transfer.pin(writer, plan_pin(prompt), request.pin_ttl_s)
        if on_prefill is not None:
            on_prefill(cached)
        generated, finish = generate(model, cache, logits, request.max_new_tokens,
                                     eos_token_id=getattr(self.loaded.tokenizer, "eos_token_id", None),
                                     sampling=request.sampling, on_token=on_token)
        result = Result(text=self.loaded.tokenizer.decode(generated), tokens=generated, prompt_tokens=len(tokens),
                        cached_tokens=cached, computed_tokens=len(tokens) - cached, tiers=tiers, ttft_s=ttft,
                        total_s=time.perf_counter() - start, scores=scores, degraded=degraded, prefill_s=prefill_s,
                        finish_reason=finish)
        if writer is not None:
            self.transfer.report(writer, prompt_tokens=result.prompt_tokens, cached_tokens=cached, ttft_s=ttft,
                                 prefill_s=prefill_s)
        if self._observer is not None:
            self._observer(result)
        return result

    def _check(self, request: Request, tokens: list[int]) -> None:
        """InvalidArgument for a prompt the model cannot take."""
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

    def drain(self, timeout_s: float | None = None) -> None:
        """Wait for queued Puts (used before exit and by tests that need the writes visible)."""
        self.transfer.drain(timeout_s)

    def close(self) -> None:
        self.transfer.close()
        self.daemon.close()
