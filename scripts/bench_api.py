"""The household workload through the HTTP API (the official `openai` client, streaming) against the same
worker processes called in process, and with the cache off: TTFT p50/p95, the HTTP overhead per request,
and what the cache saved. Then every user at once through HTTP (several simulated users streaming)."""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from benchmarks.record import recorded  # noqa: E402  (first: it notes when the run began)
from scripts.demo import COMMANDS, CONVERSATION, PRIVATE_USERS, SHARED_USERS, SYSTEM_PROMPT  # noqa: E402

MODEL = "tiercache/default-llama-v1-seed0"


@dataclass
class Sample:
    arm: str
    user: str
    ttft_s: float
    total_s: float
    prompt_tokens: int
    cached_tokens: int


def workload(num_requests: int) -> list[tuple[str, str]]:
    """(user, text) in order: mostly the shared users, every 4th a private user, every 5th the next turn
    of one growing conversation (user "leo"), as scripts/demo.py runs it."""
    jobs, turns, private = [], 0, list(PRIVATE_USERS)
    for i in range(num_requests):
        if i % 5 == 4 and turns < len(CONVERSATION):
            jobs.append(("leo", CONVERSATION[turns]))
            turns += 1
        elif i % 4 == 3:
            jobs.append((private[(i // 4) % len(private)], COMMANDS[i % len(COMMANDS)]))
        else:
            jobs.append((SHARED_USERS[i % len(SHARED_USERS)], COMMANDS[i % len(COMMANDS)]))
    return jobs


class Chats:
    """Each arm's conversations: the system prompt, then per user the turns so far (leo's grow)."""

    def __init__(self) -> None:
        self.history: dict[str, list[dict]] = {}

    def messages(self, user: str, text: str) -> list[dict]:
        past = self.history.get(user, []) if user == "leo" else []
        return [{"role": "system", "content": SYSTEM_PROMPT}, *past, {"role": "user", "content": f"{user}: {text}"}]

    def answered(self, user: str, messages: list[dict], reply: str) -> None:
        if user == "leo":
            printable = "".join(c if c.isascii() and c.isprintable() else "." for c in reply)
            self.history[user] = [*messages[1:], {"role": "assistant", "content": printable}]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def via_http(client, arm: str, user: str, messages: list[dict], max_tokens: int,  # noqa: ANN001
                   cache: bool) -> tuple[Sample, str]:
    start = time.perf_counter()
    stream = await client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_headers={} if cache else {"x-tiercache-cache": "off"})
    ttft, text, usage = None, [], None
    async for chunk in stream:
        ttft = ttft or time.perf_counter() - start  # the first chunk goes out once the first token exists
        text += [c.delta.content or "" for c in chunk.choices]
        usage = chunk.usage or usage
    sample = Sample(arm, user, ttft, time.perf_counter() - start, usage.prompt_tokens,
                    usage.prompt_tokens_details.cached_tokens)
    return sample, "".join(text)


async def in_process(api, arm: str, user: str, messages: list[dict], max_tokens: int, salt: str) -> tuple[Sample, str]:
    from tiercache.api.generate import Params, Run

    start = time.perf_counter()
    tokens, _ = api.chat.chat(messages)
    run = await Run.start(api.pool, api.chat.tokenizer, tokens, Params(max_tokens=max_tokens, salt=salt))
    ttft = time.perf_counter() - start
    text = await run.text()
    sample = Sample(arm, user, ttft, time.perf_counter() - start, run.outcome.prompt_tokens, run.outcome.cached_tokens)
    return sample, text


def table(samples: list[Sample], arms: list[str], warm_only: bool) -> list[tuple[str, float, float, int]]:
    rows = []
    for arm in arms:
        ttfts = [s.ttft_s for s in samples if s.arm == arm and (s.cached_tokens > 0 or not warm_only)]
        if ttfts:
            rows.append((arm, statistics.median(ttfts) * 1e3, pct(ttfts, 0.95) * 1e3, len(ttfts)))
        else:
            rows.append((arm, float("nan"), float("nan"), 0))
    return rows


async def bench(args: argparse.Namespace, base: str) -> None:
    import openai
    import uvicorn

    from tiercache.api.app import create_app
    from tiercache.api.auth import salt_for
    from tiercache.api.child import WorkerSpec
    from tiercache.api.cli import bind
    from tiercache.api.pool import WorkerPool
    from tiercache.api.prompts import load_chat_format
    from tiercache.api.state import APIState

    tenants = ["household", *PRIVATE_USERS]
    keys = {f"bench-key-{name}-0123456789": name for name in tenants}
    spec = WorkerSpec(target=f"unix:{os.path.join(base, 'd.sock')}", threads=1)
    api = APIState(WorkerPool(spec, args.workers), load_chat_format(None), keys)
    server = uvicorn.Server(uvicorn.Config(create_app(api), log_config=None, access_log=False))
    sock = bind("127.0.0.1", 0)  # as `tiercache api` binds it
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.05)
    await api.pool.wait_ready()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    clients = {name: openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0, timeout=300)
               for key, name in keys.items()}

    def tenant(user: str) -> str:
        return user if user in PRIVATE_USERS else "household"

    jobs = workload(args.requests)
    print(f"{args.workers} worker processes (built-in model), {len(jobs)} requests, system prompt "
          f"{len(SYSTEM_PROMPT.encode())} bytes, {args.max_tokens} tokens generated each; the arms take turns "
          "request by request, each in its own cache namespace")
    chats = {arm: Chats() for arm in ("http", "in-process", "http, cache off")}
    samples: list[Sample] = []
    for i, (user, text) in enumerate(jobs):
        order = ["http", "in-process"] if i % 2 == 0 else ["in-process", "http"]
        for arm in [*order, "http, cache off"]:
            messages = chats[arm].messages(user, text)
            if arm == "in-process":
                sample, reply = await in_process(api, arm, user, messages, args.max_tokens,
                                                 salt_for("in-process:" + tenant(user)))
            else:
                sample, reply = await via_http(clients[tenant(user)], arm, user, messages, args.max_tokens,
                                               cache=arm == "http")
            chats[arm].answered(user, messages, reply)
            samples.append(sample)
        print(f"request {i + 1} of {len(jobs)} done ({user}, three arms)", file=sys.stderr, flush=True)
    arms = ["http", "in-process", "http, cache off"]
    http = [s for s in samples if s.arm == "http"]
    off = [s for s in samples if s.arm == "http, cache off"]
    print(f"\nprompt tokens: {sum(s.prompt_tokens for s in http):,}; computed with the cache "
          f"{sum(s.prompt_tokens - s.cached_tokens for s in http):,} "
          f"({100 * sum(s.cached_tokens for s in http) / sum(s.prompt_tokens for s in http):.1f}% reused), "
          f"without it {sum(s.prompt_tokens for s in off):,}")
    print("\ntime to first token, one request at a time")
    print(f"{'arm':<18}{'p50 all ms':>11}{'p95 all ms':>11}{'p50 warm ms':>12}{'p95 warm ms':>12}{'warm n':>8}")
    every, warm = table(samples, arms, False), table(samples, arms, True)
    for (arm, p50, p95, _), (_, wp50, wp95, n) in zip(every, warm):
        warm_cells = f"{wp50:>12.1f}{wp95:>12.1f}" if n else f"{'-':>12}{'-':>12}"
        print(f"{arm:<18}{p50:>11.1f}{p95:>11.1f}{warm_cells}{n:>8}")
    pairs = [(h.ttft_s - d.ttft_s) * 1e3 for h, d in zip(http, [s for s in samples if s.arm == "in-process"])]
    h50, d50 = warm[0][1], warm[1][1]
    met = h50 <= 1.1 * d50 or h50 - d50 <= 5.0
    print(f"\nHTTP overhead per request (paired, http - in-process): median {statistics.median(pairs):+.1f} ms, "
          f"p95 {pct(pairs, 0.95):+.1f} ms")
    print(f"warm p50 TTFT: http {h50:.1f} ms = {h50 / d50:.2f}x in-process ({h50 - d50:+.1f} ms); target within 1.1x "
          f"or 5 ms: {'MET' if met else 'MISSED'}")
    print(f"warm p50 TTFT with the cache vs cold without it (http): {h50:.1f} vs {every[2][1]:.1f} ms "
          f"({every[2][1] / h50:.1f}x)")

    print(f"\nevery user at once: {len(set(u for u, _ in jobs))} users streaming through HTTP, each user's requests "
          "in order (other questions; the system prompt is warm from above)")
    by_user: dict[str, list[str]] = {}
    for user, text in jobs:
        by_user.setdefault(user, []).append(text)
    together: list[Sample] = []
    chat = Chats()
    spare = {name: openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0, timeout=300)
             for key, name in keys.items()}

    async def one_user(user: str, texts: list[str]) -> None:
        for text in texts:
            messages = chat.messages(user, text + " (together)")
            sample, reply = await via_http(spare[tenant(user)], "together", user, messages, args.max_tokens, True)
            chat.answered(user, messages, reply)
            together.append(sample)

    started = time.perf_counter()
    await asyncio.gather(*(one_user(u, t) for u, t in by_user.items()))
    wall = time.perf_counter() - started
    ttfts = [s.ttft_s for s in together]
    lost = len(jobs) - len(together)
    print(f"{len(together)} requests in {wall:.1f} s, {'none' if not lost else lost} lost; "
          f"TTFT p50 {statistics.median(ttfts) * 1e3:.1f} ms, "
          f"p95 {pct(ttfts, 0.95) * 1e3:.1f} ms (queueing for {args.workers} workers included); "
          f"{100 * sum(s.cached_tokens for s in together) / sum(s.prompt_tokens for s in together):.1f}% of prompt "
          "tokens reused")
    server.should_exit = True
    await serving


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--requests", type=int, default=36, help="requests of the household workload (default 36)")
    p.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens generated per request (default 8)")
    p.add_argument("--markdown", metavar="PATH", help="also write the output as a page (docs/benchmarks/api.md)")
    args = p.parse_args()
    base = tempfile.mkdtemp(prefix="tc-api-", dir="/tmp")  # short: Unix socket paths stay under 108 bytes
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    daemon = subprocess.Popen([sys.executable, "-m", "tiercache.cli", "serve", "--socket", os.path.join(base, "d.sock"),
                               "--data-dir", os.path.join(base, "data"), "--log-level", "WARNING"],
                              cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    try:
        if not daemon.stdout.readline().startswith("tiercache listening on "):
            raise SystemExit("bench_api: the daemon did not start")
        with recorded(args.markdown, "HTTP API: the household workload through the API and in process"):
            asyncio.run(bench(args, base))
    finally:
        daemon.terminate()
        daemon.wait(30)
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
