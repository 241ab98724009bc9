"""The worker's decisions for one request, as plain data: what to fetch, compute, write back and pin.

No daemon, no tensors: transfer.py does the I/O these plans describe, request.py runs the model.
A prompt of n tokens has n // block_tokens full blocks; block i holds tokens [i * size, (i + 1) * size).
A breakpoint b that is not a multiple of the size has a tail block: tokens [b - b % size, b), whose
parent is the full block before it (tiercache/keys.py).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from tiercache.worker.cost import CostModel

logger = logging.getLogger(__name__)

# "remote": read from a remote tier by the lookup, into host: fetched at host speed, but the
# tier that says what the chain cost.
TIERS_FASTEST_FIRST = ("gpu", "host", "disk", "remote")
# The most holes a fetch fills (a missing block with cached ones after it; a forward pass each):
# past them, the rest of the prompt is computed in one pass.
MAX_HOLES = 32
# What a staged Put's canonical header (tiercache/record_header.py) takes as a preview: printable
# ASCII without quotes or backslashes.
_PLAIN_PREFIX = re.compile(r"[ !#-\[\]-~]*")
PREVIEW_CHARS = 64


@dataclass(frozen=True)
class Prompt:
    """One request's block keys: `keys` of its full blocks, `tails` breakpoint -> tail key, as
    tiercache.keys computes them; `token_bytes` is the size of one token's KV in a block."""

    keys: list[bytes]
    tails: dict[int, bytes]
    num_tokens: int
    block_tokens: int
    token_bytes: int
    breakpoints: tuple[int, ...] = ()

    def query(self) -> list[bytes]:
        """The full blocks a fetch may cover: one prompt token is always left to compute, as
        generation starts from its logits."""
        return self.keys[: (self.num_tokens - 1) // self.block_tokens]


def slowest_tier(tiers: Sequence[str]) -> str:
    return max(tiers, key=TIERS_FASTEST_FIRST.index)


@dataclass(frozen=True)
class Run:
    """Cached full blocks after a hole: blocks first .. first + len(keys) - 1 of the prompt."""

    first: int
    keys: list[bytes]
    tiers: list[str]


@dataclass(frozen=True)
class FetchPlan:
    """The chain to fetch: full blocks from the start, perhaps ending in a breakpoint tail, then
    `later`: runs of cached full blocks after holes (missing blocks the worker computes from the
    blocks before them; the KV of block i depends only on tokens 0 .. i's last). Invariant:
    len(keys) == len(tiers); empty when nothing is worth fetching."""

    keys: list[bytes] = field(default_factory=list)
    tiers: list[str] = field(default_factory=list)  # where the daemon holds each block
    num_tokens: int = 0  # prompt tokens the chain holds, so not computed
    later: list[Run] = field(default_factory=list)

    @property
    def slowest(self) -> str:
        """The slowest tier the chain touches: the cost model's bandwidth for the whole fetch."""
        return slowest_tier(self.tiers)


def _runs(tiers: Sequence[str], start: int) -> list[Run]:
    """The runs of present blocks ("" is a hole) from block `start` on, each after a hole: at most
    MAX_HOLES of them. Their keys are filled in by the caller."""
    runs: list[Run] = []
    for i in range(start, len(tiers)):
        if not tiers[i]:
            continue
        if runs and runs[-1].first + len(runs[-1].tiers) == i:
            runs[-1].tiers.append(tiers[i])
        elif len(runs) < MAX_HOLES:
            runs.append(Run(i, [], [tiers[i]]))
        else:
            break
    return runs


def plan_fetch(prompt: Prompt, tiers: Sequence[str], lookup_tail: Callable[[bytes], Sequence[str]],
               cost: CostModel | None) -> FetchPlan:
    """What to fetch, given `tiers` (the daemon's lookup of prompt.query(), with holes: "" for a
    missing block).

    Past the cached prefix, the cached runs after holes (at most MAX_HOLES) are fetched too, and the
    holes computed. Without them, a breakpoint tail extends the chain when every full block before
    it is cached; the latest such breakpoint is tried first, and `lookup_tail(key)` (a lookup of
    that one key) says whether its tail is stored; if not, an earlier breakpoint's tail may still
    be. `cost` None: fetch whatever is cached (a retry: the decision was made); else the prefix, and
    then the runs after it, only when the cost model says that beats recomputing their tokens."""
    size = prompt.block_tokens
    query = prompt.query()
    tiers = list(tiers[: len(query)])
    prefix = next((i for i, tier in enumerate(tiers) if not tier), len(tiers))
    chain = query[:prefix]
    found = tiers[:prefix]
    num_tokens = len(chain) * size
    later = _runs(tiers, prefix)
    for run in later:
        run.keys.extend(query[run.first : run.first + len(run.tiers)])
    if cost is not None and later:
        tokens = sum(len(run.keys) for run in later) * size
        if not cost.worth_fetching(slowest_tier([t for run in later for t in run.tiers]), tokens * prompt.token_bytes,
                                   tokens):
            later = []
    for point in sorted(prompt.tails, reverse=True) if not later else ():
        full = point // size
        if point < prompt.num_tokens and full <= len(chain) and point > len(chain) * size:
            tail_tiers = lookup_tail(prompt.tails[point])
            if tail_tiers:
                chain, found, num_tokens = chain[:full] + [prompt.tails[point]], found[:full] + [tail_tiers[0]], point
                break
    if not chain:
        return FetchPlan(later=later)
    plan = FetchPlan(chain, found, num_tokens, later)
    nbytes = num_tokens * prompt.token_bytes
    if cost is not None and not cost.worth_fetching(plan.slowest, nbytes, num_tokens):
        logger.debug("recomputing %d tokens: cheaper than fetching %d bytes from %s", num_tokens, nbytes, plan.slowest)
        return FetchPlan()
    return plan


class BlockToWrite(NamedTuple):
    key: bytes
    parent: bytes  # the key of the block before it; b"" for the prompt's first block
    start: int  # its first token
    end: int  # one past its last token


@dataclass(frozen=True)
class WritePlan:
    """New blocks to cut out of the cache and put: `blocks[:num_full]` are consecutive full blocks,
    the rest filled holes and breakpoint tails, each cut alone. `maybe_present`: tails the writer
    must look up first, as they may be stored already."""

    blocks: list[BlockToWrite] = field(default_factory=list)
    num_full: int = 0
    maybe_present: frozenset[bytes] = frozenset()


def plan_write_back(prompt: Prompt, num_cached: int, first_held: int, filled: Sequence[int] = ()) -> WritePlan:
    """The blocks to write back after a prefill that reused the prompt's tokens before `num_cached`,
    but for the full blocks `filled` (holes it computed).

    Every full block from the one that holds token num_cached on is new (a fetched tail's full block
    is too), each filled one, and every breakpoint tail but a fetched one. `first_held` is the first token every layer
    of the cache still holds (kvcache.first_held_token): a sliding-window layer that could not be held
    keeps only its last tokens; blocks before them cannot be cut and blocks after them would have no
    parents in the store, so then nothing new is written."""
    size = prompt.block_tokens
    keys = prompt.keys
    first_new = num_cached // size
    if first_held > first_new * size:
        logger.debug("not caching tokens %d-%d: the model's sliding window let tokens before %d go",
                     first_new * size, prompt.num_tokens, first_held)
        return WritePlan()
    blocks = [BlockToWrite(keys[i], keys[i - 1] if i else b"", i * size, (i + 1) * size)
              for i in range(first_new, len(keys))]
    num_full = len(blocks)
    blocks += [BlockToWrite(keys[i], keys[i - 1] if i else b"", i * size, (i + 1) * size)
               for i in filled if i < first_new and i * size >= first_held]
    maybe_present = set()
    for point, key in prompt.tails.items():
        # A tail inside the cached prefix (other requests cached past it) may be missing still: the
        # cache holds its tokens anyway, and the writer checks before it puts.
        full = point // size
        if point != num_cached and full * size >= first_held:
            blocks.append(BlockToWrite(key, keys[full - 1] if full else b"", full * size, point))
            if point < num_cached:
                maybe_present.add(key)
    return WritePlan(blocks, num_full, frozenset(maybe_present))


def plan_pin(prompt: Prompt) -> list[bytes]:
    """The chain up to the prompt's last breakpoint, tails of earlier breakpoints included: a
    hosted API's cached prefix; [] without breakpoints."""
    last = max((point for point in prompt.breakpoints if point <= prompt.num_tokens), default=0)
    return prompt.keys[: last // prompt.block_tokens] + [prompt.tails[p] for p in sorted(prompt.tails) if p <= last]


def stored_preview(preview: str, *, salted: bool, previews: bool) -> str:
    """The text stored with a chain's first block for the admin CLI: none for a salted namespace
    (one user's prompts, which the operator must not see) or with previews off; else the preview's
    first PREVIEW_CHARS characters up to the first one a canonical header refuses, so it stays a
    prefix of the prompt (`admin explain` tokenizes it)."""
    if salted or not previews:
        return ""
    plain = _PLAIN_PREFIX.match(preview[:PREVIEW_CHARS])
    return plain.group() if plain else ""
