"""One generation as the API families see it: text deltas (stop strings applied) and the final figures."""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tiercache.api.pool import Generation, WorkerPool

MAX_STOP_STRINGS = 4
MAX_CHARACTER_TOKENS = 3  # a UTF-8 character takes at most 4 bytes: tokens held back while it may be incomplete


@dataclass
class Params:
    """What a request asks of one generation, in the worker's terms."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: Sequence[str] = ()
    breakpoints: Sequence[int] = ()
    pin_ttl_s: float = 0.0
    salt: str = ""
    cache: bool = True
    tenant: str = ""  # who asked (the status page lists a tenant's own requests to it)


@dataclass
class Outcome:
    """The figures of a finished generation; `finish_reason` is "stop" or "length"."""

    text: str = ""
    finish_reason: str = "length"
    stop: str | None = None  # the stop string that ended it
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float = 0.0  # from the request's arrival to its first token, queue included
    total_s: float = 0.0
    prefill_s: float = 0.0
    tiers: list[str] = field(default_factory=list)
    tenant: str = ""


class TextStream:
    """Token ids to text deltas: a delta never ends inside a UTF-8 sequence, and text that might be the
    start of a stop string is held back until it is known not to be."""

    def __init__(self, tokenizer: Any, stop: Sequence[str]) -> None:
        self._tokenizer = tokenizer
        self._stop = [s for s in stop if s]
        self._ids: list[int] = []
        self._text = ""  # decoded so far
        self._sent = 0  # characters of _text already given out
        self._waiting = 0  # tokens held back since the text last ended in a whole character
        self.stopped: str | None = None  # the stop string found

    def feed(self, token: int) -> str:
        self._ids.append(token)
        text = self._tokenizer.decode(self._ids)
        if text.endswith("\ufffd") and self._waiting < MAX_CHARACTER_TOKENS:
            self._waiting += 1  # a multi-byte character may not be complete yet
            return ""
        self._waiting = 0  # complete, or bytes that never make a character: given out as U+FFFD
        self._text = text
        for stop in self._stop:
            at = text.find(stop, max(0, self._sent - len(stop)))
            if at != -1:
                self.stopped = stop
                self._text = text[:at]
                return self._flush(len(self._text))
        hold = max((len(s) - 1 for s in self._stop), default=0)
        return self._flush(max(self._sent, len(text) - hold))

    def finish(self) -> str:
        """The held-back text, once generation ended without a stop string."""
        if not self.stopped:
            self._text = self._tokenizer.decode(self._ids)
        return self._flush(len(self._text))

    def _flush(self, upto: int) -> str:
        delta = self._text[self._sent: upto]
        self._sent = max(self._sent, upto)
        return delta

    @property
    def text(self) -> str:
        return self._text[: self._sent]


class Run:
    """One generation as the API families see it. `await Run.start(...)` sends the request (a full queue
    or a pool still loading raises there) and, unless told not to, waits for the first token, so that
    a prompt the worker refuses raises before any response is sent; then `deltas()` yields text and
    `outcome` is filled in at its end. A streamed response may start before the first token
    (`wait_first=False`; the client reads the headers meanwhile) and call `first()` itself.

    A consumer that stops iterating (its client went away) cancels the generation: the worker is
    free again after its current token.
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str], generation: Generation, start: float) -> None:
        self._tokenizer = tokenizer
        self._stream = TextStream(tokenizer, stop)
        self._start = start
        self._generation = generation
        self._tokens: AsyncIterator[int] = aiter(generation)
        self._first: int | None = None
        self._waited = False
        self.outcome = Outcome()

    @classmethod
    async def start(cls, pool: WorkerPool, tokenizer: Any, tokens: list[int], params: Params,
                    wait_first: bool = True) -> Run:
        start = time.perf_counter()
        fields = {"tokens": tuple(tokens), "max_new_tokens": params.max_tokens,
                  "breakpoints": tuple(params.breakpoints), "salt": params.salt, "cache": params.cache,
                  "pin_ttl_s": params.pin_ttl_s, "temperature": params.temperature, "top_p": params.top_p,
                  "seed": params.seed, "preview": "" if params.salt else tokenizer.decode(tokens[:64])}
        run = cls(tokenizer, params.stop, await pool.submit(fields), start)
        run.outcome.prompt_tokens, run.outcome.tenant = len(tokens), params.tenant
        # A response that never starts (its client left while the request queued) never iterates deltas();
        # once the Run is dropped, the generation is cancelled all the same.
        weakref.finalize(run, run._generation.cancel)
        if wait_first:
            await run.first()
        return run

    async def first(self) -> None:
        """Wait for the first token (once); raises pool.WorkerFailed when the worker refused the prompt."""
        if self._waited:
            return
        self._waited = True
        try:
            self._first = await anext(self._tokens)
        except StopAsyncIteration:
            self._first = None  # max_tokens 0: nothing to generate
        except BaseException:
            self._generation.cancel()
            raise
        if self._first is not None:
            self.outcome.ttft_s = time.perf_counter() - self._start
        self.outcome.cached_tokens = self._generation.cached_tokens

    def cancel(self) -> None:
        self._generation.cancel()

    async def deltas(self) -> AsyncIterator[str]:
        """Text deltas until the generation ends (EOS, max_tokens or a stop string)."""
        outcome, stream, generation = self.outcome, self._stream, self._generation
        eos = getattr(self._tokenizer, "eos_token_id", None)
        await self.first()
        try:
            token = self._first
            while token is not None:
                outcome.completion_tokens += 1
                if token != eos:
                    delta = stream.feed(token)
                    if delta:
                        yield delta
                    if stream.stopped:
                        generation.cancel()
                        await generation.finish()
                        break
                token = await anext(self._tokens, None)
        finally:
            generation.cancel()  # a no-op unless the consumer stopped early (its client went away)
        tail = stream.finish()
        if tail:
            yield tail
        result = generation.result or {}
        outcome.text = stream.text
        outcome.stop = stream.stopped
        outcome.prompt_tokens = result.get("prompt_tokens", outcome.prompt_tokens)
        outcome.cached_tokens = result.get("cached_tokens", outcome.cached_tokens)
        outcome.prefill_s = result.get("prefill_s", 0.0)
        outcome.tiers = result.get("tiers", [])
        outcome.finish_reason = "stop" if stream.stopped or result.get("finish_reason") == "stop" else "length"
        outcome.total_s = time.perf_counter() - self._start

    async def text(self, receive: Callable[[], Awaitable[Mapping[str, Any]]] | None = None) -> str:
        """The whole completion (non-streaming responses). With the request's ASGI `receive`, a client that
        disconnects first cancels the generation (the worker is free after its current token)."""
        whole = asyncio.ensure_future(self._join())
        if receive is None:
            return await whole
        gone = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait({whole, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not whole.done():
                whole.cancel()
        if not whole.done() or whole.cancelled():
            raise asyncio.CancelledError("the client disconnected")
        return whole.result()

    async def _join(self) -> str:
        return "".join([delta async for delta in self.deltas()])


async def _disconnected(receive: Callable[[], Awaitable[Mapping[str, Any]]]) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def prompt_token_ids(value: object, vocab_size: int, name: str) -> list[int] | None:
    """`value` as a list of token ids when it is one, else None; InvalidArgument for ids outside the vocabulary."""
    from tiercache.errors import InvalidArgument

    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        bad = next((t for t in value if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise InvalidArgument(f"{name}: token id {bad} is outside the model's vocabulary [0, {vocab_size})")
        return list(value)
    return None
