"""The household workload (shared system prompt, short requests, a growing conversation, probes) and its model."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tiercache.errors import InvalidArgument

if TYPE_CHECKING:
    from tiercache.worker.model import LoadedModel

MODELS = ("default", "gpt2-small")
# Both models use tiercache's ByteTokenizer; its constants are repeated here so that the driver
# never has to import transformers (seconds per process on a busy 2-core box). build_model checks them.
VOCAB = 259
FIRST_ID = 3  # below it: pad, bos, eos


@dataclass(frozen=True)
class ModelSpec:
    """Which model every worker builds: the same seed gives the same weights, hence the same keys."""

    name: str = "default"
    attn: str = "sdpa"
    seed: int = 0
    max_positions: int = 4096


def build_model(spec: ModelSpec) -> LoadedModel:
    """The embedded default Llama, or a GPT-2-small-shaped model (12 layers, 768 hidden) with seeded random weights."""
    import torch

    from tiercache.worker.model import ByteTokenizer, load_default_model, wrap_model

    assert (ByteTokenizer.vocab_size, ByteTokenizer.offset) == (VOCAB, FIRST_ID), "ByteTokenizer changed"
    if spec.name == "default":
        loaded = load_default_model(seed=spec.seed)
    elif spec.name == "gpt2-small":
        from transformers import GPT2Config, GPT2LMHeadModel

        tokenizer = ByteTokenizer()
        config = GPT2Config(vocab_size=tokenizer.vocab_size, n_embd=768, n_layer=12, n_head=12,
                            n_positions=spec.max_positions, bos_token_id=tokenizer.bos_token_id,
                            eos_token_id=tokenizer.eos_token_id)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.seed)
            model = GPT2LMHeadModel(config).eval()
        # The name and seed identify the weights; hashing 500 MB of them in every worker would only cost time.
        loaded = wrap_model(model, tokenizer, f"bench/gpt2-small-seed{spec.seed}", weights=f"seed{spec.seed}")
    else:
        raise InvalidArgument(f"unknown model {spec.name!r}; expected one of {', '.join(MODELS)}")
    if spec.attn not in ("sdpa", "eager"):
        raise InvalidArgument(f"unknown attention {spec.attn!r}; expected sdpa or eager")
    loaded.model.config._attn_implementation = spec.attn  # transformers 5 reads it at every forward
    return loaded


@dataclass(frozen=True)
class Sizes:
    """How big the workload is (all in tokens of the byte tokenizer, 16-token blocks by default)."""

    system_tokens: int = 1000
    requests: int = 24
    turns: int = 6
    request_tokens: tuple[int, int] = (16, 48)
    turn_tokens: int = 24
    reply_tokens: int = 24
    new_tokens: int = 4
    prefix_lengths: tuple[int, ...] = (256, 1000, 2000)
    probe_repeats: int = 5
    probe_suffix_tokens: int = 24

    def __post_init__(self) -> None:
        for name in ("system_tokens", "requests", "probe_repeats", "probe_suffix_tokens"):
            if getattr(self, name) < 1:
                raise InvalidArgument(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.turns < 0 or self.new_tokens < 0:
            raise InvalidArgument(f"turns and new_tokens must be >= 0, got {self.turns}, {self.new_tokens}")
        lo, hi = self.request_tokens
        if not 1 <= lo <= hi:
            raise InvalidArgument(f"request_tokens must be 1 <= lo <= hi, got {self.request_tokens}")
        if not self.prefix_lengths or min(self.prefix_lengths) < 2:
            raise InvalidArgument(f"prefix_lengths must be >= 2 tokens each, got {self.prefix_lengths}")

    def longest_prompt(self) -> int:
        conversation = self.system_tokens + self.turns * (self.turn_tokens + self.reply_tokens)
        return max(conversation, self.system_tokens + self.request_tokens[1],
                   max(self.prefix_lengths) + self.probe_suffix_tokens) + self.new_tokens


@dataclass(frozen=True)
class Job:
    """One request. `after`: the job that must finish first; `lane`: the worker it must run on (None: any)."""

    id: int
    kind: str  # "request", "turn", "fill" (a probe's first, cold run) or "probe"
    tokens: tuple[int, ...]
    breakpoints: tuple[int, ...]
    after: int | None = None
    lane: int | None = None
    prefix: int = 0  # a probe's prefix length


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(FIRST_ID, vocab) for _ in range(n)]


def system_prompt(sizes: Sizes, vocab: int) -> list[int]:
    """The household's shared system prompt: the same on every day."""
    return _tokens(random.Random(1), sizes.system_tokens, vocab)


