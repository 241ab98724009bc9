"""The scheduler side's bookkeeping: which blocks each request loads from tiercache, and which it
writes back. Plain data, no vLLM objects: the connector translates vLLM's into these calls.

A request's chain is the keys of its prompt's full blocks, one chain per tensor-parallel rank.
Invariant per request: 0 <= num_stored <= len(chain); blocks [0, num_stored) are in tiercache (or
being written), blocks past it are written back once vLLM has computed them. A block whose load
failed goes back past num_stored (with every block after it): vLLM recomputes them, and they are
written back as blocks never cached would be.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

from tiercache.keys import Namespace, block_keys


@dataclass(frozen=True)
class Transfer:
    """Blocks of one request to copy: into vLLM (a load) or out of it (a save).

    `chains[rank][i]` is the key of block `block_ids[i]` for that rank; `parents[rank]` the key before
    the first one (b"" at the start of the prompt); `namespaces[rank]` their namespace, as fields. A
    save's `prefix_block_ids` are the request's vLLM blocks before the first one: what its blocks were
    computed over (a save over a block whose load failed is not written)."""

    req_id: str
    block_ids: list[int]
    chains: list[list[bytes]]
    parents: list[bytes] = field(default_factory=list)
    namespaces: list[dict[str, str | int]] = field(default_factory=list)
    prefix_block_ids: list[int] = field(default_factory=list)


@dataclass
class _Request:
    tokens: list[int]
    namespaces: tuple[Namespace, ...]
    chains: list[list[bytes]]
    num_hits: int = 0
    num_local: int = 0  # tokens vLLM's own prefix cache held (block-aligned), as matched() saw them
    num_stored: int = 0
    block_ids: list[int] = field(default_factory=list)
    load: tuple[int, int] | None = None  # block range to load in the next step


class Planner:
    """Plans loads and saves for the requests vLLM schedules.

    `lookup(chains)` answers how many leading blocks tiercache holds for every rank (0 when the
    daemon cannot be asked). matched() may be called several times for one request (vLLM asks again
    when it could not schedule it): each call asks again, as the cache may have changed.
    """

    def __init__(self, block_size: int, lookup: Callable[[list[list[bytes]]], int]) -> None:
        self.block_size = block_size
        self._lookup = lookup
        self._requests: dict[str, _Request] = {}

    def matched(self, req_id: str, tokens: Sequence[int], namespaces: tuple[Namespace, ...],
                num_computed: int) -> int:
        """Tokens past `num_computed` (vLLM's own prefix-cache hit) that tiercache can supply. On a
        full hit, one token less: vLLM must compute the last prompt token to sample from it."""
        request = self._requests.get(req_id)
        if request is None or request.namespaces != namespaces or len(request.tokens) != len(tokens):
            tokens = list(tokens)
            request = _Request(tokens, namespaces, [block_keys(ns, tokens) for ns in namespaces])
            self._requests[req_id] = request
        num_full = len(request.chains[0])
        request.num_hits = self._lookup(request.chains) if num_full else 0
        request.num_stored = request.num_hits
        request.num_local = num_computed
        hit_tokens = min(request.num_hits * self.block_size, len(tokens) - 1)
        return max(hit_tokens - num_computed, 0)

    def allocated(self, req_id: str, block_ids: Sequence[int], num_external: int) -> None:
        """vLLM gave the request `block_ids` (all of them) and takes `num_external` tokens from
        tiercache after its own hit (as matched() saw it): the blocks holding them load in the next step."""
        request = self._requests.get(req_id)
        if request is None:
            return
        request.block_ids = list(block_ids)
        if num_external > 0:
            first = request.num_local // self.block_size
            end = -(-(request.num_local + num_external) // self.block_size)
            request.load = (first, min(end, request.num_hits))

    def step(self, scheduled: Sequence[tuple[str, int, int, Sequence[int] | None, bool]]
             ) -> tuple[list[Transfer], list[Transfer]]:
        """The loads and saves of one engine step. `scheduled` holds, per request:
        (req_id, tokens computed before the step, tokens scheduled in it, block ids vLLM added or
        None, whether those ids replace the old ones: a new or resumed request)."""
        loads: list[Transfer] = []
        saves: list[Transfer] = []
        for req_id, num_computed, num_scheduled, block_ids, replace in scheduled:
            request = self._requests.get(req_id)
            if request is None:
                continue
            if block_ids is not None:
                request.block_ids = list(block_ids) if replace else request.block_ids + list(block_ids)
            if request.load is not None:
                first, end = request.load
                request.load = None
                if end > first:
                    loads.append(self._transfer(req_id, request, first, end))
            done = min(num_computed + num_scheduled, len(request.tokens)) // self.block_size
            done = min(done, len(request.block_ids), len(request.chains[0]))
            if done > request.num_stored:
                saves.append(self._transfer(req_id, request, request.num_stored, done, describe=True))
                request.num_stored = done
        return loads, saves

    def load_failed(self, block_ids: Collection[int]) -> None:
        """vLLM could not load `block_ids` and recomputes them (kv_load_failure_policy "recompute"): each
        request whose stored blocks include one writes back its blocks from the first such one on, once
        vLLM has recomputed them (step() sees vLLM's computed tokens go back to that block)."""
        if not block_ids:
            return
        for request in self._requests.values():
            for i, block_id in enumerate(request.block_ids[: request.num_stored]):
                if block_id in block_ids:
                    request.num_stored = i
                    break

    def _transfer(self, req_id: str, request: _Request, first: int, end: int, describe: bool = False) -> Transfer:
        """Blocks [first, end) of the request; `describe` (a save): with their namespaces and the blocks before."""
        return Transfer(req_id, request.block_ids[first:end], [chain[first:end] for chain in request.chains],
                        [chain[first - 1] if first else b"" for chain in request.chains],
                        [ns.to_dict() for ns in request.namespaces] if describe else [],
                        request.block_ids[:first] if describe else [])

    def finished(self, req_id: str) -> None:
        """The request is done (or aborted): forget it."""
        self._requests.pop(req_id, None)

    def __len__(self) -> int:
        return len(self._requests)
