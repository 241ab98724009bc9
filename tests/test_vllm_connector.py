"""vLLM with tiercache as its KV connector, end to end: real vLLM engines (the CPU build, in
.venv-vllm made by scripts/setup_vllm.sh), each in its own process, one real daemon.

- A fresh vLLM process reads what an earlier one computed (600- and 2000-token prompts) and gives the
  greedy tokens of a vLLM run without the connector; the admin CLI shows the blocks.
- Two vLLM processes at once share the daemon.
- A daemon SIGKILLed mid-run: vLLM answers by recomputing, then reads the restarted daemon's disk tier.
- A block damaged on disk: a miss, recomputed, the right answer.
- A prompt whose every block failed to load is written back once vLLM recomputed it: the next process
  that never saw it gets a full hit.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import pytest

from benchmarks.daemons import REPO, Daemon, cleanup, short_dir, small_config, write_config
from benchmarks.reliability import flip, payload_offset
from benchmarks.tiny_llama import prompt_ids, save_tiny_llama
from benchmarks.vllm_engine import VLLM_PYTHON, VllmEngine
from tiercache.client import Client
from tiercache.keys import Namespace, block_keys
from tiercache.weights import weights_digest

pytestmark = pytest.mark.slow

PROMPTS = {"p600": prompt_ids(600, 1), "p2000": prompt_ids(2000, 2), "q1000": prompt_ids(1000, 3),
           "k800": prompt_ids(800, 5), "x2000": prompt_ids(2000, 4), "y1500": prompt_ids(1500, 6),
           "r1200": prompt_ids(1200, 7)}
MAX_TOKENS = 8
BLOCK = 128


def vllm_or_skip() -> None:
    failed = pathlib.Path(VLLM_PYTHON).parent.parent / "FAILED"
    if failed.exists():
        pytest.skip(f"vLLM could not be installed here:\n{failed.read_text()}")
    if not os.path.exists(VLLM_PYTHON):
        pytest.skip(f"no vLLM environment at {VLLM_PYTHON}: run scripts/setup_vllm.sh (scripts/test.sh does)")


class World:
    """One daemon (restartable on its data dir), the model, the logs, and engines kept between tests."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.model = save_tiny_llama(os.path.join(base, "tiny"))
        config = small_config(base, host_pages=32768, disk_bytes=512 << 20)
        self.config = config
        self.conf = write_config(os.path.join(base, "daemon.toml"), config)
        self.socket = config.server.socket
        self.daemon: Daemon | None = None
        self.engines: dict[str, VllmEngine] = {}
        self.baseline: dict[str, list[int]] = {}
        self.start_daemon()

    def start_daemon(self) -> None:
        self.daemon = Daemon(config=self.conf)
        self.daemon.wait_ready(90)

    def engine(self, name: str, connector: str = "tiercache") -> VllmEngine:
        """Engine `name`: the one started for it already (see start), else a new one, started now."""
        if name not in self.engines:
            self.engines[name] = VllmEngine(self.model, connector=connector, socket=self.socket, retry_after_s=1.0,
                                            log_path=os.path.join(self.base, f"vllm-{name}.log"))
        return self.engines[name]

    def start(self, connectors: dict[str, str]) -> None:
        """Start the named engines side by side (an engine's start is mostly imports, one core each),
        for the tests that use them later; each is a process of its own that has run nothing yet."""
        with concurrent.futures.ThreadPoolExecutor(len(connectors)) as pool:
            for future in [pool.submit(self.engine, name, connector) for name, connector in connectors.items()]:
                future.result()

    def namespace(self) -> Namespace:
        """The connector's namespace for this model (tiercache/integrations/vllm/naming.py)."""
        return Namespace(model=f"llama/{self.model.name}", weights=weights_digest(self.model), dtype="float32",
                         num_layers=2, num_kv_heads=2, head_dim=64, block_tokens=BLOCK, adapter="engine=vllm;tp=0/1")

    def stats(self) -> dict:
        out = subprocess.run([sys.executable, "-m", "tiercache.cli", "admin", "stats", "--socket", self.socket,
                              "--json"], cwd=REPO, capture_output=True, text=True, timeout=60, check=True)
        return json.loads(out.stdout)

    def log(self, name: str) -> str:
        return pathlib.Path(self.base, f"vllm-{name}.log").read_text(errors="replace")

    def close(self) -> None:
        with concurrent.futures.ThreadPoolExecutor(max(1, len(self.engines))) as pool:  # each waits for its exit
            list(pool.map(VllmEngine.close, self.engines.values()))
        if self.daemon is not None:
            self.daemon.kill()


