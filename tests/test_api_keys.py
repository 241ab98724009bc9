"""A server with API keys, one worker, no queue and a chat template that puts the date first: keys map to
tenants the server isolates, a full queue is a 429 with Retry-After, and a date-first template defeats
the cache (`tiercache admin explain` shows the first block already differs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import openai
import pytest
from test_api_harness import (
    MODEL,
    SYSTEM,
    ApiServer,
    host_blocks,
    wait_for_blocks,
    wait_for_prefix,
    wait_idle,
)

from benchmarks.daemons import REPO
from tiercache.api.auth import salt_for
from tiercache.api.prompts import ChatFormat
from tiercache.worker.model import ByteTokenizer

ALICE, BOB = "alice-key-0123456789abcdef", "bob-key-0123456789abcdef00"
# The time of the request first (a date alone changes the first block once a day).
DATE_FIRST = ("{{ strftime_now('%H:%M:%S.%f %Y-%m-%d') }}\n"
              "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}<|assistant|>")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    base = tmp_path_factory.mktemp("keys")
    keys = base / "keys.txt"
    keys.write_text(f"# key tenant\n{ALICE} alice\n{BOB} bob\n")
    template = base / "date-first.jinja"
    template.write_text(DATE_FIRST)
    s = ApiServer("--api-keys", str(keys), "--max-queue", "0", "--chat-template", str(template), workers=1)
    s.key = ALICE  # for the harness's scrapes of /metrics
    s.wait_ready()
    yield s
    assert s.stop() == 0, "".join(s.log)[-3000:]


def client(server: ApiServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=120)


def complete(server: ApiServer, key: str, prompt: str, **kwargs):
    return client(server, key).completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, **kwargs)


def test_a_missing_or_wrong_key_is_a_401(server) -> None:
    r = httpx.get(f"{server.url}/v1/models", timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError) as wrong:
        client(server, "not-a-key-at-all-000000").models.list()
    assert wrong.value.status_code == 401 and wrong.value.body["message"] == "the API key is not valid"
    r = httpx.post(f"{server.url}/v1/messages", headers={"x-api-key": "wrong"}, timeout=30,
                   json={"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert [m.id for m in client(server, ALICE).models.list().data] == [MODEL]


def test_tenants_never_share_cached_prefixes(server) -> None:
    prompt = SYSTEM + " Tenants."
    first = complete(server, ALICE, prompt)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    wait_for_prefix(server, ByteTokenizer().encode(prompt), salt_for("alice"))
    # The body cannot choose a tenant or a salt: unknown fields are ignored.
    bob = complete(server, BOB, prompt, extra_body={"salt": "", "user": "alice", "tenant": "alice"})
    assert bob.usage.prompt_tokens_details.cached_tokens == 0
    again = complete(server, ALICE, prompt)
    assert again.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens // 16 * 16


def test_a_full_queue_is_a_429_with_retry_after_and_the_worker_comes_back(server) -> None:
    # Greedy on a fixed prompt (no date-first template): it deterministically runs past the checks below.
    long = client(server, ALICE).completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4000,
                                                    temperature=0, stream=True)
    next(iter(long))  # the only worker is busy
    r = httpx.post(f"{server.url}/v1/chat/completions", headers={"authorization": f"Bearer {BOB}"}, timeout=30,
                   json={"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "queue_full" and "1 workers are busy" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/api/chat", headers={"authorization": f"Bearer {BOB}"}, timeout=30,
                   json={"model": MODEL, "stream": False, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 429 and "busy" in r.json()["error"]
    long.close()
    wait_idle(server)  # the worker stops after its current token; until then a request would get a 429
    assert complete(server, BOB, "back?").choices[0].finish_reason == "length"


def test_a_template_that_puts_the_date_first_defeats_the_cache_and_explain_shows_where(server) -> None:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello"}]
    ask = client(server, ALICE).chat.completions.create
    before = host_blocks(server)
    first = ask(model=MODEL, messages=messages, max_tokens=1, temperature=0)
    wait_for_blocks(server, before + first.usage.prompt_tokens // 16)  # its blocks are all new: one worker
    second = ask(model=MODEL, messages=messages, max_tokens=1, temperature=0)
    # The same conversation, but its first tokens are the time of the request: nothing is reused.
    assert second.usage.prompt_tokens == first.usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens == 0
    tokens, _ = ChatFormat(ByteTokenizer(), None, DATE_FIRST).chat(messages)
    done = subprocess.run([sys.executable, "-m", "tiercache.cli", "admin", "explain", "--socket", server.socket,
                           "--tokens", json.dumps(tokens), "--salt", salt_for("alice"), "--json"],
                          cwd=REPO, capture_output=True, text=True, check=False, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    report = json.loads(done.stdout)
    assert report["cached_blocks"] == 0 and report["prompt_tokens"] == len(tokens)
    assert report["miss"]["block"] == 0 and report["miss"]["reason"] == "differs", report["miss"]
    assert report["miss"]["start"] == 0 and "block 0 (tokens 0-15) differs" in report["miss"]["detail"]


def test_metrics_and_the_status_figures_need_a_key_when_keys_are_set(server) -> None:
    # What a Prometheus scrape without `authorization` gets, then with a key (its credentials setting).
    r = httpx.get(f"{server.url}/metrics", timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.get(f"{server.url}/metrics", headers={"authorization": f"Bearer {ALICE}"}, timeout=30)
    assert r.status_code == 200 and "tiercache_api_requests_total" in r.text
    assert httpx.get(f"{server.url}/status.json", timeout=30).status_code == 401
    assert complete(server, BOB, "b" * 777).usage.prompt_tokens == 778  # a length nobody else sends
    mine = httpx.get(f"{server.url}/status.json", headers={"x-api-key": ALICE}, timeout=30).json()
    theirs = httpx.get(f"{server.url}/status.json", headers={"x-api-key": BOB}, timeout=30).json()
    # Each tenant sees its own requests, and nobody sees a prompt's text.
    assert theirs["requests"][0]["prompt_tokens"] == 778
    assert mine["requests"] and all(r["prompt_tokens"] != 778 for r in mine["requests"])
    assert all(n["preview"] == "" for n in mine["namespaces"] + theirs["namespaces"])
    assert httpx.get(f"{server.url}/status", timeout=30).status_code == 200  # the page itself holds no figures
