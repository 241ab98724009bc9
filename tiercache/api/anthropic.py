"""The Anthropic-compatible route: POST /v1/messages, with cache_control breakpoints mapped onto the cache's."""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field
from sse_starlette import EventSourceResponse, ServerSentEvent

from tiercache.api.auth import Who
from tiercache.api.errors import APIError, anthropic_body, from_exception
from tiercache.api.generate import MAX_STOP_STRINGS, Outcome, Params, Run
from tiercache.api.pool import WorkerFailed
from tiercache.api.state import Ready, State

router = APIRouter(prefix="/v1", tags=["anthropic"])

MAX_BREAKPOINTS = 4
TTL_S = {"5m": 300.0, "1h": 3600.0}


class CacheControl(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] = "5m"


class TextBlock(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None


class ToolUseBlock(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    cache_control: CacheControl | None = None


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    description: str = ""
    input_schema: dict[str, Any] = Field(default_factory=dict)
    cache_control: CacheControl | None = None


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: int = Field(ge=1)
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)  # None: 1
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)  # None: 1
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    cache_control: CacheControl | None = None  # automatic caching: a breakpoint after the last message


class CountTokensRequest(BaseModel):
    """POST /v1/messages/count_tokens: a request's prompt without the generation's fields."""

    model_config = ConfigDict(extra="ignore")
    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    cache_control: CacheControl | None = None


def conversation(body: MessagesRequest | CountTokensRequest) -> tuple[list[dict], list[dict] | None, list[int], float]:
    """(template messages, tools, marks: the message index after which each cache_control falls (-1: after
    the tools), the longest TTL asked). A 400 for more than four breakpoints."""
    messages: list[dict] = []
    marks: list[int] = []
    ttls: list[float] = []

    def mark(control: CacheControl | None, index: int) -> None:
        if control is not None:
            marks.append(index)
            ttls.append(TTL_S[control.ttl])

    tools = None
    if body.tools:
        tools = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                   "parameters": t.input_schema}} for t in body.tools]
        for t in body.tools:
            mark(t.cache_control, -1)
    if body.system:
        system = [TextBlock(type="text", text=body.system)] if isinstance(body.system, str) else body.system
        messages.append({"role": "system", "content": "".join(part.text for part in system)})
        for part in system:
            mark(part.cache_control, 0)
    for m in body.messages:
        parts: list[Block] = [TextBlock(type="text", text=m.content)] if isinstance(m.content, str) else m.content
        text = "".join(b.text for b in parts if isinstance(b, TextBlock))
        calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}}
                 for b in parts if isinstance(b, ToolUseBlock)]
        for b in parts:
            if isinstance(b, ToolResultBlock):
                content = b.content if isinstance(b.content, str) else "".join(t.text for t in b.content)
                messages.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": content})
                mark(b.cache_control, len(messages) - 1)
        if text or calls or not any(isinstance(b, ToolResultBlock) for b in parts):
            item: dict[str, Any] = {"role": m.role, "content": text}
            if calls:
                item["tool_calls"] = calls
            messages.append(item)
        for b in parts:
            if not isinstance(b, ToolResultBlock):
                mark(b.cache_control, len(messages) - 1)
    mark(body.cache_control, len(messages) - 1)
    if len(marks) > MAX_BREAKPOINTS:
        raise APIError(400, f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be provided. "
                            f"Found {len(marks)}.", param="cache_control")
    return messages, tools, marks, max(ttls, default=0.0)


def usage(outcome: Outcome, breakpoints: list[int]) -> dict:
    """Anthropic's split of the prompt: read from the cache, written to it (computed tokens up to the last
    breakpoint), and the rest; the three add up to the prompt's tokens."""
    last = max(breakpoints, default=0)
    read = outcome.cached_tokens
    created = max(0, min(last, outcome.prompt_tokens) - read)
    return {"input_tokens": outcome.prompt_tokens - read - created, "cache_creation_input_tokens": created,
            "cache_read_input_tokens": read, "output_tokens": outcome.completion_tokens}


def stop_reason(outcome: Outcome) -> tuple[str, str | None]:
    if outcome.stop is not None:
        return "stop_sequence", outcome.stop
    return ("max_tokens" if outcome.finish_reason == "length" else "end_turn"), None


@router.post("/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, api: State,
                       who: Who) -> dict:
    """The prompt's tokens as /v1/messages would count them (chat template included); no worker needed."""
    api.check_model(body.model)
    chat, tools, _, _ = conversation(body)
    tokens, _ = api.chat.chat(chat, tools)
    return {"input_tokens": len(tokens)}


@router.post("/messages")
async def messages(body: MessagesRequest, request: Request, api: Ready,
                   who: Who) -> Any:
    api.check_model(body.model)
    if body.stop_sequences and len(body.stop_sequences) > MAX_STOP_STRINGS:
        raise APIError(400, f"stop_sequences: at most {MAX_STOP_STRINGS}, got {len(body.stop_sequences)}",
                       param="stop_sequences")
    chat, tools, marks, ttl = conversation(body)
    tokens, breakpoints = api.chat.chat(chat, tools, marks)
    params = Params(max_tokens=api.max_tokens(len(tokens), body.max_tokens, "max_tokens"),
                    temperature=1.0 if body.temperature is None else body.temperature,
                    top_p=1.0 if body.top_p is None else body.top_p, stop=body.stop_sequences or [],
                    breakpoints=breakpoints, pin_ttl_s=ttl, salt=who.salt, tenant=who.tenant)
    run = await Run.start(api.pool, api.chat.tokenizer, tokens, params)
    message_id = f"msg_{uuid.uuid4().hex[:24]}"
    head = {"id": message_id, "type": "message", "role": "assistant", "model": api.model_id}
    if not body.stream:
        text = await run.text(request.receive)
        api.metrics.observe(run.outcome)
        reason, sequence = stop_reason(run.outcome)
        return {**head, "content": [{"type": "text", "text": text}], "stop_reason": reason,
                "stop_sequence": sequence, "usage": usage(run.outcome, breakpoints)}

    async def events():
        start = {**head, "content": [], "stop_reason": None, "stop_sequence": None,
                 "usage": usage(run.outcome, breakpoints)}
        yield _event("message_start", {"type": "message_start", "message": start})
        yield _event("content_block_start", {"type": "content_block_start", "index": 0,
                                             "content_block": {"type": "text", "text": ""}})
        try:
            async for delta in run.deltas():
                yield _event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                     "delta": {"type": "text_delta", "text": delta}})
        except WorkerFailed as e:  # the worker died mid-stream
            yield _event("error", anthropic_body(from_exception(e)))
            return
        yield _event("content_block_stop", {"type": "content_block_stop", "index": 0})
        reason, sequence = stop_reason(run.outcome)
        yield _event("message_delta", {"type": "message_delta",
                                       "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                       "usage": usage(run.outcome, breakpoints)})
        yield _event("message_stop", {"type": "message_stop"})
        api.metrics.observe(run.outcome)

    return EventSourceResponse(events(), ping=15, sep="\n")


def _event(name: str, data: dict) -> ServerSentEvent:
    return ServerSentEvent(data=json.dumps(data), event=name)