@pytest.fixture(scope="module")
def world():
    vllm_or_skip()
    base = short_dir()
    w = World(base)
    try:
        w.start({"baseline": "none", "first": "tiercache", "second": "tiercache"})
        with w.engine("baseline", connector="none") as engine:
            for name, prompt in PROMPTS.items():
                reply = engine.generate(prompt, MAX_TOKENS)
                assert reply["num_cached_tokens"] == 0
                w.baseline[name] = reply["tokens"]
        yield w
    finally:
        w.close()
        cleanup(base)


def full_blocks(name: str) -> int:
    return len(PROMPTS[name]) // BLOCK * BLOCK


def test_a_fresh_vllm_reads_what_another_computed(world: World) -> None:
    first = world.engine("first")  # kept for the last test, which needs a process that never saw its prompt
    for name in ("p600", "p2000"):
        reply = first.generate(PROMPTS[name], MAX_TOKENS)
        assert reply["num_cached_tokens"] == 0 and reply["tokens"] == world.baseline[name]
    ns = world.namespace()
    with Client(f"unix:{world.socket}") as client:  # the keys the connector wrote are the spec's keys
        assert len(client.lookup(block_keys(ns, PROMPTS["p2000"]))) == 15
    second = world.engine("second")  # a vLLM that has run nothing yet; kept for the next tests
    for name in ("p600", "p2000"):
        reply = second.generate(PROMPTS[name], MAX_TOKENS)
        assert reply["num_cached_tokens"] == full_blocks(name), name  # 512 and 1920 tokens, all from tiercache
        assert reply["tokens"] == world.baseline[name], f"{name}: tokens differ from vLLM without the connector"
    (described,) = [n for n in world.stats()["namespaces"] if n["adapter"] == "engine=vllm;tp=0/1"]
    assert (described["model"], described["block_tokens"], described["num_blocks"]) == ("llama/" + world.model.name,
                                                                                        BLOCK, 4 + 15)
    assert described["digest"] == ns.digest().hex()


