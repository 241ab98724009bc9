"""`tiercache api`: the HTTP server (OpenAI, Anthropic, Ollama shapes) over worker processes sharing a daemon."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from tiercache.config import default_socket

if TYPE_CHECKING:
    from tiercache.api.child import WorkerSpec
    from tiercache.client import Client

logger = logging.getLogger(__name__)


def add_api_command(commands: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    p = commands.add_parser("api", parents=parents,
                            help="serve an OpenAI-, Anthropic- and Ollama-compatible HTTP API over worker processes")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; any other needs "
                                                       "--api-keys)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000; 0: any free port)")
    p.add_argument("--model", metavar="DIR", help="local Hugging Face model directory (default: the embedded model)")
    p.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template instead of the model's own")
    p.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests that may wait for a worker; beyond, 429 with Retry-After (default 64)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads per worker (default: the CPU cores divided among the workers)")
    p.add_argument("--api-keys", metavar="FILE",
                   help="'KEY TENANT' per line: each tenant gets its own cache namespace (without it, loopback "
                        "callers only, one shared household namespace)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--socket", metavar="PATH", help=f"the daemon's Unix socket (default {default_socket()}); a "
                                                        "daemon is started there when none listens")
    where.add_argument("--target", metavar="HOST:PORT", help="a daemon over TCP (with --token)")
    where.add_argument("--no-cache", action="store_true", help="never contact a daemon")
    p.add_argument("--token", help="bearer token for --target (or $TIERCACHE_TOKEN)")
    p.add_argument("--data-dir", metavar="DIR", help="the data directory of a daemon this command starts")
    p.add_argument("--config", metavar="FILE", help="TOML config (server.socket, worker.previews, and the config of "
                                                    "a daemon this command starts)")
    p.add_argument("--device", default=None, help="torch device of the workers (default: cuda when available)")
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32")
    p.add_argument("--block-tokens", type=int, default=16, help="tokens per cached block (default 16)")
    p.add_argument("--load-wait", type=float, default=30.0,
                   help="seconds a request that arrives while the workers load the model waits for them; then 503 "
                        "with Retry-After (default 30)")
    p.add_argument("--timeout", type=float, default=2.0,
                   help="seconds for each daemon call of a worker (default 2; past it the request is computed "
                        "without the cache)")
    p.set_defaults(func=run_api_command)


def _daemon_listening(socket_path: str) -> bool:
    from tiercache.client import Client
    from tiercache.errors import TierCacheError

    if not os.path.exists(socket_path):
        return False
    client = Client(f"unix:{socket_path}", timeout_s=2.0)
    try:
        return client.health() == "SERVING"
    except (TierCacheError, OSError):
        return False
    finally:
        client.close()


def _start_daemon(args: argparse.Namespace, socket_path: str) -> subprocess.Popen:
    """`tiercache serve` on socket_path, as a child that this command stops (SIGTERM) when it exits."""
    cmd = [sys.executable, "-m", "tiercache.cli", "serve", "--socket", socket_path]
    if args.data_dir:
        cmd += ["--data-dir", args.data_dir]
    if args.config:
        cmd += ["--config", args.config]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=None, text=True)
    assert proc.stdout is not None  # stdout=PIPE
    line = proc.stdout.readline()
    if not line.startswith("tiercache listening on "):
        proc.kill()
        raise ValueError(f"the daemon on {socket_path} did not start (exit {proc.wait()}); see its log above")
    threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep its stdout drained
    logger.info("started a daemon: %s", line.strip())
    return proc


def run_api_command(args: argparse.Namespace) -> int:
    try:
        import uvicorn
    except ImportError as e:  # the HTTP stack is an extra: the daemon and workers run without it
        print(f"tiercache api needs the api extra ({e.name} is missing): pip install 'tiercache[api]'",
              file=sys.stderr)
        return 2

    from tiercache import __version__
    from tiercache.api.app import create_app
    from tiercache.api.auth import is_loopback, load_keys
    from tiercache.api.child import WorkerSpec
    from tiercache.api.pool import WorkerPool
    from tiercache.api.prompts import load_chat_format
    from tiercache.api.state import APIState
    from tiercache.api.status import api_board
    from tiercache.config import load_config

    keys = load_keys(args.api_keys) if args.api_keys else None
    if keys is None and not is_loopback(args.host):
        raise ValueError(f"--host {args.host} opens the API to the network: give --api-keys FILE")
    if args.block_tokens < 1:
        raise ValueError(f"--block-tokens must be >= 1, got {args.block_tokens}")
    config = load_config(args.config)
    daemon = None
    target = None
    if args.target:
        target = args.target
    elif not args.no_cache:
        socket_path = args.socket or config.server.socket or default_socket()
        if not _daemon_listening(socket_path):
            daemon = _start_daemon(args, socket_path)
        target = f"unix:{socket_path}"
    threads = args.threads or max(1, (os.cpu_count() or 1) // max(1, args.workers))
    device = args.device or _default_device()
    spec = WorkerSpec(model_dir=args.model, target=target, token=args.token or os.environ.get("TIERCACHE_TOKEN"),
                      dtype=args.dtype, device=device, block_tokens=args.block_tokens, threads=threads,
                      timeout_s=args.timeout,
                      previews=config.worker.previews,
                      log_level=logging.getLevelName(logging.getLogger().getEffectiveLevel()))
    if args.load_wait < 0:
        raise ValueError(f"--load-wait must be >= 0, got {args.load_wait}")
    try:
        name, context = model_card(args.model)
        api = APIState(WorkerPool(spec, args.workers, args.max_queue), load_chat_format(args.model, args.chat_template),
                       keys, model_name=name, model_context=context, load_wait_s=args.load_wait)
        api.status = api_board(_client_factory(spec), api.metrics.totals, api.metrics.requests.recent, __version__)
        server = _server_class()(uvicorn.Config(create_app(api), log_config=None, access_log=False,
                                               timeout_graceful_shutdown=5))
        sock = bind(args.host, args.port)
        host, port = sock.getsockname()[:2]
        print(f"tiercache api listening on http://{host}:{port}", flush=True)
        server.run(sockets=[sock])
    finally:
        if daemon is not None:
            daemon.terminate()
            daemon.wait(30)
    return 0


def model_card(model_dir: str | None) -> tuple[str, int]:
    """(name, context in tokens) of the model the workers will load, read without its weights, so that the
    model list names it while they load; the name is the one the worker gives it (worker/model.py)."""
    if model_dir is None:
        from tiercache.worker.model import DEFAULT_MODEL_NAME, default_model_config

        return f"{DEFAULT_MODEL_NAME}-seed0", int(default_model_config().max_position_embeddings)
    from transformers import AutoConfig

    path = pathlib.Path(model_dir).resolve()
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError):
        return "", 0  # the workers say what is wrong with the directory; the name is known once one loads it
    text = config.get_text_config(decoder=True)
    return f"{config.model_type}/{path.name}", int(getattr(text, "max_position_embeddings", 0) or 0)


def _client_factory(spec: WorkerSpec) -> Callable[[], Client] | None:
    """How the status page reaches the workers' daemon (None: --no-cache)."""
    if spec.target is None:
        return None
    target, token = spec.target, spec.token

    def factory() -> Client:
        from tiercache.client import Client

        return Client(target, token=token, timeout_s=5.0)

    return factory


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            # uvicorn re-raises a caught SIGTERM after its graceful shutdown, so the process would die by
            # the signal before stopping the daemon it started; here a clean shutdown exits 0 instead.
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return Server


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the server starts so that port 0 names its port at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted connections inherit it. Without it a streamed chunk written right after the response's
    # headers waits for the client's delayed ACK (40 ms on Linux), measured on every first token.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"--host {host} --port {port}: {e.strerror}") from None
    sock.listen(2048)
    return sock
