"""The container's entrypoint (deploy/container/entrypoint.sh), run outside a container as compose.yaml runs it:
`daemon` serves on the socket volume with its metrics and status page, `api` writes a first key once, waits
for the daemon's socket and serves the HTTP API with that key; SIGTERM stops both cleanly."""

from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
from test_api_harness import MODEL
from test_metrics import free_port

from benchmarks.daemons import cleanup, short_dir

REPO = pathlib.Path(__file__).resolve().parent.parent
ENTRYPOINT = str(REPO / "deploy" / "container" / "entrypoint.sh")


def start(role: str, env: dict[str, str]) -> tuple[subprocess.Popen, list[str]]:
    """The entrypoint with `role`, and its stderr lines as they come (drained, so its logs never block it)."""
    proc = subprocess.Popen(["sh", ENTRYPOINT, role], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(proc.stderr.readline, "")), daemon=True).start()
    return proc, lines


def wait_for(lines: list[str], words: str, timeout_s: float = 120.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = [line for line in list(lines) if words in line]
        if found:
            return found[0]
        time.sleep(0.05)
    raise AssertionError(f"no {words!r} in:\n{''.join(lines)[-3000:]}")


def test_the_entrypoint_runs_the_daemon_and_the_api_with_a_key_written_once() -> None:
    base = short_dir()
    port, metrics = free_port(), free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "TC_BIN": f"{sys.executable} -m tiercache.cli",
           "TC_DATA": os.path.join(base, "data"), "TC_RUN": os.path.join(base, "run"),
           "TC_CONFIG": os.path.join(base, "absent.toml"), "TC_HOST": "127.0.0.1",
           "TC_PORT": str(port), "TC_WORKERS": "1", "TC_METRICS_PORT": str(metrics),
           "TC_METRICS_HOST": "127.0.0.1", "TIERCACHE_HOST__CAPACITY_BYTES": str(64 << 20),
           "TIERCACHE_DISK__CAPACITY_BYTES": str(256 << 20)}
    api, api_log = start("api", env)  # first, as compose may start it: it waits for the daemon's socket
    daemon, _ = start("daemon", env)
    try:
        assert daemon.stdout.readline().startswith("tiercache listening on unix:" + env["TC_RUN"])
        key_line = wait_for(api_log, "wrote an API key")
        key = re.search(r": (tc-\S+)$", key_line.strip()).group(1)
        keys = pathlib.Path(env["TC_DATA"], "api-keys")
        assert keys.stat().st_mode & 0o777 == 0o600 and f"{key} household" in keys.read_text()
        assert api.stdout.readline().strip() == f"tiercache api listening on http://127.0.0.1:{port}"
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while httpx.get(f"{url}/health", timeout=10).status_code != 200:
            assert time.monotonic() < deadline and api.poll() is None
            time.sleep(0.2)
        assert httpx.get(f"{url}/v1/models", timeout=10).status_code == 401  # the network needs the key
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)
        reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}],
                                               max_tokens=2)
        assert reply.usage.completion_tokens == 2
        assert b"status.js" in httpx.get(f"http://127.0.0.1:{metrics}/status", timeout=10).content
    finally:
        for proc in (api, daemon):
            proc.send_signal(signal.SIGTERM)
        codes = [proc.wait(60) for proc in (api, daemon)]
    assert codes == [0, 0]
    again, again_log = start("api", {**env, "TC_RUN": os.path.join(base, "nowhere")})  # the key is kept
    try:
        time.sleep(1.5)
        again.send_signal(signal.SIGTERM)
        again.wait(30)
        assert not any("wrote an API key" in line for line in again_log)
    finally:
        cleanup(base)
