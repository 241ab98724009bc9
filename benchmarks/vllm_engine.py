"""One vLLM engine in its own process, driven by JSON lines: the harness of the vLLM connector's
tests and of scripts/bench_vllm.py.

Run as `python -m benchmarks.vllm_engine --model DIR [--connector tiercache --socket PATH]` with the
vLLM environment's Python (scripts/setup_vllm.sh). It answers each request line
{"prompt": [ids], "max_tokens": n} with {"tokens": [...], "num_cached_tokens": n, "wall_s": s};
{"quit": true} ends it. Replies go to stdout behind REPLY (vLLM logs there too).
VllmEngine starts one and talks to it.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import queue
import subprocess
import sys
import threading
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
REPLY = "@@engine "
VLLM_PYTHON = os.environ.get("TIERCACHE_VLLM_PYTHON", str(REPO / ".venv-vllm" / "bin" / "python"))
CONNECTOR_MODULE = "tiercache.integrations.vllm.connector"


def _reply(obj: dict) -> None:
    sys.stdout.write(REPLY + json.dumps(obj) + "\n")
    sys.stdout.flush()


def _transfer_config(args: argparse.Namespace):  # noqa: ANN202 - vLLM's type, imported late
    from vllm.config import KVTransferConfig

    if args.connector == "tiercache":
        extra = {"socket": args.socket, "timeout_ms": args.timeout_ms, "retry_after_s": args.retry_after_s}
        return KVTransferConfig(kv_connector="TierCacheConnector", kv_connector_module_path=CONNECTOR_MODULE,
                                kv_role="kv_both", kv_connector_extra_config=extra,
                                kv_load_failure_policy="recompute")
    if args.connector == "example":
        return KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                                kv_connector_extra_config={"shared_storage_path": args.example_dir})
    return None


def serve(args: argparse.Namespace) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_space_gib))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    config = _transfer_config(args)
    extra = {"kv_transfer_config": config, "disable_hybrid_kv_cache_manager": True} if config else {}
    llm = LLM(model=args.model, dtype="float32", max_model_len=args.max_model_len, enforce_eager=True,
              enable_prefix_caching=not args.no_prefix_caching, seed=0,
              max_num_batched_tokens=args.max_num_batched_tokens or None, **extra)
    _reply({"ready": True, "start_s": time.perf_counter() - started, "pid": os.getpid()})
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("quit"):
            break
        params = SamplingParams(max_tokens=request.get("max_tokens", 1), temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=request["prompt"])], params, use_tqdm=False)[0]
        wall = time.perf_counter() - t0
        _reply({"tokens": list(out.outputs[0].token_ids), "num_cached_tokens": out.num_cached_tokens or 0,
                "wall_s": wall})
    _reply({"bye": True})


class VllmEngine:
    """A vLLM engine process (see the module docstring); generate() sends one request."""

    def __init__(self, model: str | os.PathLike[str], *, connector: str = "none", socket: str = "",
                 example_dir: str = "", max_model_len: int = 2048, prefix_caching: bool = True,
                 timeout_ms: int = 2000, retry_after_s: float = 1.0, max_num_batched_tokens: int = 0,
                 log_path: str | os.PathLike[str] | None = None,
                 python: str = VLLM_PYTHON, start_timeout_s: float = 300.0) -> None:
        cmd = [python, "-m", "benchmarks.vllm_engine", "--model", str(model), "--connector", connector,
               "--max-model-len", str(max_model_len), "--timeout-ms", str(timeout_ms),
               "--retry-after-s", str(retry_after_s), "--max-num-batched-tokens", str(max_num_batched_tokens)]
        if socket:
            cmd += ["--socket", socket]
        if example_dir:
            cmd += ["--example-dir", example_dir]
        if not prefix_caching:
            cmd.append("--no-prefix-caching")
        # vLLM's own log lines (and the connector's, sent through vLLM's handlers) come on stdout.
        self._log = open(log_path, "w") if log_path else subprocess.DEVNULL  # noqa: SIM115 - closed in close()
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     text=True, env=env)
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._pumping = threading.Thread(target=self._pump, daemon=True)
        self._pumping.start()
        self.ready = self._read(start_timeout_s)

    def _pump(self) -> None:
        """Replies into the queue, vLLM's log lines into the log, None at the end. A thread: select()
        on the pipe would miss a reply already read into the file object's buffer."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(REPLY):
                self._lines.put(line)
            elif self._log is not subprocess.DEVNULL:  # vLLM logs to stdout: keep its lines with the rest
                self._log.write(line)
                self._log.flush()
        self._lines.put(None)

    def _read(self, timeout_s: float) -> dict:
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            self.close(timeout_s=5.0)
            raise TimeoutError(f"vLLM engine gave no reply in {timeout_s:.0f}s") from None
        if line is None:
            code = self.proc.wait()
            raise RuntimeError(f"vLLM engine exited with {code} (see its log)")
        return json.loads(line[len(REPLY):])

    def generate(self, prompt: list[int], max_tokens: int = 1, timeout_s: float = 300.0) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"prompt": prompt, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        return self._read(timeout_s)

    def close(self, timeout_s: float = 60.0) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=timeout_s)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._pumping.join(10)
        if self._log is not subprocess.DEVNULL:
            self._log.close()

    def __enter__(self) -> VllmEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--connector", choices=("none", "tiercache", "example"), default="none")
    parser.add_argument("--socket", default="")
    parser.add_argument("--example-dir", default="/tmp/vllm-example-connector")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--timeout-ms", type=int, default=2000)
    parser.add_argument("--retry-after-s", type=float, default=1.0)
    parser.add_argument("--kv-space-gib", type=int, default=1)
    parser.add_argument("--max-num-batched-tokens", type=int, default=0, help="vLLM's; 0: its default")
    serve(parser.parse_args())


if __name__ == "__main__":
    main()
