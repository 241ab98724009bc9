"""One worker process of the API's pool: a Worker serving requests from a pipe, each generated token sent back."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from multiprocessing.connection import Connection

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSpec:
    """What each worker process loads and where it finds the daemon (picklable: it crosses a spawn)."""

    model_dir: str | None = None
    target: str | None = None  # "unix:/path" or "host:port"; None: no daemon (cache off)
    token: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    block_tokens: int = 16
    threads: int = 1
    timeout_s: float = 2.0
    previews: bool = True
    log_level: str = "WARNING"


def serve(conn: Connection, spec: WorkerSpec) -> None:
    """The process's whole life: load the model, say ("ready", info), then serve

    ("run", rid, fields) -> ("prefilled", rid, cached_tokens), ("token", rid, id)*, then ("done", rid, result)
    or ("error", rid, kind, message) at any point;
    ("cancel", rid) stops request rid after its current token; ("stop",) or a closed pipe ends the process.
    """
    logging.basicConfig(level=spec.log_level, format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s")
    import torch

    from tiercache.errors import TierCacheError
    from tiercache.worker.model import load_model
    from tiercache.worker.request import Request, Worker
    from tiercache.worker.sampling import Sampling

    torch.set_num_threads(spec.threads)
    loaded = load_model(spec.model_dir, device=spec.device, dtype=getattr(torch, spec.dtype))
    factory = None
    target = spec.target
    if target is not None:
        from tiercache.client import Client

        def factory() -> Client:
            return Client(target, token=spec.token, timeout_s=spec.timeout_s, tune_allocator=True)

    worker = Worker(loaded, factory, block_tokens=spec.block_tokens, previews=spec.previews)
    text_config = loaded.model.config.get_text_config(decoder=True)
    conn.send(("ready", {"name": loaded.name, "pid": os.getpid(), "vocab_size": text_config.vocab_size,
                         "context": getattr(text_config, "max_position_embeddings", None) or 0,
                         "dtype": loaded.dtype, "num_layers": loaded.num_layers}))
    stopping = False
    try:
        while not stopping:
            try:
                message = conn.recv()
            except EOFError:
                break
            if message[0] == "stop":
                break
            if message[0] != "run":
                continue  # a cancel for a request that already finished
            _, rid, fields = message
            cancelled = False

            def on_token(token: int, rid: int = rid) -> bool:
                nonlocal cancelled, stopping
                conn.send(("token", rid, token))
                while conn.poll():  # the server only sends cancel or stop while a request runs
                    other = conn.recv()
                    if other[0] == "stop":
                        stopping = cancelled = True
                    elif other[0] == "cancel" and other[1] == rid:
                        cancelled = True
                return not cancelled

            try:
                sampling = Sampling(fields.pop("temperature", 0.0), fields.pop("top_p", 1.0), fields.pop("seed", None))
                def on_prefilled(cached: int, rid: int = rid) -> None:
                    conn.send(("prefilled", rid, cached))

                result = worker.run(Request(sampling=sampling, **fields), on_token, on_prefilled)
                conn.send(("done", rid, {"prompt_tokens": result.prompt_tokens, "cached_tokens": result.cached_tokens,
                                         "computed_tokens": result.computed_tokens, "tiers": result.tiers,
                                         "ttft_s": result.ttft_s, "total_s": result.total_s,
                                         "prefill_s": result.prefill_s, "num_generated": len(result.tokens),
                                         "finish_reason": result.finish_reason, "degraded": result.degraded}))
            except TierCacheError as e:
                conn.send(("error", rid, type(e).__name__, str(e)))
            except Exception as e:
                logger.exception("request failed")
                conn.send(("error", rid, "internal", f"{type(e).__name__}: {e}"))
    except (BrokenPipeError, EOFError, OSError):
        pass  # the server went away
    finally:
        worker.close()
