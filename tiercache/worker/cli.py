"""`tiercache worker`: one worker process serving JSON-lines requests on stdin, results on stdout."""

from __future__ import annotations

import argparse
import logging
import sys
from types import ModuleType
from typing import TYPE_CHECKING

from tiercache.config import default_socket

if TYPE_CHECKING:  # imported when the command runs: `tiercache serve` and `--help` never pay for torch
    import torch

    from tiercache.worker import Result

logger = logging.getLogger(__name__)

DTYPES = ("float32", "float16", "bfloat16")


def add_worker_command(commands: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    p = commands.add_parser("worker", parents=parents,
                            help="run a model; read JSON-lines requests on stdin, write one result per line")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--socket", metavar="PATH",
                       help=f"the daemon's Unix socket (default: server.socket of the config, {default_socket()})")
    where.add_argument("--target", metavar="HOST:PORT", help="the daemon over TCP")
    where.add_argument("--no-cache", action="store_true", help="never contact a daemon")
    p.add_argument("--config", metavar="FILE",
                   help="TOML config file (then TIERCACHE_* variables, then these flags); the worker reads its "
                        "[worker] section and server.socket")
    p.add_argument("--previews", action=argparse.BooleanOptionalAction, default=None,
                   help="store each prompt's first 64 characters for `tiercache admin ls` (never for a salted "
                        "request; default: worker.previews, true)")
    p.add_argument("--tune-malloc", action=argparse.BooleanOptionalAction, default=True,
                   help="tune this process's glibc malloc for block-sized buffers (tiercache.malloc.tune_malloc; "
                        "default on)")
    p.add_argument("--token", help="bearer token for TCP (or $TIERCACHE_TOKEN)")
    p.add_argument("--tls-root-cert", metavar="FILE", help="CA certificate to verify the daemon's TLS certificate")
    p.add_argument("--model", metavar="DIR", help="local Hugging Face model directory (default: the embedded model)")
    p.add_argument("--device", help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--block-tokens", type=int, default=16, help="tokens per cached block (default 16)")
    p.add_argument("--adapter", default="", help="adapter name that is part of the cache namespace")
    p.add_argument("--timeout", type=float, default=2.0, help="seconds for each daemon call (default 2)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--metrics-port", type=int, default=0, metavar="N",
                   help="serve this worker's request metrics (tiercache_worker_*) on http://HOST:N/metrics")
    p.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST", help="address for --metrics-port")
    p.set_defaults(func=run_worker_command)


def _device(torch: ModuleType, name: str | None) -> torch.device:
    """--device as a torch device that is there, else InvalidArgument (not a traceback from deep in torch)."""
    from tiercache.errors import InvalidArgument

    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise InvalidArgument(f"--device {name!r} is not a torch device ({e})") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidArgument(f"--device {name!r}: no CUDA device is available here (use --device cpu)")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise InvalidArgument(f"--device {name!r}: there are {torch.cuda.device_count()} CUDA devices")
    if device.type not in ("cpu", "cuda"):
        raise InvalidArgument(f"--device {name!r}: the worker runs on cpu or cuda[:N]")
    return device


def run_worker_command(args: argparse.Namespace) -> int:
    import os

    import torch  # imported here so `tiercache serve` and `--help` never pay for it

    from tiercache.config import load_config
    from tiercache.worker import Worker, run_jsonl
    from tiercache.worker.model import load_model

    if args.block_tokens < 1:
        raise ValueError(f"--block-tokens must be >= 1, got {args.block_tokens}")
    overrides: list[tuple[str, object]] = []
    if args.previews is not None:
        overrides.append(("worker.previews", args.previews))
    config = load_config(args.config, overrides=overrides)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = _device(torch, args.device)
    loaded = load_model(args.model, device=device, dtype=getattr(torch, args.dtype))
    factory = None
    if not args.no_cache:
        from tiercache.client import Client

        target = args.target or f"unix:{args.socket or config.server.socket or default_socket()}"
        token = args.token or os.environ.get("TIERCACHE_TOKEN")

        def factory() -> Client:
            # The process is this command's own: it may tune the allocator, as the daemon does.
            return Client(target, token=token, timeout_s=args.timeout, tls_root_cert=args.tls_root_cert,
                          tune_allocator=args.tune_malloc)

    metrics, stop_metrics = None, None
    if args.metrics_port:
        from prometheus_client import CollectorRegistry

        from tiercache.metrics import RequestMetrics, serve_metrics

        registry = CollectorRegistry()
        metrics = RequestMetrics(registry, "tiercache_worker_")
        stop_metrics = serve_metrics(registry, args.metrics_port, args.metrics_host)

    def observe(result: Result) -> None:
        logger.debug("request prompt_tokens=%d cached_tokens=%d ttft_ms=%.1f tiers=%s", result.prompt_tokens,
                     result.cached_tokens, result.ttft_s * 1e3, ",".join(result.tiers) or "-")
        if metrics is not None:
            metrics.observe(cached_tokens=result.cached_tokens, computed_tokens=result.computed_tokens,
                            ttft_s=result.ttft_s, prefill_s=result.prefill_s)

    worker = Worker(loaded, factory, block_tokens=args.block_tokens, adapter=args.adapter, observer=observe,
                    previews=config.worker.previews)
    logger.info("worker ready: model=%s device=%s cache=%s previews=%s", loaded.name, loaded.device,
                "off" if factory is None else "on", "on" if config.worker.previews else "off")
    if factory is not None and not loaded.uncacheable:
        from tiercache.layout import BlockLayout, block_guidance
        from tiercache.worker.model import namespace_for

        # The daemon's page size as this worker's config says (the default unless --config names it).
        layout = BlockLayout.of(namespace_for(loaded, block_tokens=args.block_tokens))
        logger.info("%s", block_guidance(layout, config.host.page_bytes))
    try:
        errors = run_jsonl(worker, sys.stdin, sys.stdout)
    finally:
        worker.close()
        if stop_metrics is not None:
            stop_metrics()
    logger.info("worker done: errors=%d", errors)
    return 0