def test_two_vllm_processes_at_once(world: World) -> None:
    world.start({"third": "tiercache"})
    second = world.engine("second")
    third = world.engine("third")
    replies: dict[str, dict] = {}

    def run(engine: VllmEngine, names: list[str], tag: str) -> None:
        for name in names:
            replies[f"{tag}:{name}"] = engine.generate(PROMPTS[name], MAX_TOKENS)

    threads = [threading.Thread(target=run, args=(second, ["q1000", "x2000"], "second")),
               threading.Thread(target=run, args=(third, ["q1000", "p2000"], "third"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert len(replies) == 4
    for key, reply in replies.items():
        assert reply["tokens"] == world.baseline[key.split(":")[1]], key
    assert replies["third:p2000"]["num_cached_tokens"] == full_blocks("p2000")  # written by the first process
    time.sleep(1.0)  # write-backs are asynchronous
    (described,) = [n for n in world.stats()["namespaces"] if n["adapter"] == "engine=vllm;tp=0/1"]
    assert described["num_blocks"] == 4 + 15 + 7 + 15  # q1000, put by both, stored once


def test_daemon_killed_mid_run_then_restarted(world: World) -> None:
    third = world.engine("third")
    result: dict = {}
    request = threading.Thread(target=lambda: result.update(third.generate(PROMPTS["x2000"], MAX_TOKENS)))
    request.start()
    world.daemon.proc.send_signal(signal.SIGKILL)  # while the request is on its way
    world.daemon.proc.wait(10)
    request.join(300)
    assert result["tokens"] == world.baseline["x2000"]
    reply = third.generate(PROMPTS["k800"], MAX_TOKENS)  # the daemon is gone: vLLM computes it all
    assert reply["tokens"] == world.baseline["k800"] and reply["num_cached_tokens"] == 0
    world.start_daemon()  # on the same data dir: committed blocks are found on disk
    time.sleep(1.5)  # the connector leaves a failed daemon alone for retry_after_s (1 s here)
    third.generate(prompt_ids(300, 99), 1)  # its first call meets the restarted daemon
    reply = third.generate(PROMPTS["p600"], MAX_TOKENS)  # third never saw p600; the disk tier has it
    assert reply["tokens"] == world.baseline["p600"]
    assert reply["num_cached_tokens"] == full_blocks("p600")
    assert "tiercache lookup failed" in world.log("third") or "tiercache fetch failed" in world.log("third")


def test_a_block_damaged_on_disk_is_recomputed(world: World) -> None:
    second, third = world.engine("second"), world.engine("third")
    assert second.generate(PROMPTS["y1500"], MAX_TOKENS)["tokens"] == world.baseline["y1500"]
    keys = block_keys(world.namespace(), PROMPTS["y1500"])
    time.sleep(1.0)
    with Client(f"unix:{world.socket}") as client:
        assert len(client.lookup(keys)) == 11
        victim = client.fetch(keys[:5])[4]
    assert world.daemon.stop() == 0  # SIGTERM: everything queued reaches the disk
    data_mdb = os.path.join(world.config.data_dir, "disk", "data.mdb")
    with open(data_mdb, "rb") as f:
        at = payload_offset(f.read(), victim)
    assert at >= 0
    flip(data_mdb, at + 4096)
    world.start_daemon()
    time.sleep(1.5)
    third.generate(prompt_ids(300, 98), 1)  # reconnect, as above
    reply = third.generate(PROMPTS["y1500"], MAX_TOKENS)  # never computed by third: blocks 0-3 load, 4 fails
    assert reply["tokens"] == world.baseline["y1500"], "a damaged block changed the answer"
    assert "4 of 11 blocks" not in world.log("third")
    assert "7 of 11 blocks of request" in world.log("third")  # blocks 4-10 recomputed
    assert world.stats()["verification_failures"] >= 1


def wait_for(what: str, condition, timeout_s: float = 60.0) -> None:  # noqa: ANN001 - a callable
    """Poll `condition` (write-backs and disk commits are asynchronous) until it holds; fail naming `what`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not after {timeout_s:.0f} s"
        time.sleep(0.2)


def test_blocks_whose_load_failed_are_written_back_once_recomputed(world: World) -> None:
    """Regression: after "9 of 9 blocks could not be loaded; vLLM recomputes them" the
    recomputed blocks were not written back: the prompt stayed a miss for every later process."""
    prompt, n = PROMPTS["r1200"], full_blocks("r1200") // BLOCK
    keys = block_keys(world.namespace(), prompt)
    data_mdb = os.path.join(world.config.data_dir, "disk", "data.mdb")
    # The earlier tests' engines when they ran (neither has seen this prompt), else new ones.
    writer, repairer = (world.engines.get(name) or world.engine(name) for name in ("second", "third"))
    with Client(f"unix:{world.socket}") as client:
        assert writer.generate(prompt, MAX_TOKENS)["tokens"] == world.baseline["r1200"]
        wait_for("the first run's write-back", lambda: len(client.lookup(keys)) == n)
        first = client.fetch(keys[:1])[0]
        client.flush(tier="host")  # the disk copies only: a damaged one is dropped when read, never served

        def on_disk() -> int:
            return payload_offset(pathlib.Path(data_mdb).read_bytes(), first)

        wait_for("block 0 committed to data.mdb", lambda: on_disk() >= 0)
        flip(data_mdb, on_disk() + 4096)  # its checksum fails: the prefix ends before block 0
        reply = repairer.generate(prompt, MAX_TOKENS)
        assert reply["tokens"] == world.baseline["r1200"], "a damaged block changed the answer"
        assert f"{n} of {n} blocks of request" in world.log("third"), "the load did not fail"
        wait_for("the recomputed blocks' write-back", lambda: len(client.lookup(keys)) == n)
    # A process that never saw this prompt: its vLLM prefix cache cannot hold it (first ran p600 and p2000 only).
    reply = world.engine("first").generate(prompt, MAX_TOKENS)
    assert reply["num_cached_tokens"] == n * BLOCK and reply["tokens"] == world.baseline["r1200"]
    assert world.stats()["verification_failures"] >= 1
