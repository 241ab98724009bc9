"""Token generation with sampling (temperature, top-p, seed), a per-token callback and stop on request."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache

from tiercache.errors import InvalidArgument
from tiercache.worker.kvcache import prefill


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen. temperature 0 is greedy (argmax), exactly as greedy_generate."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None  # None: a fresh random stream per request

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature <= 100.0:
            raise InvalidArgument(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidArgument(f"top_p must be in (0, 1], got {self.top_p!r}")


def _choose(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    if sampling.temperature == 0.0 or generator is None:
        return int(torch.argmax(logits).item())
    probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:
        ordered, order = torch.sort(probs, descending=True)
        # Keep the smallest set of tokens whose mass reaches top_p (the most likely one always).
        keep = torch.cumsum(ordered, dim=-1) - ordered < sampling.top_p
        probs = torch.zeros_like(probs).scatter_(0, order[keep], ordered[keep])
    return int(torch.multinomial(probs.cpu(), 1, generator=generator).item())


def generate(model: PreTrainedModel, cache: Cache, first_logits: torch.Tensor, max_new_tokens: int, *,
             eos_token_id: int | None = None, sampling: Sampling = Sampling(),
             on_token: Callable[[int], bool] | None = None) -> tuple[list[int], str]:
    """Up to max_new_tokens ids from first_logits on; returns (ids, finish) with finish "stop" (EOS),
    "length" (max_new_tokens reached) or "cancelled" (on_token returned False after an id).

    Extends `cache` in place with every generated id except the last. `on_token` sees each id as
    soon as it is chosen, before the next forward pass.
    """
    if max_new_tokens < 0:
        raise InvalidArgument(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    generator = None
    if sampling.temperature > 0.0:
        generator = torch.Generator()
        if sampling.seed is None:
            generator.seed()
        else:
            generator.manual_seed(sampling.seed)
    tokens: list[int] = []
    logits = first_logits
    while len(tokens) < max_new_tokens:
        token = _choose(logits, sampling, generator)
        tokens.append(token)
        if on_token is not None and not on_token(token):
            return tokens, "cancelled"
        if token == eos_token_id:
            return tokens, "stop"
        if len(tokens) == max_new_tokens:
            break
        logits, cache = prefill(model, [token], cache)
    return tokens, "length"
