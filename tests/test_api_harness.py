"""The harness of the API tests (a real `tiercache api` process on a free port, starting its own daemon on a
temp socket), and the refusals that need no worker: 503 while loading, loopback only without keys."""

from __future__ import annotations

import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from benchmarks.daemons import REPO, short_dir

MODEL = "tiercache/default-llama-v1-seed0"
SYSTEM = ("You are Hearth, the voice assistant of the Moreau household. Answer in one or two short sentences. "
          "Call a tool when the request needs one; otherwise answer directly. Never invent device names. "
          "Quiet hours are 22:00 to 07:00: music at most 20% volume, no announcements in the bedroom.")


class ApiServer:
    """`python -m tiercache.cli api --port 0 ...` with its own daemon under a temp dir; `url` once ready."""

    def __init__(self, *args: str, workers: int = 2, env: dict[str, str] | None = None) -> None:
        self.base = short_dir()
        self.socket = os.path.join(self.base, "d.sock")
        cmd = [sys.executable, "-m", "tiercache.cli", "api", "--port", "0", "--workers", str(workers),
               "--threads", "1", "--timeout", "10", "--socket", self.socket,
               "--data-dir", os.path.join(self.base, "data"),
               "--log-level", "WARNING", *args]
        env = {**os.environ, "PYTHONPATH": str(REPO), "TIERCACHE_HOST__CAPACITY_BYTES": str(64 << 20),
               "TIERCACHE_DISK__CAPACITY_BYTES": str(256 << 20), **(env or {})}
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
        self.log: list[str] = []
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [self.log.append(line) for line in self.proc.stderr], daemon=True).start()
        threading.Thread(target=lambda: [self._lines.put(line) for line in self.proc.stdout], daemon=True).start()
        self.url = ""
        self.key: str | None = None  # an API key, when the server has --api-keys (its /metrics needs one)

    def wait_listening(self, timeout_s: float = 180.0) -> str:
        """The base URL once the server has bound its port (its workers may still be loading)."""
        deadline = time.monotonic() + timeout_s
        while not self.url and time.monotonic() < deadline and self.proc.poll() is None:
            try:
                line = self._lines.get(timeout=0.2)
            except queue.Empty:
                continue
            if line.startswith("tiercache api listening on "):
                self.url = line.split()[-1]
        return self.url

    def wait_ready(self, timeout_s: float = 180.0) -> str:
        """The base URL once /health answers 200 (every worker loaded)."""
        deadline = time.monotonic() + timeout_s
        self.wait_listening(timeout_s)
        while self.url and time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return self.url
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise AssertionError(f"the API server did not start (rc={self.proc.returncode}):\n{''.join(self.log)[-4000:]}")

    def metric(self, name: str) -> float:
        """The value of one unlabelled sample of the server's /metrics."""
        headers = {"authorization": f"Bearer {self.key}"} if self.key else {}
        for line in httpx.get(f"{self.url}/metrics", headers=headers, timeout=10).text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
        raise AssertionError(f"no metric {name}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        shutil.rmtree(self.base, ignore_errors=True)
        return self.proc.returncode


_NAMESPACES: dict[str, object] = {}


def chat_tokens(messages: list[dict], template: str | None = None) -> list[int]:
    """The token ids the server makes of `messages` with the built-in model (or `template`)."""
    from tiercache.api.prompts import ChatFormat
    from tiercache.worker.model import ByteTokenizer

    return ChatFormat(ByteTokenizer(), None, template).chat(messages)[0]


def wait_for_prefix(server: ApiServer, tokens: list[int], salt: str = "", timeout_s: float = 30.0) -> None:
    """Until the daemon holds every full block of `tokens` (but the last token's): a worker writes a prompt's
    blocks after its first token, and the next request may reach the other worker before that Put lands."""
    from tiercache.client import Client
    from tiercache.keys import block_keys
    from tiercache.worker.model import load_default_model, namespace_for

    if salt not in _NAMESPACES:
        _NAMESPACES[salt] = namespace_for(load_default_model(), block_tokens=16, salt=salt)
    keys = block_keys(_NAMESPACES[salt], tokens)[: (len(tokens) - 1) // 16]
    client = Client(f"unix:{server.socket}")
    try:
        deadline = time.monotonic() + timeout_s
        while len(client.lookup(keys, probe=True)) < len(keys):
            assert time.monotonic() < deadline, f"the daemon never held the {len(keys)} blocks of the prompt"
            time.sleep(0.05)
    finally:
        client.close()


def wait_idle(server: ApiServer, timeout_s: float = 60.0) -> None:
    """Until no worker runs a request (a cancelled one ends after its current token)."""
    deadline = time.monotonic() + timeout_s
    while server.metric("tiercache_api_workers_busy"):
        assert time.monotonic() < deadline, "a worker is still busy: its request was not cancelled"
        time.sleep(0.02)


def host_blocks(server: ApiServer) -> int:
    from tiercache.client import Client

    client = Client(f"unix:{server.socket}")
    try:
        return sum(t.num_blocks for t in client.stats().tiers if t.tier == "host")
    finally:
        client.close()


def wait_for_blocks(server: ApiServer, at_least: int, timeout_s: float = 30.0) -> None:
    """Until the daemon's host tier holds `at_least` blocks."""
    deadline = time.monotonic() + timeout_s
    while host_blocks(server) < at_least:
        assert time.monotonic() < deadline, f"the daemon never held {at_least} blocks"
        time.sleep(0.05)


@pytest.fixture
def idle_app():
    """The app over a pool that never started: every route that needs a worker must answer 503."""
    from fastapi.testclient import TestClient

    from tiercache.api.app import create_app
    from tiercache.api.child import WorkerSpec
    from tiercache.api.pool import WorkerPool
    from tiercache.api.prompts import load_chat_format
    from tiercache.api.state import APIState

    api = APIState(WorkerPool(WorkerSpec(), 1), load_chat_format(None))
    return TestClient(create_app(api), client=("127.0.0.1", 5000))  # no `with`: the lifespan (pool) never runs


def test_every_generation_route_answers_503_with_retry_after_while_loading(idle_app) -> None:
    requests = [("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
                ("/v1/completions", {"model": MODEL, "prompt": "hi"}),
                ("/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}),
                ("/api/chat", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
                ("/api/generate", {"model": MODEL, "prompt": "hi"})]
    for path, body in requests:
        r = idle_app.post(path, json=body)
        assert r.status_code == 503, (path, r.text)
        assert r.headers["retry-after"] == "1"
        error = r.json()["error"]
        message = error if isinstance(error, str) else error["message"]
        assert "loading" in message or "not started" in message, (path, r.text)
    health = idle_app.get("/health")
    assert health.status_code == 503 and health.json()["status"] == "loading"


def test_while_the_workers_load_the_model_is_listed_and_a_request_waits_for_them() -> None:
    """Open WebUI reads the model list when it connects, seconds after the server starts: the list names the
    model meanwhile, and a request sent then is answered once a worker has loaded it."""
    import openai

    server = ApiServer(workers=1)
    try:
        url = server.wait_listening()
        deadline = time.monotonic() + 60
        while True:  # the port is bound before the app starts: wait for its first answer
            try:
                health = httpx.get(f"{url}/health", timeout=5)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "".join(server.log)[-3000:]
                time.sleep(0.05)
        assert health.status_code == 503 and health.headers["retry-after"] == "1", health.text
        assert health.json() == {"status": "loading", "model": MODEL, "workers_ready": 0, "workers": 1}
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == [MODEL]
        assert httpx.get(f"{url}/health", timeout=5).json()["status"] == "loading"
        reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert reply.usage.completion_tokens == 2  # it waited for the worker instead of getting a 503
        assert httpx.get(f"{url}/health", timeout=5).json()["status"] == "ready"
    finally:
        assert server.stop() == 0, "".join(server.log)[-3000:]


def test_a_request_waits_for_loading_workers_only_so_long_then_gets_503() -> None:
    from fastapi.testclient import TestClient

    from tiercache.api.app import create_app
    from tiercache.api.child import WorkerSpec
    from tiercache.api.pool import WorkerPool
    from tiercache.api.prompts import load_chat_format
    from tiercache.api.state import APIState

    api = APIState(WorkerPool(WorkerSpec(), 1), load_chat_format(None), model_name=MODEL, load_wait_s=0.3)
    with TestClient(create_app(api), client=("127.0.0.1", 5000)) as http:  # starts a worker process: it loads
        started = time.monotonic()
        r = http.post("/api/chat", content=b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}]}'
                      % MODEL.encode())
        assert time.monotonic() - started >= 0.3
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json() == {"error": "the model is still loading (waited 0.3 s)"}
        assert http.get("/v1/models").json()["data"][0]["id"] == MODEL
        assert http.post("/api/show", json={"model": "llama3"}).status_code == 404  # the name is known already


def test_without_keys_only_loopback_callers_are_served() -> None:
    from fastapi.testclient import TestClient

    from tiercache.api.app import create_app
    from tiercache.api.child import WorkerSpec
    from tiercache.api.pool import WorkerPool
    from tiercache.api.prompts import load_chat_format
    from tiercache.api.state import APIState

    api = APIState(WorkerPool(WorkerSpec(), 1), load_chat_format(None))
    remote = TestClient(create_app(api), client=("192.168.1.20", 5000))
    r = remote.get("/v1/models")
    assert r.status_code == 403
    assert r.json()["error"]["code"] == "loopback_only" and "192.168.1.20" in r.json()["error"]["message"]


def test_the_command_refuses_a_network_address_without_keys() -> None:
    done = subprocess.run([sys.executable, "-m", "tiercache.cli", "api", "--host", "0.0.0.0", "--no-cache"],
                          cwd=REPO, capture_output=True, text=True, check=False, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 2
    assert "--host 0.0.0.0 opens the API to the network: give --api-keys FILE" in done.stderr
