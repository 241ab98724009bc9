"""Fetch or recompute: the worker's cost model, from speeds it measures at run time."""

from __future__ import annotations


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
