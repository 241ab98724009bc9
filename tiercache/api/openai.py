"""The OpenAI-compatible routes: /v1/models, /v1/chat/completions, /v1/completions (SSE when streaming)."""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Header, Request
from pydantic import BaseModel, ConfigDict, Field
from sse_starlette import EventSourceResponse

from tiercache.api.auth import Caller, Who
from tiercache.api.errors import APIError, from_exception
from tiercache.api.errors import openai_body as error_body
from tiercache.api.generate import (
    MAX_STOP_STRINGS,
    Outcome,
    Params,
    Run,
    prompt_token_ids,
)
from tiercache.api.pool import WorkerFailed
from tiercache.api.state import APIState, Ready, State

router = APIRouter(prefix="/v1", tags=["openai"])


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str = "{}"  # a JSON object, as a string


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class CommonFields(BaseModel):
    """The fields chat and text completions share."""

    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: int | None = Field(default=None, ge=0)
    # null is the default for these, as OpenAI's spec allows (LangChain and LiteLLM send it)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)  # None: 1
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)  # None: 1
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None  # None: 1
    stream: bool | None = None  # None: false
    stream_options: StreamOptions | None = None
    user: str | None = None


class ChatCompletionRequest(CommonFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    tools: list[dict[str, Any]] | None = None


class CompletionRequest(CommonFields):
    # A list of one prompt (LangChain's OpenAI class always sends a list); a batch of several is refused.
    prompt: str | list[int] | list[str] | list[list[int]] = Field(min_length=1)


def template_messages(messages: list[ChatMessage]) -> list[dict]:
    """Messages as chat templates take them: text parts joined, developer as system, tool-call arguments as
    objects (templates print them as JSON)."""
    out = []
    for i, m in enumerate(messages):
        content = m.content if isinstance(m.content, str) or m.content is None else "".join(p.text for p in m.content)
        item: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
        if m.name:
            item["name"] = m.name
        if m.tool_call_id:
            item["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            calls = []
            for j, call in enumerate(m.tool_calls):
                try:
                    arguments = json.loads(call.function.arguments or "{}")
                except json.JSONDecodeError as e:
                    raise APIError(400, f"messages[{i}].tool_calls[{j}].function.arguments is not JSON: {e}",
                                   param=f"messages[{i}].tool_calls[{j}].function.arguments") from None
                calls.append({"id": call.id, "type": "function",
                              "function": {"name": call.function.name, "arguments": arguments}})
            item["tool_calls"] = calls
        out.append(item)
    return out


def params_for(body: CommonFields, api: APIState, who: Caller, prompt_tokens: int, max_tokens: int | None,
               limit_name: str, cache_header: str | None) -> Params:
    if body.n not in (None, 1):
        raise APIError(400, f"n={body.n} is not supported: this server returns one choice per request", param="n")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > MAX_STOP_STRINGS:
        raise APIError(400, f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}", param="stop")
    return Params(max_tokens=api.max_tokens(prompt_tokens, max_tokens, limit_name),
                  temperature=1.0 if body.temperature is None else body.temperature,
                  top_p=1.0 if body.top_p is None else body.top_p, seed=body.seed, stop=stop, salt=who.salt,
                  tenant=who.tenant,
                  cache=(cache_header or "").lower() not in ("off", "false", "0"))


def usage(outcome: Outcome) -> dict:
    return {"prompt_tokens": outcome.prompt_tokens, "completion_tokens": outcome.completion_tokens,
            "total_tokens": outcome.prompt_tokens + outcome.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": outcome.cached_tokens}}


def _sse(run: Run, api: APIState, head: dict, piece: Any, include_usage: bool) -> EventSourceResponse:
    """The SSE body of a streamed completion: one chunk per delta (`piece(text, finish)` gives a choice),
    a last chunk with the finish reason, the usage chunk when asked, then [DONE]."""

    async def events():
        extra = {"usage": None} if include_usage else {}
        try:
            await run.first()
        except WorkerFailed as e:  # the response has started: the error goes in the stream, as OpenAI's does
            yield json.dumps({"error": error_body(from_exception(e))})
            return
        first = piece("", None, True)
        if first is not None:
            yield json.dumps({**head, "choices": [first], **extra})
        try:
            async for delta in run.deltas():
                yield json.dumps({**head, "choices": [piece(delta, None, False)], **extra})
        except WorkerFailed as e:  # the worker died mid-stream
            yield json.dumps({"error": error_body(from_exception(e))})
            return
        outcome = run.outcome
        yield json.dumps({**head, "choices": [piece("", outcome.finish_reason, False)], **extra})
        if include_usage:
            yield json.dumps({**head, "choices": [], "usage": usage(outcome)})
        api.metrics.observe(outcome)
        yield "[DONE]"

    return EventSourceResponse(events(), ping=15, sep="\n")


async def _start(api: APIState, tokens: list[int], params: Params, stream: bool) -> Run:
    # A stream's headers go out while the prompt is prefilled; a whole answer waits for the first token,
    # so that a prompt the worker refuses gets its HTTP status.
    return await Run.start(api.pool, api.chat.tokenizer, tokens, params, wait_first=not stream)


def _model(api: APIState) -> dict:
    return {"id": api.model_id, "object": "model", "created": int(api.started), "owned_by": "tiercache"}


@router.get("/models")
async def list_models(api: State, who: Who) -> dict:
    """The served model, named while the workers still load it (a UI reads this list when it connects)."""
    return {"object": "list", "data": [_model(api)] if api.model_id else []}


@router.get("/models/{model:path}")
async def get_model(model: str, api: State, who: Who) -> dict:
    api.check_model(model)
    return _model(api)


@router.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, api: Ready,
                           who: Who,
                           x_tiercache_cache: Annotated[str | None, Header()] = None) -> Any:
    api.check_model(body.model)
    tokens, _ = api.chat.chat(template_messages(body.messages), body.tools)
    limit, name = ((body.max_completion_tokens, "max_completion_tokens") if body.max_completion_tokens is not None
                   else (body.max_tokens, "max_tokens"))
    params = params_for(body, api, who, len(tokens), limit, name, x_tiercache_cache)
    run = await _start(api, tokens, params, bool(body.stream))
    head = {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion.chunk", "created": int(time.time()),
            "model": api.model_id, "system_fingerprint": None}
    if body.stream:
        def piece(text: str, finish: str | None, first: bool) -> dict:
            delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}

        include = bool(body.stream_options and body.stream_options.include_usage)
        return _sse(run, api, head, piece, include)
    text = await run.text(request.receive)
    api.metrics.observe(run.outcome)
    return {**head, "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                         "logprobs": None, "finish_reason": run.outcome.finish_reason}],
            "usage": usage(run.outcome)}


@router.post("/completions")
async def completions(body: CompletionRequest, request: Request, api: Ready,
                      who: Who,
                      x_tiercache_cache: Annotated[str | None, Header()] = None) -> Any:
    api.check_model(body.model)
    prompt: Any = body.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    tokens = prompt_token_ids(prompt, int(api.pool.info.get("vocab_size") or 0), "prompt")
    if tokens is None:
        if not isinstance(prompt, str):
            raise APIError(400, f"prompt: a batch of {len(prompt)} prompts is not supported; give one string or "
                                "one list of token ids", param="prompt")
        tokens = api.chat.encode(prompt, templated=False)
    params = params_for(body, api, who, len(tokens), body.max_tokens, "max_tokens", x_tiercache_cache)
    run = await _start(api, tokens, params, bool(body.stream))
    head = {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "object": "text_completion", "created": int(time.time()),
            "model": api.model_id, "system_fingerprint": None}
    if body.stream:
        def piece(text: str, finish: str | None, first: bool) -> dict | None:
            return None if first else {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}

        include = bool(body.stream_options and body.stream_options.include_usage)
        return _sse(run, api, head, piece, include)
    text = await run.text(request.receive)
    api.metrics.observe(run.outcome)
    return {**head, "choices": [{"index": 0, "text": text, "logprobs": None,
                                 "finish_reason": run.outcome.finish_reason}], "usage": usage(run.outcome)}
