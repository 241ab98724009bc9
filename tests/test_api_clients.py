"""The HTTP API through the third-party clients that people point at it: LangChain (ChatOpenAI, OpenAI,
ChatAnthropic, ChatOllama), LiteLLM (ollama_chat/ and openai/ providers) and `curl -d`, beside the official
clients, against one real `tiercache api` server. Each test is named after what a client found broken; the
last one loads the status page in headless Chromium and checks it shows the traffic the clients made."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess

import httpx
import openai
import pytest
from test_api_harness import MODEL, SYSTEM, ApiServer, chat_tokens, wait_for_prefix
from test_metrics import free_port

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # LiteLLM would fetch its price list at import
import litellm
from langchain_anthropic import ChatAnthropic
from langchain_core.messages import HumanMessage, SystemMessage
from langchain_ollama import ChatOllama
from langchain_openai import ChatOpenAI, OpenAI
from status_browser import chromium_page

HOUSE = SYSTEM + " The kitchen has four ceiling lights and a radio."


@pytest.fixture(scope="module")
def server():
    port = free_port()  # the daemon's metrics port: its status page and the Grafana test scrape it
    s = ApiServer(workers=1, env={"TIERCACHE_SERVER__METRICS_PORT": str(port)})
    s.metrics_port = port
    s.wait_ready()
    yield s
    assert s.stop() == 0, "".join(s.log)[-3000:]


def messages(user: str) -> list[dict]:
    return [{"role": "system", "content": HOUSE}, {"role": "user", "content": user}]


def warm(server: ApiServer, user: str) -> None:
    """One request, then wait until the daemon holds its blocks (the next request with the prefix hits)."""
    httpx.post(f"{server.url}/v1/chat/completions", timeout=120,
               json={"model": MODEL, "messages": messages(user), "max_tokens": 1, "temperature": 0}).raise_for_status()
    wait_for_prefix(server, chat_tokens(messages(user)))


def curl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["curl", "-sS", "--max-time", "120", *args], capture_output=True, text=True, check=False,
                          timeout=150)


# 1. Ollama routes took only `Content-Type: application/json`; LiteLLM and `curl -d` send none or a form type.

def test_litellm_ollama_chat_and_curl_d_reach_the_ollama_routes_without_a_json_content_type(server) -> None:
    reply = litellm.completion(model=f"ollama_chat/{MODEL}", api_base=server.url, messages=messages("lights on"),
                               max_tokens=3, temperature=0)
    assert reply.usage.completion_tokens == 3 and reply.usage.prompt_tokens > len(HOUSE)
    body = json.dumps({"model": MODEL, "prompt": "kitchen lights", "stream": False,
                       "options": {"num_predict": 3, "temperature": 0}})
    done = curl("-d", body, f"{server.url}/api/generate")  # curl -d: application/x-www-form-urlencoded
    answer = json.loads(done.stdout)
    assert answer["done"] and answer["eval_count"] == 3, done.stdout + done.stderr
    lines = curl("-d", json.dumps({"model": MODEL, "messages": messages("radio on"), "options": {"num_predict": 2}}),
                 f"{server.url}/api/chat").stdout.splitlines()  # streamed NDJSON, Ollama's default
    assert json.loads(lines[-1])["done"] and json.loads(lines[-1])["eval_count"] == 2


def test_an_unknown_model_is_litellms_not_found_error_not_a_bad_request(server) -> None:
    with pytest.raises(litellm.NotFoundError) as missing:
        litellm.completion(model="ollama_chat/llama3:8b", api_base=server.url, messages=messages("hi"), max_tokens=2)
    assert "llama3:8b" in str(missing.value)
    done = curl("-w", "\n%{http_code}", "-d", json.dumps({"model": "llama3:8b", "prompt": "hi"}),
                f"{server.url}/api/generate")
    body, status = done.stdout.rsplit("\n", 1)
    assert status == "404" and "is not served here" in json.loads(body)["error"]


# 3. HEAD / was 405; the Go `ollama` CLI checks a server with HEAD.

def test_head_on_the_root_answers_200_as_ollama_does(server) -> None:
    done = curl("-I", f"{server.url}/")
    assert done.stdout.startswith("HTTP/1.1 200"), done.stdout
    assert curl(f"{server.url}/").stdout == "Ollama is running"


# 4. GET /v1/models/{id} and POST /v1/messages/count_tokens were 404.

def test_a_model_is_retrieved_by_id_and_an_unknown_one_is_not_found(server) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_langchain_chat_anthropic_counts_the_tokens_a_request_is_billed_for(server) -> None:
    chat = ChatAnthropic(model=MODEL, base_url=server.url, api_key="unused", max_tokens=2, temperature=0,
                         max_retries=0)
    conversation = [SystemMessage(HOUSE), HumanMessage("is the radio on?")]
    counted = chat.get_num_tokens_from_messages(conversation)
    reply = chat.invoke(conversation)
    usage = reply.usage_metadata
    assert counted == usage["input_tokens"] == len(chat_tokens(messages("is the radio on?"))), usage
    r = httpx.post(f"{server.url}/v1/messages/count_tokens", timeout=60,
                   json={"model": "claude-x", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


# 5. /v1/completions refused `prompt: ["text"]`; LangChain's completions class always sends a list.

def test_langchain_completions_send_a_list_of_one_prompt(server) -> None:
    llm = OpenAI(model=MODEL, base_url=f"{server.url}/v1", api_key="unused", max_tokens=6, temperature=0,
                 max_retries=0)
    text = llm.invoke("The kitchen lights are")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    plain = client.completions.create(model=MODEL, prompt="The kitchen lights are", max_tokens=6, temperature=0)
    assert text == plain.choices[0].text and len(text) > 0
    with pytest.raises(openai.BadRequestError) as batch:
        client.completions.create(model=MODEL, prompt=["one", "two"], max_tokens=1)
    assert "a batch of 2 prompts is not supported" in batch.value.body["message"]


# 6. An explicit null for temperature, top_p, n or stream was a 400; OpenAI's spec allows it.

def test_explicit_nulls_are_the_defaults(server) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    reply = client.chat.completions.create(model=MODEL, messages=messages("hi"), max_tokens=2, temperature=None,
                                           top_p=None, n=None, extra_body={"stream": None, "seed": 3})
    assert reply.usage.completion_tokens == 2 and reply.object == "chat.completion"
    via = litellm.completion(model=f"openai/{MODEL}", api_base=f"{server.url}/v1", api_key="unused",
                             messages=messages("hi"), max_tokens=2, temperature=None, top_p=None, n=None)
    assert via.usage.completion_tokens == 2
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": messages("hi"), "max_tokens": 2, "temperature": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"  # a value is still checked


# 8. Ollama clients could not see the saving: LangChain and LiteLLM drop a body field they do not know.

def test_ollama_clients_see_the_cached_tokens(server) -> None:
    warm(server, "dim the hall")
    expected = len(HOUSE)  # at least the system prompt's full blocks come from the cache
    done = curl("-i", "-d", json.dumps({"model": MODEL, "messages": messages("dim the hall"), "stream": False,
                                        "options": {"num_predict": 1}}), f"{server.url}/api/chat")
    head, body = done.stdout.split("\n\n", 1)  # text mode: curl's CRLFs read as newlines
    final = json.loads(body)
    assert final["prompt_eval_cached_count"] >= expected - 16 and final["prompt_eval_count"] > expected
    assert f"x-tiercache-cached-tokens: {final['prompt_eval_cached_count']}" in head.lower()

    seen: list[int] = []

    def hook(response: httpx.Response) -> None:
        seen.append(int(response.headers["x-tiercache-cached-tokens"]))

    chat = ChatOllama(model=MODEL, base_url=server.url, num_predict=1, temperature=0,
                      client_kwargs={"event_hooks": {"response": [hook]}})
    reply = chat.invoke([SystemMessage(HOUSE), HumanMessage("dim the hall")])
    assert reply.usage_metadata["input_tokens"] == final["prompt_eval_count"]
    assert seen == [final["prompt_eval_cached_count"]]

    stream = litellm.completion(model=f"ollama_chat/{MODEL}", api_base=server.url, messages=messages("dim the hall"),
                                max_tokens=1, temperature=0, stream=True)
    list(stream)
    headers = stream._hidden_params["additional_headers"]
    assert int(headers["llm_provider-x-tiercache-cached-tokens"]) == final["prompt_eval_cached_count"]

    # LangChain and LiteLLM through the OpenAI shape: the saving in their own usage fields.
    lc = ChatOpenAI(model=MODEL, base_url=f"{server.url}/v1", api_key="unused", max_tokens=1, temperature=0,
                    max_retries=0).invoke([SystemMessage(HOUSE), HumanMessage("dim the hall")])
    assert lc.usage_metadata["input_token_details"]["cache_read"] == final["prompt_eval_cached_count"]
    via = litellm.completion(model=f"openai/{MODEL}", api_base=f"{server.url}/v1", api_key="unused",
                             messages=messages("dim the hall"), max_tokens=1, temperature=0)
    assert via.usage.prompt_tokens_details.cached_tokens == final["prompt_eval_cached_count"]


# The status page, in a real browser, after the traffic above.

def test_the_status_page_shows_tiers_namespaces_and_the_requests_above(server) -> None:
    shot = os.environ.get("TC_STATUS_SCREENSHOT")  # docs/status-page.png is made this way
    with chromium_page(f"{server.url}/status", screenshot=shot) as page:
        tiers = {card.get_attribute("data-tier"): card.inner_text() for card in page.query_selector_all(".tier")}
        assert set(tiers) == {"host", "disk"}, tiers
        assert "blocks" in tiers["host"] and "of 64.0 MiB" in tiers["host"], tiers["host"]
        rows = page.query_selector_all("#namespaces tr.namespace")
        assert len(rows) == 1 and rows[0].query_selector(".model").inner_text() == MODEL
        assert rows[0].query_selector(".preview").inner_text().startswith("<|system|>You are Hearth")
        assert int(rows[0].query_selector(".hits").inner_text().replace(",", "")) > 0
        requests = page.query_selector_all("#requests tr.request")
        cached = [int(r.query_selector(".cached").inner_text().replace(",", "")) for r in requests]
        assert len(requests) >= 5 and max(cached) >= len(HOUSE) - 16, cached
        saved = int(page.inner_text("#hour-tokens-saved").replace(",", ""))
        assert saved >= sum(cached)  # the hour counts these requests and any older ones
        assert page.inner_text("#summary").startswith(f"HTTP API serving {MODEL}")


# The Grafana dashboard: every query names a metric that the daemon or the API exports, scraped after the traffic.

def test_every_grafana_query_names_a_metric_the_daemon_or_the_api_exports(server) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    repo = pathlib.Path(__file__).resolve().parent.parent
    dashboard = json.loads((repo / "deploy" / "grafana" / "tiercache.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 20
    from tiercache.client import Client
    from tiercache.errors import NotFound

    with Client(f"unix:{server.socket}") as client, pytest.raises(NotFound):  # a failed call: rpc_errors has a sample
        client.list(namespace=b"\1" * 32)
    exported: dict[str, set[str]] = {}  # sample name -> its label names
    for url, headers in ((f"{server.url}/metrics", {}), (f"http://127.0.0.1:{server.metrics_port}/metrics", {})):
        text = httpx.get(url, headers=headers, timeout=30).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                exported.setdefault(sample.name, set()).update(sample.labels)
    missing, unlabelled = [], []
    for expr in exprs:
        for name in re.findall(r"\b(tiercache_[a-z_]+)\b", expr):
            if name not in exported:
                missing.append(f"{name} in {expr}")
        for labels, name in re.findall(r"by \(([a-z_, ]+)\) \((?:rate|increase)\((tiercache_[a-z_]+)", expr):
            wanted = {label.strip() for label in labels.split(",")} - {"le"}
            if not wanted <= exported.get(name, set()):
                unlabelled.append(f"{name} has no label {wanted - exported.get(name, set())}")
    assert not missing, "queries of metrics nobody exports:\n" + "\n".join(missing)
    assert not unlabelled, unlabelled
    assert "tiercache_tokens_reused_total" in exported and "tiercache_api_ttft_seconds_bucket" in exported
