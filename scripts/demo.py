"""The main job: a daemon, several worker processes and a household workload; prints what the cache saved."""

from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import queue
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout without installing

MiB = 1 << 20

SYSTEM_PROMPT = """You are Hearth, the voice assistant of the Moreau household. Answer in one or two short sentences.
Call a tool when the request needs one; otherwise answer directly. Never invent device names.

# Tools
{"name": "lights.set", "parameters": {"room": "kitchen|living|bedroom|hall|garden|kids", "on": "bool", \
"brightness": "0-100", "color": "warm|cold"}}
{"name": "thermostat.set", "parameters": {"zone": "ground|upstairs|office", "celsius": "15-25"}}
{"name": "weather.get", "parameters": {"day": "today|tomorrow|weekend"}}
{"name": "timer.start", "parameters": {"minutes": "1-720", "label": "string"}}
{"name": "music.play", "parameters": {"room": "string", "query": "artist, album, playlist or radio", "volume": "0-100"}}
{"name": "shopping.add", "parameters": {"items": "list of strings", "store": "market|pharmacy|hardware"}}
{"name": "door.lock", "parameters": {"door": "front|back|garage", "locked": "bool"}}
{"name": "calendar.get", "parameters": {"person": "string", "day": "today|tomorrow|week"}}

# House
- People: Alice and Bob (parents), Carol (grandmother, lives downstairs), Dave (lodger, his own calendar and
  music; never mention his data to others), Leo (8 years old). Guests use the guest profile.
- Quiet hours are 22:00 to 07:00: music at most 20% volume, no announcements in the bedroom or kids room.
- Leo may control lights and music in the kids room only; he may not unlock doors or change the heating.
- The garage door stays locked unless Alice or Bob asks. Confirm every unlock by repeating the door name.
- Heating is eco: 19 C by day, 16 C at night; the office only on weekdays.
- Weather: give the temperature in Celsius and say whether an umbrella is needed.
- If a request is ambiguous (which room? which person?), ask one short question instead of guessing.
"""

COMMANDS = [
    "turn on the kitchen lights", "what's the weather tomorrow?", "set the living room to 21 degrees",
    "play some jazz in the living room", "start a pasta timer for 9 minutes", "add milk and eggs to the list",
    "is the front door locked?", "dim the bedroom lights to 30%", "what's on my calendar today?",
    "turn off all the lights downstairs", "do I need an umbrella this weekend?", "lock the garage",
    "what time is it in Lisbon?", "play the morning radio in the kitchen", "add batteries to the hardware list",
]
CONVERSATION = [
    "Can you help me plan dinner tonight?", "We have rice, eggs and spinach.", "How long should the rice cook?",
    "Set a timer for that.", "And add soy sauce to the shopping list.", "Dim the kitchen lights when it rings.",
    "What's the weather for a walk after dinner?", "Thanks, that's all for now.",
]
SHARED_USERS = ["alice", "bob", "carol"]
PRIVATE_USERS = {"dave": "dave-private-7f3a9c", "guest": "guest-profile-91c2e4"}  # their own cache namespace


def turn(user: str, text: str) -> str:
    return f"\n### {user}: {text}\n### hearth:"


@dataclass
class Job:
    """One request of the workload; a conversation turn's prompt is built when its turn comes."""

    id: int
    lane: int
    user: str
    text: str
    salt: str = ""
    turn: int = -1  # the conversation turn, or -1
    result: dict = field(default_factory=dict)


