"""The HTTP API against a real server (2 worker processes, its own daemon), called with the official
`openai`, `anthropic` and `ollama` clients: cached prefixes show in usage, cache on and off give the
same completion, bad input gets its status and error shape, a disconnect frees its worker, and 16
streaming clients on 2 workers all complete."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time

import anthropic
import httpx
import ollama
import openai
import pytest
from test_api_harness import MODEL, SYSTEM, ApiServer, chat_tokens, wait_for_prefix, wait_idle


@pytest.fixture(scope="module")
def server():
    s = ApiServer(workers=2)
    s.wait_ready()
    yield s
    assert s.stop() == 0, "".join(s.log)[-3000:]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def conversation(user: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def chat(client, user: str, **kwargs):
    messages = conversation(user)
    options = {"temperature": 0, "max_tokens": 8, **kwargs}
    return client.chat.completions.create(model=MODEL, messages=messages, **options)


def test_models_lists_the_served_model(client) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_a_second_request_with_a_shared_prefix_reports_cached_tokens(server, client) -> None:
    first = chat(client, "turn on the kitchen lights")
    assert first.usage.prompt_tokens_details.cached_tokens == 0  # present, and 0: nothing was reused
    assert first.choices[0].finish_reason == "length" and first.usage.completion_tokens == 8
    wait_for_prefix(server, chat_tokens(conversation("turn on the kitchen lights")))
    second = chat(client, "what's the weather tomorrow?")
    cached = second.usage.prompt_tokens_details.cached_tokens
    # The system prompt's full blocks are reused; cached tokens are counted inside prompt_tokens.
    assert len(SYSTEM) - 16 <= cached < second.usage.prompt_tokens, second.usage
    assert second.usage.total_tokens == second.usage.prompt_tokens + second.usage.completion_tokens


def test_a_prompt_with_newlines_and_quotes_in_its_first_characters_is_cached(server, client) -> None:
    # Regression: the preview stored with a chain's first block (its first 64 characters) went into the
    # staged Put's header, which takes printable ASCII without quotes only: the Put was refused.
    # Long enough that fetching its blocks always beats recomputing them (the worker's cost model).
    messages = [{"role": "system", "content": 'Be "brief".\nÉté.'}, {"role": "user", "content": "x" * 600}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0)
    wait_for_prefix(server, chat_tokens(messages))
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == (first.usage.prompt_tokens - 1) // 16 * 16 > 0
    assert not any("put failed" in line for line in server.log), "".join(server.log)[-2000:]


def test_the_completion_is_identical_with_the_cache_on_and_off(server, client) -> None:
    chat(client, "dim the bedroom lights")
    wait_for_prefix(server, chat_tokens(conversation("dim the bedroom lights")))
    on = chat(client, "dim the bedroom lights", max_tokens=24)
    off = chat(client, "dim the bedroom lights", max_tokens=24, extra_headers={"x-tiercache-cache": "off"})
    assert on.usage.prompt_tokens_details.cached_tokens > len(SYSTEM)
    assert off.usage.prompt_tokens_details.cached_tokens == 0
    assert on.choices[0].message.content == off.choices[0].message.content
    assert on.usage.completion_tokens == off.usage.completion_tokens == 24


def test_streaming_chunks_share_id_and_created_and_end_with_usage(client) -> None:
    stream = chat(client, "play some jazz", max_tokens=6, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 0
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat(client, "play some jazz", max_tokens=6).choices[0].message.content


def test_stop_strings_end_the_completion_before_the_stop(client) -> None:
    full = chat(client, "lock the garage", max_tokens=16).choices[0].message.content
    assert len(full) >= 4
    stop = full[2:4]
    cut = chat(client, "lock the garage", max_tokens=16, stop=[stop])
    assert cut.choices[0].finish_reason == "stop", (full, stop, cut)
    assert cut.choices[0].message.content == full[: full.index(stop)]
    streamed = chat(client, "lock the garage", max_tokens=16, stop=stop, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == full[: full.index(stop)]


def test_sampling_with_a_seed_repeats_and_differs_from_greedy_at_high_temperature(client) -> None:
    def sample(seed: int) -> str:
        return chat(client, "start a timer", max_tokens=24, temperature=2.0, top_p=1.0, seed=seed,
                    ).choices[0].message.content

    assert sample(7) == sample(7)
    greedy = chat(client, "start a timer", max_tokens=24).choices[0].message.content
    assert {sample(1), sample(2), sample(3)} != {greedy}


def test_roles_text_parts_and_tools_reach_the_template(client) -> None:
    messages = [{"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
                {"role": "user", "content": [{"type": "text", "text": "weather?"}, {"type": "text", "text": " now"}]},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function",
                     "function": {"name": "weather.get", "arguments": '{"day":"today"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "12 C, rain"}]
    tool = {"type": "function", "function": {"name": "weather.get", "parameters": {"type": "object"}}}
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0,
                                           extra_body={"an_unknown_field": "is ignored"})
    with_tools = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0,
                                                tools=[tool])
    # The built-in template prints the arguments as JSON and each tool's definition.
    assert with_tools.usage.prompt_tokens == plain.usage.prompt_tokens + len(json.dumps(tool)) + len("\n# Tools\n")


def test_text_completions_take_text_or_token_ids(client) -> None:
    text = client.completions.create(model=MODEL, prompt="The kitchen lights are", max_tokens=6, temperature=0)
    ids = client.completions.create(model=MODEL, prompt=[1] + [b + 3 for b in b"The kitchen lights are"],
                                    max_tokens=6, temperature=0)
    assert text.choices[0].text == ids.choices[0].text
    assert text.usage.prompt_tokens == ids.usage.prompt_tokens == 23  # one BOS, one id per byte
    streamed = client.completions.create(model=MODEL, prompt="The kitchen lights are", max_tokens=6, temperature=0,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == text.choices[0].text


@pytest.mark.parametrize("body, status, param, words", [
    ({"n": 2}, 400, "n", "n=2 is not supported"),
    ({"model": "gpt-4o"}, 404, "model", "model 'gpt-4o' is not served here"),
    ({"messages": [{"role": "bot", "content": "hi"}]}, 400, "messages[0].role", "Input should be"),
    ({"messages": []}, 400, "messages", "at least 1 item"),
    ({"temperature": 5}, 400, "temperature", "less than or equal to 2"),
    ({"top_p": 0}, 400, "top_p", "greater than 0"),
    ({"max_tokens": -1}, 400, "max_tokens", "greater than or equal to 0"),
    ({"max_tokens": 9000}, 400, "max_tokens", "exceed the model's context of 8192 tokens"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages[0].content[0].type", "Input should be 'text'"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "1", "type": "function",
                                                         "function": {"name": "f", "arguments": "{oops"}}]}]},
     400, "messages[0].tool_calls[0].function.arguments", "is not JSON"),
    ({"stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "at most 4 stop strings"),
])
def test_bad_chat_requests_get_their_status_and_openai_error_shape(server, body, status, param, words) -> None:
    full = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **body}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=full, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and words in error["message"], error
    assert error["type"] == "invalid_request_error"


def test_other_bad_input_and_the_server_keeps_serving(server, client) -> None:
    r = httpx.post(f"{server.url}/v1/chat/completions", content=b"{not json", timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": [1, 99999]}, timeout=60)
    assert r.status_code == 400 and "token id 99999 is outside the model's vocabulary" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "x" * 8200}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = httpx.get(f"{server.url}/v1/nothing-here", timeout=60)
    assert r.status_code == 404 and "GET /v1/nothing-here" in r.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    assert chat(client, "still there?", max_tokens=2).choices[0].finish_reason == "length"


def test_anthropic_cache_control_maps_to_breakpoints_pins_and_usage(server) -> None:
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
    # The built-in template renders BOS, "<|system|>", the text and a newline before the user's turn:
    # with len(text) % 16 == 5 the breakpoint falls 1 token into a block whose other 15 tokens are the
    # user's, so only the breakpoint's tail block can give the next request the whole system prompt.
    text = "Anthropic-shaped. " + SYSTEM
    text += "." * ((5 - len(text)) % 16)
    system = [{"type": "text", "text": text, "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    breakpoint = len(text) + 12

    first = client.messages.create(model=MODEL, max_tokens=4, extra_body={"temperature": 0}, system=system,
                                   messages=[{"role": "user", "content": "turn on the hall lights"}])
    u = first.usage
    assert (u.cache_read_input_tokens, u.cache_creation_input_tokens) == (0, breakpoint)
    assert u.input_tokens == len("<|user|>turn on the hall lights\n<|assistant|>")
    assert first.stop_reason == "max_tokens" and first.content[0].type == "text" and u.output_tokens == 4
    pinned = _pinned_blocks(server, breakpoint // 16 + 1)  # the full blocks and the tail, pinned for 1 h
    assert all(3500 < b.pin_expires_at - time.time() <= 3600 for b in pinned)
    with client.messages.stream(model=MODEL, max_tokens=4, extra_body={"temperature": 0}, system=system,
                                messages=[{"role": "user", "content": "is the front door locked?"}]) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.usage.cache_read_input_tokens == breakpoint
    assert final.usage.cache_creation_input_tokens == 0
    assert final.usage.input_tokens == len("<|user|>is the front door locked?\n<|assistant|>")
    assert final.content[0].text == streamed and final.usage.output_tokens == 4
    too_many = [{"type": "text", "text": f"part {i}", "cache_control": {"type": "ephemeral"}} for i in range(5)]
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(model=MODEL, max_tokens=4, system=too_many,
                               messages=[{"role": "user", "content": "hi"}])
    assert refused.value.status_code == 400
    assert refused.value.body == {"type": "error", "error": {
        "type": "invalid_request_error",
        "message": "A maximum of 4 blocks with cache_control may be provided. Found 5."}}
    r = httpx.post(f"{server.url}/v1/messages", json={"model": MODEL, "max_tokens": 4, "messages": [
        {"role": "user", "content": "hi"}], "system": [{"type": "text", "text": "x", "cache_control": {
            "type": "ephemeral", "ttl": "2h"}}]}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "system" in r.json()["error"]["message"] and "ttl" in r.json()["error"]["message"]


def test_ollama_chat_generate_and_model_routes(server) -> None:
    client = ollama.Client(host=server.url, timeout=120)
    assert client.list().models[0].model == f"{MODEL}:latest"
    assert client.ps().models[0].model == f"{MODEL}:latest"
    assert client.show(MODEL).modelinfo["general.context_length"] == 8192
    assert httpx.get(f"{server.url}/api/version").json()["version"]
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "set the heating to 19"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"function": {"name": "thermostat.set", "arguments": {"zone": "ground", "celsius": 19}}}]},
                {"role": "tool", "content": "ok", "tool_name": "thermostat.set"}]
    options = {"temperature": 0, "num_predict": 5}
    whole = client.chat(model=MODEL, messages=messages, options=options)
    assert whole.done and whole.done_reason == "length" and whole.eval_count == 5
    assert whole.prompt_eval_count > len(SYSTEM) and whole.total_duration > 0
    parts = list(client.chat(model=MODEL, messages=messages, options=options, stream=True))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done and parts[-1].eval_count == 5
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert isinstance(parts[-1].prompt_eval_duration, int) and isinstance(parts[-1].eval_duration, int)
    generated = client.generate(model=MODEL, prompt="kitchen lights", options=options)
    assert generated.done and generated.eval_count == 5
    with pytest.raises(ollama.ResponseError) as missing:
        client.chat(model="llama3:8b", messages=messages)
    assert missing.value.status_code == 404 and "llama3:8b" in missing.value.error


def test_a_client_that_disconnects_mid_stream_frees_its_worker(server, client) -> None:
    before = server.metric("tiercache_api_tokens_generated_total")
    streams = [chat(client, f"tell a long story {i}", max_tokens=4000, stream=True) for i in range(2)]
    for stream in streams:  # both workers are busy generating
        assert next(iter(stream)).choices[0].delta.role == "assistant"
        next(iter(stream))
    for stream in streams:
        stream.close()
    wait_idle(server)
    # Each stream stopped within a few tokens of its client leaving (not after 4000).
    generated = server.metric("tiercache_api_tokens_generated_total") - before
    assert generated < 400, generated
    assert chat(client, "are you free?", max_tokens=2).usage.completion_tokens == 2


def test_a_client_that_gives_up_on_a_whole_answer_frees_its_worker(server) -> None:
    before = server.metric("tiercache_api_tokens_generated_total")
    body = {"model": MODEL, "messages": conversation("a very long answer"), "max_tokens": 7000, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):  # the client closes the connection after 1 s without an answer
        httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=httpx.Timeout(60, read=1.0))
    wait_idle(server)
    assert server.metric("tiercache_api_tokens_generated_total") - before < 4000  # about 1 s of tokens, not 7000


def test_a_client_that_leaves_while_queued_never_gets_a_worker(server, client) -> None:
    before = server.metric("tiercache_api_tokens_generated_total")
    streams = [chat(client, f"a long story {i}", max_tokens=4000, stream=True) for i in range(2)]
    for stream in streams:  # both workers are busy
        next(iter(stream))
    body = {"model": MODEL, "messages": conversation("queued"), "max_tokens": 7000, "stream": True}
    with pytest.raises(httpx.ReadTimeout):  # it waits for a worker; the client gives up after 1 s
        httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=httpx.Timeout(60, read=1.0))
    for stream in streams:
        stream.close()
    wait_idle(server)
    # The two streams' tokens until they were closed (a second or two), not 7000 more for the queued one.
    assert server.metric("tiercache_api_tokens_generated_total") - before < 4000


def test_a_worker_killed_mid_stream_fails_only_its_request_and_is_started_again(server, client) -> None:
    workers = _worker_pids(server)
    assert len(workers) == 2
    streams = [chat(client, f"a long story {i}", max_tokens=4000, stream=True) for i in range(2)]
    chunks = [iter(stream) for stream in streams]
    for chunk in chunks:  # both workers are busy
        next(chunk)
    os.kill(workers[0], signal.SIGKILL)
    failed = []
    for _ in range(4000):  # a chunk of each in turn, until the killed worker's stream ends with an error
        for chunk in chunks:
            try:
                next(chunk)
            except openai.APIError as e:
                failed.append(e.message)
        if failed:
            break
    for stream in streams:
        stream.close()
    assert failed == ["internal error: the worker process exited"]
    assert server.metric("tiercache_api_worker_restarts_total") == 1
    replaced = _worker_pids(server)  # another process is loading the model meanwhile
    assert workers[0] not in replaced and workers[1] in replaced and len(replaced) == 2
    assert chat(client, "still serving?", max_tokens=2).usage.completion_tokens == 2


def _worker_pids(server: ApiServer) -> list[int]:
    out = subprocess.run(["ps", "-ww", "-o", "pid=,args=", "--ppid", str(server.proc.pid)], capture_output=True,
                         text=True, timeout=30)
    return [int(line.split()[0]) for line in out.stdout.splitlines() if "spawn_main" in line]


def test_sixteen_streaming_clients_on_two_workers_all_complete(server) -> None:
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, int]:
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"user {i}"}],
            max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True})
        reasons, usage = [], None
        async for chunk in stream:
            reasons += [c.finish_reason for c in chunk.choices if c.finish_reason]
            usage = chunk.usage or usage
        return reasons[0], usage.completion_tokens

    async def main() -> list:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                                      timeout=300) as client:
            return await asyncio.gather(*(one(client, i) for i in range(16)))

    errors_before = _server_errors(server)
    results = asyncio.run(main())
    assert results == [("length", 8)] * 16
    assert _server_errors(server) == errors_before == 0, httpx.get(f"{server.url}/metrics").text[-3000:]


def _pinned_blocks(server: ApiServer, count: int, timeout_s: float = 30.0) -> list:
    """The daemon's pinned blocks, once there are `count` (the worker pins after its Put, off the request path)."""
    from tiercache.client import Client

    client = Client(f"unix:{server.socket}")
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            pinned = [b for b in client.listing().entries if b.pinned]
            if len(pinned) >= count or time.monotonic() > deadline:
                assert len(pinned) == count, pinned
                return pinned
            time.sleep(0.05)
    finally:
        client.close()


def _server_errors(server: ApiServer) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("tiercache_api_responses_total{") and 'status="5' in line)


def test_prometheus_metrics_count_requests_tokens_ttft_and_the_queue(server) -> None:
    requests = server.metric("tiercache_api_requests_total")
    assert requests >= 40  # every completed generation of the tests above
    assert server.metric("tiercache_api_ttft_seconds_count") == requests
    reused = server.metric("tiercache_api_tokens_reused_total")
    computed = server.metric("tiercache_api_tokens_computed_total")
    assert reused > computed > 0  # the tests share one system prompt
    assert server.metric("tiercache_api_queue_depth") == 0 and server.metric("tiercache_api_workers_busy") == 0
