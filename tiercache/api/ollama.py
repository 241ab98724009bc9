"""The Ollama-compatible routes: /api/tags, /api/version, /api/ps, /api/show, /api/chat, /api/generate (NDJSON)."""

from __future__ import annotations

import datetime
import json
from collections.abc import Callable, Coroutine
from typing import Any, Literal

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field

from tiercache.api.auth import Caller, Who
from tiercache.api.errors import APIError, from_exception
from tiercache.api.generate import MAX_STOP_STRINGS, Params, Run
from tiercache.api.pool import WorkerFailed
from tiercache.api.state import APIState, Ready, State

VERSION = "0.6.0"  # the Ollama API version these routes follow
# The saving, where clients that drop unknown body fields (LangChain's ChatOllama, LiteLLM) still see it.
CACHED_HEADER, PROMPT_HEADER = "X-Tiercache-Cached-Tokens", "X-Tiercache-Prompt-Tokens"


class AnyJSONRoute(APIRoute):
    """A route that reads its body as JSON whatever the Content-Type says, as Ollama does: LiteLLM's Ollama
    providers send none, `curl -d` sends application/x-www-form-urlencoded."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
            if request.method == "POST" and not (kind == "application/json" or kind.endswith("+json")):
                headers = [(k, v) for k, v in request.scope["headers"] if k != b"content-type"]
                scope = {**request.scope, "headers": [*headers, (b"content-type", b"application/json")]}
                request = Request(scope, request.receive)
            return await handler(request)

        return route


router = APIRouter(prefix="/api", tags=["ollama"], route_class=AnyJSONRoute)


class Options(BaseModel):
    model_config = ConfigDict(extra="ignore")
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)  # None: 0.8, Ollama's default
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)  # None: 0.9
    seed: int | None = None
    num_predict: int | None = None  # -1: as many as the context allows
    stop: list[str] | None = None


class ToolFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)  # an object, as Ollama sends it


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    function: ToolFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    messages: list[ChatMessage] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    stream: bool | None = None  # None: true, as Ollama's
    options: Options = Field(default_factory=Options)


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    prompt: str = ""
    system: str | None = None
    raw: bool = False
    stream: bool | None = None
    options: Options = Field(default_factory=Options)


class ShowRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str = ""
    name: str = ""  # the older spelling of `model`


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat().replace("+00:00", "Z")


def _details(api: APIState) -> dict:
    return {"parent_model": "", "format": "safetensors", "family": api.model_id.split("/")[0],
            "families": None, "parameter_size": "", "quantization_level": api.pool.info.get("dtype", "")}


def _entry(api: APIState) -> dict:
    return {"name": f"{api.model_id}:latest", "model": f"{api.model_id}:latest",
            "modified_at": datetime.datetime.fromtimestamp(api.started, datetime.UTC).isoformat(),
            "size": 0, "digest": "", "details": _details(api)}


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def _params(api: APIState, who: Caller, options: Options, prompt_tokens: int) -> Params:
    stop = options.stop or []
    if len(stop) > MAX_STOP_STRINGS:
        raise APIError(400, f"options.stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    asked = None if options.num_predict is None or options.num_predict < 0 else options.num_predict
    return Params(max_tokens=api.max_tokens(prompt_tokens, asked, "options.num_predict"),
                  temperature=0.8 if options.temperature is None else options.temperature,
                  top_p=0.9 if options.top_p is None else options.top_p, seed=options.seed, stop=stop, salt=who.salt,
                  tenant=who.tenant)


def _final(api: APIState, run: Run, extra: dict) -> dict:
    o = run.outcome
    return {"model": api.model_id, "created_at": _now(), **extra, "done": True,
            "done_reason": "stop" if o.finish_reason == "stop" else "length",
            "total_duration": _ns(o.total_s), "load_duration": 0,
            "prompt_eval_count": o.prompt_tokens, "prompt_eval_duration": _ns(o.prefill_s),
            "eval_count": o.completion_tokens, "eval_duration": _ns(max(0.0, o.total_s - o.ttft_s)),
            "prompt_eval_cached_count": o.cached_tokens}  # Ollama's name: prompt tokens read from the cache


async def _respond(api: APIState, request: Request, run: Run, stream: bool, piece: Any) -> Any:
    """NDJSON lines (one per delta, then the final object) when streaming, else one object. The run has
    its first token: the headers carry the cached and prompt tokens."""
    headers = {CACHED_HEADER: str(run.outcome.cached_tokens), PROMPT_HEADER: str(run.outcome.prompt_tokens)}
    if not stream:
        text = await run.text(request.receive)
        api.metrics.observe(run.outcome)
        return JSONResponse(_final(api, run, piece(text)), headers=headers)

    async def lines():
        try:
            async for delta in run.deltas():
                yield json.dumps({"model": api.model_id, "created_at": _now(), **piece(delta), "done": False}) + "\n"
        except WorkerFailed as e:  # the worker died mid-stream
            yield json.dumps({"error": str(from_exception(e))}) + "\n"
            return
        api.metrics.observe(run.outcome)
        yield json.dumps(_final(api, run, piece(""))) + "\n"

    return StreamingResponse(lines(), media_type="application/x-ndjson", headers=headers)


@router.get("/version")
async def version() -> dict:
    return {"version": VERSION}


@router.get("/tags")
async def tags(api: State, who: Who) -> dict:
    return {"models": [_entry(api)] if api.model_id else []}  # named while the workers load it


@router.get("/ps")
async def ps(api: State, who: Who) -> dict:
    if not api.pool.ready:
        return {"models": []}
    return {"models": [{**_entry(api), "expires_at": "0001-01-01T00:00:00Z", "size_vram": 0,
                        "context_length": api.context}]}


@router.post("/show")
async def show(body: ShowRequest, api: State, who: Who) -> dict:
    name = body.model or body.name
    if not name:
        raise APIError(400, "model: required")
    api.check_model(name, ollama=True)
    info = api.pool.info
    return {"modelfile": "", "parameters": "", "template": api.chat.template_source, "details": _details(api),
            "model_info": {"general.architecture": api.model_id.split("/")[0],
                           "general.context_length": api.context, "general.block_count": info.get("num_layers", 0)},
            "capabilities": ["completion", "tools"], "modified_at": _entry(api)["modified_at"]}


@router.post("/chat")
async def chat(body: ChatRequest, request: Request, api: Ready,
               who: Who) -> Any:
    api.check_model(body.model, ollama=True)
    if not body.messages:  # Ollama's way of loading a model: answer at once
        return {"model": api.model_id, "created_at": _now(), "message": {"role": "assistant", "content": ""},
                "done_reason": "load", "done": True}
    messages = []
    for m in body.messages:
        item: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            item["tool_calls"] = [{"type": "function", "function": {"name": c.function.name,
                                                                    "arguments": c.function.arguments}}
                                  for c in m.tool_calls]
        if m.tool_name:
            item["name"] = m.tool_name
        messages.append(item)
    tokens, _ = api.chat.chat(messages, body.tools)
    run = await Run.start(api.pool, api.chat.tokenizer, tokens, _params(api, who, body.options, len(tokens)))
    return await _respond(api, request, run, body.stream is not False,
                          lambda text: {"message": {"role": "assistant", "content": text}})


@router.post("/generate")
async def generate(body: GenerateRequest, request: Request, api: Ready,
                   who: Who) -> Any:
    api.check_model(body.model, ollama=True)
    if not body.prompt:  # Ollama's way of loading a model
        return {"model": api.model_id, "created_at": _now(), "response": "", "done_reason": "load", "done": True}
    if body.raw:
        tokens = api.chat.encode(body.prompt, templated=False)
    else:
        messages = ([{"role": "system", "content": body.system}] if body.system else [])
        tokens, _ = api.chat.chat([*messages, {"role": "user", "content": body.prompt}])
    run = await Run.start(api.pool, api.chat.tokenizer, tokens, _params(api, who, body.options, len(tokens)))
    return await _respond(api, request, run, body.stream is not False, lambda text: {"response": text})