class Proc:
    """A subprocess whose stdout lines go to a queue and stderr lines to a list, read by daemon threads."""

    def __init__(self, cmd: list[str], env: dict[str, str], ready: str, stdin: bool = False) -> None:
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     stdin=subprocess.PIPE if stdin else subprocess.DEVNULL)
        self.lines: queue.Queue[str] = queue.Queue()
        self.stderr: list[str] = []
        self.ready = threading.Event()
        self._mark = ready
        threading.Thread(target=self._pump, args=(self.proc.stdout, self.lines.put), daemon=True).start()
        threading.Thread(target=self._pump, args=(self.proc.stderr, self.stderr.append), daemon=True).start()

    def _pump(self, stream, sink) -> None:
        for line in stream:
            if self._mark in line:
                self.ready.set()
            sink(line)

    def wait_ready(self, what: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.ready.wait(0.1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"demo: {what} did not start (rc={self.proc.poll()}):\n{''.join(self.stderr[-20:])}")

    def ask(self, request: dict, timeout_s: float) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        try:
            return json.loads(self.lines.get(timeout=timeout_s))
        except queue.Empty:
            tail = "".join(self.stderr[-20:])
            raise TimeoutError(f"no answer in {timeout_s:.0f} s; worker stderr:\n{tail}") from None


def build_jobs(num_requests: int, num_lanes: int) -> list[Job]:
    """Round robin over the workers: mostly shared users, every 4th request from a user with a private
    salt, every 5th the next turn of the conversation (so its turns move from worker to worker)."""
    jobs = []
    private = list(PRIVATE_USERS.items())
    num_turns = 0
    for i in range(num_requests):
        lane = i % num_lanes
        if i % 5 == 4 and num_turns < len(CONVERSATION):
            jobs.append(Job(i, lane, "leo", CONVERSATION[num_turns], turn=num_turns))
            num_turns += 1
        elif i % 4 == 3:
            user, salt = private[(i // 4) % len(private)]
            jobs.append(Job(i, lane, user, COMMANDS[i % len(COMMANDS)], salt=salt))
        else:
            jobs.append(Job(i, lane, SHARED_USERS[i % len(SHARED_USERS)], COMMANDS[i % len(COMMANDS)]))
    return jobs


class Conversation:
    """One growing chat: each turn's prompt is the previous prompt + its reply + the new user line.

    Turns run on different workers; a turn waits until the previous one has its reply. Jobs are
    taken in id order on every worker, so the turn waited for is never behind the waiting one.
    """

    def __init__(self) -> None:
        self.prompt = SYSTEM_PROMPT
        self.points: list[int] = []
        self.num_done = 0
        self._changed = threading.Condition()

    def next(self, turn_index: int, user: str, text: str) -> tuple[str, list[int]]:
        with self._changed:
            self._changed.wait_for(lambda: self.num_done == turn_index)
            self.prompt += turn(user, text)
            self.points.append(1 + len(self.prompt.encode()))  # +1: the byte tokenizer's bos
            return self.prompt, self.points[-2:]  # cache up to this turn; reuse up to the last one

    def reply(self, text: str) -> None:
        with self._changed:
            # The random model's bytes are not text; keep them printable so the prompt stays readable.
            self.prompt += "".join(c if c.isascii() and c.isprintable() else "." for c in text)
            self.num_done += 1
            self._changed.notify_all()


def request_for(job: Job, conversation: Conversation, max_new_tokens: int) -> dict:
    system_end = 1 + len(SYSTEM_PROMPT.encode())
    if job.turn >= 0:
        prompt, points = conversation.next(job.turn, job.user, job.text)
    else:
        prompt, points = SYSTEM_PROMPT + turn(job.user, job.text), []
    return {"id": job.id, "prompt": prompt, "breakpoints": [system_end, *points], "salt": job.salt,
            "max_new_tokens": max_new_tokens}


def fmt_tiers(result: dict) -> str:
    if result.get("degraded"):
        return "degraded"
    tiers = result.get("tiers", [])
    return "+".join(f"{t}:{tiers.count(t)}" for t in dict.fromkeys(tiers)) or "-"


ROW = "{:>3} {:>6} {:<6} {:>6} {:>6} {:>8} {:<16} {:>8} {:>8}"


def print_row(job: Job, lock: threading.Lock) -> None:
    r = job.result
    with lock:
        if "error" in r:
            print(f"{job.id:>3} w{job.lane:<5} {job.user:<6} error: {r['error']}", flush=True)
            return
        print(ROW.format(job.id, f"w{job.lane}", job.user, r["prompt_tokens"], r["cached_tokens"],
                         r["computed_tokens"], fmt_tiers(r), f"{r['ttft_s'] * 1e3:.1f}", f"{r['total_s'] * 1e3:.1f}"),
              flush=True)


def run_lanes(workers: list[Proc], jobs: list[Job], max_new_tokens: int, timeout_s: float) -> None:
    """Every worker runs its own jobs in order, all workers at once, printing each row as it finishes."""
    lock = threading.Lock()
    conversation = Conversation()

    def lane(index: int) -> None:
        for job in (j for j in jobs if j.lane == index):
            try:
                job.result = workers[index].ask(request_for(job, conversation, max_new_tokens), timeout_s)
            except (OSError, TimeoutError, ValueError) as e:  # a dead worker: report it, keep the others going
                job.result = {"error": f"{type(e).__name__}: {e}"}
            if job.turn >= 0:
                conversation.reply(job.result.get("text", ""))
            print_row(job, lock)

    threads = [threading.Thread(target=lane, args=(i,)) for i in range(len(workers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def median_ms(values: list[float]) -> float | None:
    return round(statistics.median(values) * 1e3, 2) if values else None


def summarize(jobs: list[Job], baseline: list[tuple[dict, dict]], stats, wall_s: float) -> dict:
    done = [j.result for j in jobs if "error" not in j.result]
    prompt = sum(r["prompt_tokens"] for r in done)
    reused = sum(r["cached_tokens"] for r in done)
    cold = [r for r in done if r["cached_tokens"] == 0]
    warm = [r for r in done if r["cached_tokens"] > 0]
    tiers = {t.tier: {"capacity_bytes": t.capacity_bytes, "used_bytes": t.used_bytes, "num_blocks": t.num_blocks,
                      "puts": t.puts, "evictions": t.evictions} for t in stats.tiers}
    return {
        "requests": len(jobs), "errors": len(jobs) - len(done), "workers": len({j.lane for j in jobs}),
        "hit_rate_requests": round(len(warm) / max(1, len(done)), 4),
        "hit_rate_tokens": round(reused / max(1, prompt), 4),
        "prompt_tokens": prompt, "tokens_reused": reused, "tokens_computed": prompt - reused,
        "ttft_cold_median_ms": median_ms([r["ttft_s"] for r in cold]),
        "ttft_warm_median_ms": median_ms([r["ttft_s"] for r in warm]),
        "prefill_tokens_per_s": round((prompt - reused) / max(1e-9, sum(r["prefill_s"] for r in done)), 1),
        # What a client sees: prompt tokens handled per second of time to first token, reuse included.
        "effective_prompt_tokens_per_s": round(prompt / max(1e-9, sum(r["ttft_s"] for r in done)), 1),
        "baseline": [{"prompt_tokens": off["prompt_tokens"], "cache_off_ttft_ms": round(off["ttft_s"] * 1e3, 2),
                      "cache_on_ttft_ms": round(on["ttft_s"] * 1e3, 2), "cached_tokens": on["cached_tokens"]}
                     for off, on in baseline],
        "tiers": tiers, "saved_percent": round(100 * reused / max(1, prompt), 1), "wall_s": round(wall_s, 1),
    }


def print_summary(s: dict) -> None:
    print("\nsummary")
    print(f"  requests: {s['requests']} on {s['workers']} worker processes, errors: {s['errors']}")
    print(f"  hit rate: {100 * s['hit_rate_requests']:.0f}% of requests found cached tokens; "
          f"{100 * s['hit_rate_tokens']:.1f}% of prompt tokens were reused")
    print(f"  tokens reused: {s['tokens_reused']}, computed: {s['tokens_computed']} "
          f"(of {s['prompt_tokens']} prompt tokens)")
    print(f"  time to first token, median: cold {s['ttft_cold_median_ms']} ms, warm {s['ttft_warm_median_ms']} ms")
    print(f"  prefill throughput: {s['prefill_tokens_per_s']} computed tokens/s of prefill; "
          f"{s['effective_prompt_tokens_per_s']} prompt tokens/s of time to first token, counting reuse")
    for b in s["baseline"]:
        print(f"  baseline, same prompt ({b['prompt_tokens']} tokens) alone: cache off {b['cache_off_ttft_ms']} ms, "
              f"cache on {b['cache_on_ttft_ms']} ms ({b['cached_tokens']} cached), "
              f"{b['cache_off_ttft_ms'] / max(b['cache_on_ttft_ms'], 1e-3):.0f}x")
    for name, t in s["tiers"].items():
        print(f"  tier {name}: {t['used_bytes'] / MiB:.1f} of {t['capacity_bytes'] / MiB:.0f} MiB of KV, "
              f"{t['num_blocks']} blocks, {t['evictions']} evictions")
    print(f"  the cache saved {s['saved_percent']}% of prefill tokens (wall time {s['wall_s']} s)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--requests", type=int, default=36, help="requests in the workload (default 36)")
    p.add_argument("--workers", type=int, default=3, help="worker processes (default 3)")
    p.add_argument("--data-dir", help="the daemon's data directory (default: a temp dir, removed at the end)")
    p.add_argument("--json", metavar="FILE", help="also write the summary as JSON to FILE")
    p.add_argument("--host-mib", type=int, default=24, help="host tier MiB (default 24: small enough to evict)")
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--baseline", type=int, default=2, help="requests rerun with cache off vs on (default 2)")
    args = p.parse_args()
    if args.requests < 1 or args.workers < 1:
        p.error("--requests and --workers must be >= 1")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    started = time.monotonic()
    tmp = tempfile.mkdtemp(prefix="tc-demo-", dir="/tmp")  # short: Unix socket paths stay under 108 bytes
    socket = os.path.join(tmp, "d.sock")
    env = {**os.environ, "PYTHONPATH": str(REPO), "TIERCACHE_HOST__CAPACITY_BYTES": str(args.host_mib * MiB),
           "TIERCACHE_DISK__CAPACITY_BYTES": str(max(256, 4 * args.host_mib) * MiB)}
    py = [sys.executable, "-m", "tiercache.cli"]
    daemon = Proc([*py, "serve", "--socket", socket, "--data-dir", args.data_dir or os.path.join(tmp, "data")],
                  env, ready="tiercache listening on")
    # Workers load their model while the daemon starts; they connect on their first request.
    workers = [Proc([*py, "worker", "--socket", socket, "--threads", "1", "--timeout", "10", "--log-level", "INFO"],
                    env, ready="worker ready", stdin=True) for _ in range(args.workers)]
    code = 1
    try:
        from tiercache.client import Client  # torch + grpc: imported while the subprocesses start

        daemon.wait_ready("the daemon", 90)
        for i, w in enumerate(workers):
            w.wait_ready(f"worker {i}", 90)
        print(f"daemon on unix:{socket}, {args.workers} workers ready after {time.monotonic() - started:.1f} s; "
              f"system prompt {len(SYSTEM_PROMPT.encode())} bytes")
        print(ROW.format("#", "worker", "user", "prompt", "cached", "computed", "tiers", "ttft ms", "total ms"))
        jobs = build_jobs(args.requests, args.workers)
        run_lanes(workers, jobs, args.max_new_tokens, timeout_s=60)
        # Baseline: the first requests again on one idle worker, cache off then on, one at a time.
        baseline = []
        for job in [j for j in jobs if j.turn < 0][: args.baseline]:
            request = request_for(job, Conversation(), args.max_new_tokens)
            baseline.append((workers[0].ask({**request, "cache": False}, 60), workers[0].ask(request, 60)))
        with Client(f"unix:{socket}", timeout_s=10) as client:
            stats = client.stats()
        for w in workers:
            w.proc.stdin.close()
        worker_codes = [w.proc.wait(60) for w in workers]
        summary = summarize(jobs, baseline, stats, time.monotonic() - started)
        daemon.proc.send_signal(signal.SIGTERM)
        daemon_code = daemon.proc.wait(60)
        summary["wall_s"] = round(time.monotonic() - started, 1)
        print_summary(summary)
        print(f"  daemon exit code {daemon_code} after SIGTERM; worker exit codes {worker_codes}")
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
        code = 0 if daemon_code == 0 and not any(worker_codes) and not summary["errors"] else 1
    finally:
        for proc in [*workers, daemon]:
            if proc.proc.poll() is None:
                proc.proc.kill()
                proc.proc.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