def household_jobs(sizes: Sizes, vocab: int, num_workers: int, day: int = 0) -> list[Job]:
    """Requests of several users on the shared system prompt, with a conversation's turns mixed in.

    Job 0 runs alone first (the day's first request); every other job waits for it, so the workers
    then run in parallel against a warm cache. The conversation grows turn by turn on the last
    worker (session affinity, the in-process cache's best case); each turn marks the end of its
    prompt as a breakpoint so the next turn reuses all of it. `day` changes the requests and the
    conversation but not the system prompt.
    """
    system = system_prompt(sizes, vocab)
    rng = random.Random(1000 + day)
    lane = num_workers - 1
    every = max(1, sizes.requests // max(1, sizes.turns))
    jobs: list[Job] = []
    history = list(system)
    marks = [len(system)]
    last_turn: int | None = None
    turns_left = sizes.turns
    for i in range(sizes.requests):
        ask = _tokens(rng, rng.randint(*sizes.request_tokens), vocab)
        jobs.append(Job(len(jobs), "request", tuple(system + ask), (len(system),), after=0 if jobs else None))
        if turns_left and i % every == every - 1:
            turns_left -= 1
            history += _tokens(rng, sizes.turn_tokens, vocab)
            marks.append(len(history))
            jobs.append(Job(len(jobs), "turn", tuple(history), tuple(dict.fromkeys(marks[-3:])),
                            after=last_turn if last_turn is not None else 0, lane=lane))
            last_turn = jobs[-1].id
            history += _tokens(rng, sizes.reply_tokens, vocab)  # the assistant's reply, part of the next prompt
    return jobs


def probe_jobs(sizes: Sizes, vocab: int, *, fill: bool, day: int = 0, first_id: int = 0) -> list[Job]:
    """Per prefix length L: a fill request (cold, populates the cache) then `probe_repeats` requests
    with the same L-token prefix and a new suffix, all on worker 0, one at a time. Probe prefixes
    share nothing with the system prompt and are the same on every day; suffixes change with the day
    (a probe must not find its own suffix's block cached by an earlier day)."""
    jobs: list[Job] = []
    for length in sizes.prefix_lengths:
        prefix = _tokens(random.Random(5000 + length), length, vocab)
        suffixes = [_tokens(random.Random(f"{day}/{length}/{r}"), sizes.probe_suffix_tokens, vocab)
                    for r in range(sizes.probe_repeats + 1)]
        if fill:
            jobs.append(Job(first_id + len(jobs), "fill", tuple(prefix + suffixes[0]), (length,), lane=0,
                            prefix=length))
        for suffix in suffixes[1:]:
            jobs.append(Job(first_id + len(jobs), "probe", tuple(prefix + suffix), (length,), lane=0,
                            prefix=length))
    return jobs


def kv_bytes_per_token(spec: ModelSpec) -> int:
    """KV bytes one token occupies in a block (float32), from the model's shape alone (no weights built)."""
    if spec.name == "default":
        from tiercache.worker.model import default_model_config

        c = default_model_config()
        return c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * 4
    if spec.name == "gpt2-small":
        return 12 * 2 * 768 * 4
    raise InvalidArgument(f"unknown model {spec.name!r}; expected one of {', '.join(MODELS)}")
