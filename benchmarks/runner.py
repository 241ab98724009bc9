"""Worker processes (multiprocessing spawn) running tiercache's Worker over a chosen backend, and their pool."""

from __future__ import annotations

import contextlib
import functools
import logging
import multiprocessing
import os
import queue
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from benchmarks.workload import Job, ModelSpec

if TYPE_CHECKING:  # the driver process never imports torch, which backends does
    from benchmarks.backends import Meter

logger = logging.getLogger(__name__)

RESULT_TIMEOUT_S = 900.0


def _until_connected(call: Callable[[], object], timeout_s: float = 30.0) -> None:
    """call() until it gets through: right after a daemon restart, gRPC's shared connection may
    still be in its reconnect backoff (calls fail at once with the old "no such file" error)."""
    from tiercache.errors import Unavailable

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            call()
            return
        except Unavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


@contextlib.contextmanager
def cache_builds_timed(meter: Callable[[], Meter]) -> Iterator[None]:
    """Time the Worker's cache builds into meter().build_s (and count them in .builds) while inside.

    The Worker builds its KV cache from the fetched blocks with kvcache.blocks_to_cache, as
    tiercache.worker imported it; that name is wrapped here, so that every row's fetch + build ends
    with the same thing, the model's cache, whether its fetch copied the blocks or not.
    """
    import tiercache.worker.request as worker_module

    build = worker_module.blocks_to_cache

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return build(*args, **kwargs)
        finally:
            m = meter()
            m.build_s += time.perf_counter() - t0
            m.builds += 1

    worker_module.blocks_to_cache = timed
    try:
        yield
    finally:
        worker_module.blocks_to_cache = build


def _worker_main(index: int, spec: dict[str, Any], new_tokens: int, threads: int, inbox: Any, outbox: Any) -> None:
    """One worker process: load the model once, then obey configure / run / lookup / finish / exit messages."""
    import torch

    from benchmarks.backends import Meter, Timed, count_cached, make_backend
    from benchmarks.services import proc_status_bytes, reset_peak_rss
    from benchmarks.workload import build_model
    from tiercache.layout import BlockLayout
    from tiercache.worker import Request, Worker
    from tiercache.worker.kvcache import prefill

    logging.basicConfig(level=logging.WARNING, format=f"worker{index} %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(threads)
    loaded = build_model(ModelSpec(**spec))
    for n in (64, 256):  # warm the allocator and kernels before anything is timed
        prefill(loaded.model, list(range(3, 3 + n)), None)
    worker: Worker | None = None
    backend_spec: dict[str, Any] = {"kind": "none"}
    meter = Meter()
    base_rss = 0
    outbox.put(("ready", index, {"pid": os.getpid()}))

    holder: dict[str, Any] = {}
    builds = contextlib.ExitStack()  # for the process's lifetime
    builds.enter_context(cache_builds_timed(lambda: meter))

    def factory() -> Timed:
        if "warm" in holder:
            return holder.pop("warm")
        ns = holder["worker"].namespace()
        holder["adapter"] = Timed(make_backend(backend_spec, BlockLayout.of(ns), ns.digest()), meter)
        return holder["adapter"]

    def new_worker(block_tokens: int) -> Worker:
        holder.clear()
        holder["worker"] = Worker(loaded, None if backend_spec["kind"] == "none" else factory,
                                  block_tokens=block_tokens, retry_after_s=0.0)
        return holder["worker"]

    while True:
        op, payload = inbox.get()
        try:
            if op == "configure":
                if worker is not None:
                    worker.close()
                backend_spec, meter = payload["backend"], Meter()
                worker = new_worker(payload["block_tokens"])
                if backend_spec["kind"] != "none":
                    # Connect now (unmetered): a long-running worker's first request does not pay for it.
                    warm = holder["warm"] = factory()
                    _until_connected(functools.partial(warm.inner.lookup, [bytes(32)]))
                    warm.inner.fetch([bytes(32)])
                reset_peak_rss(os.getpid())
                base_rss = proc_status_bytes(os.getpid(), "VmRSS") or 0
                reply: Any = None
            elif op == "run":
                job: Job = payload
                assert worker is not None, "configure before run"
                before = meter.snapshot()
                result = worker.run(Request(job.tokens, max_new_tokens=new_tokens, breakpoints=job.breakpoints))
                ttft_done = time.perf_counter()
                worker.drain()  # the write-back lands before the next request (off the TTFT, as in Worker)
                after = meter.snapshot()
                if result.cached_tokens and after["builds"] == before["builds"]:
                    raise RuntimeError("the Worker built its cache without tiercache.worker.request.blocks_to_cache: "
                                       "the benchmark no longer times the cache build")
                reply = {"id": job.id, "kind": job.kind, "prefix": job.prefix, "worker": index,
                         "prompt_tokens": result.prompt_tokens, "cached_tokens": result.cached_tokens,
                         "computed_tokens": result.computed_tokens, "tiers": sorted(set(result.tiers)),
                         "ttft_s": result.ttft_s, "total_s": result.total_s, "degraded": result.degraded,
                         "drain_s": time.perf_counter() - ttft_done,
                         **{k: after[k] - before[k] for k in after}}
            elif op == "lookup":
                assert worker is not None, "configure before lookup"
                tokens, breakpoints = payload
                ns = worker.namespace()
                reply = {"namespace": ns.to_dict(), "found": 0, "keys": 0}
                if backend_spec["kind"] != "none":
                    # The adapter the Worker uses, so an in-process cache is looked up where it lives.
                    adapter = holder.get("adapter") or factory()
                    reply.update(count_cached(adapter.inner, ns, tokens, breakpoints))
            elif op == "finish":
                peak = proc_status_bytes(os.getpid(), "VmHWM") or 0
                reply = {"growth_bytes": max(0, peak - base_rss), "peak_bytes": peak, "base_bytes": base_rss}
                if worker is not None:
                    worker.close()
                    worker = None
            elif op == "exit":
                outbox.put(("bye", index, None))
                return
            else:
                raise ValueError(f"unknown message {op!r}")
            outbox.put(("ok", index, reply))
        except Exception as e:  # noqa: BLE001 - reported to the driver, which stops the run
            logger.exception("worker %d failed on %s", index, op)
            outbox.put(("error", index, f"{type(e).__name__}: {e}"))


class WorkerPool:
    """N long-lived worker processes; jobs are dispatched to idle workers as their dependencies finish."""

    def __init__(self, num_workers: int, model: ModelSpec, *, threads: int, new_tokens: int) -> None:
        self._ctx = multiprocessing.get_context("spawn")
        self._spec = asdict(model)  # plain data: the child rebuilds the ModelSpec
        self._new_tokens = new_tokens
        self._threads = threads
        self._outbox = self._ctx.Queue()
        self._procs: list[Any] = [None] * num_workers
        self._inboxes: list[Any] = [None] * num_workers
        for i in range(num_workers):
            self._spawn(i)
        self._wait_ready(range(num_workers))

    @property
    def size(self) -> int:
        return len(self._procs)

    def _spawn(self, index: int) -> None:
        inbox = self._ctx.Queue()
        proc = self._ctx.Process(target=_worker_main, name=f"bench-worker-{index}",
                                 args=(index, self._spec, self._new_tokens, self._threads, inbox, self._outbox),
                                 daemon=True)
        proc.start()
        self._procs[index], self._inboxes[index] = proc, inbox

    def _receive(self, timeout_s: float = RESULT_TIMEOUT_S) -> tuple[str, int, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                message = self._outbox.get(timeout=1.0)
            except queue.Empty:
                dead = [i for i, p in enumerate(self._procs) if p is not None and not p.is_alive()]
                if dead:
                    raise RuntimeError(f"worker process(es) {dead} died (exit codes "
                                       f"{[self._procs[i].exitcode for i in dead]})") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no answer from the workers in {timeout_s:.0f} s") from None
                continue
            if message[0] == "error":
                raise RuntimeError(f"worker {message[1]}: {message[2]}")
            return message

    def _wait_ready(self, indices: Sequence[int]) -> None:
        waiting = set(indices)
        while waiting:
            op, index, _ = self._receive(timeout_s=600.0)
            if op == "ready":
                waiting.discard(index)

    def _all(self, op: str, payload: Any) -> list[Any]:
        for inbox in self._inboxes:
            inbox.put((op, payload))
        replies: list[Any] = [None] * self.size
        for _ in range(self.size):
            _, index, reply = self._receive()
            replies[index] = reply
        return replies

    def _one(self, index: int, op: str, payload: Any) -> Any:
        self._inboxes[index].put((op, payload))
        return self._receive()[2]

    def configure(self, backend: dict[str, Any], block_tokens: int) -> None:
        """Every worker gets a new tiercache Worker (fresh cost model) over a new adapter for `backend`."""
        self._all("configure", {"backend": backend, "block_tokens": block_tokens})

    def finish(self) -> list[dict[str, int]]:
        """Close each worker's adapter; report each process's memory growth since configure."""
        return self._all("finish", None)

    def lookup(self, index: int, tokens: Sequence[int], breakpoints: Sequence[int]) -> dict[str, Any]:
        """How many of the prompt's keys (full blocks, then breakpoint tails) worker `index`'s backend holds,
        and the worker's namespace (for checks from another process)."""
        return self._one(index, "lookup", (list(tokens), list(breakpoints)))

    def run(self, jobs: Sequence[Job], before_each: Callable[[Job], None] | None = None) -> tuple[list[dict], float]:
        """Run the jobs (dependencies and lanes respected) and return their results in job order and the wall time."""
        done: dict[int, dict] = {}
        pending = list(jobs)
        idle = set(range(self.size))
        running: dict[int, int] = {}  # worker -> job id
        start = time.perf_counter()
        while pending or running:
            for job in list(pending):
                if not idle:
                    break
                if job.after is not None and job.after not in done:
                    continue
                lane = job.lane if job.lane is not None else min(idle - {self.size - 1} or idle)
                if lane not in idle:
                    continue
                if before_each is not None:
                    before_each(job)
                pending.remove(job)
                idle.discard(lane)
                running[lane] = job.id
                self._inboxes[lane].put(("run", job))
            if not running:
                raise RuntimeError(f"jobs {[j.id for j in pending]} wait for jobs that never run")
            _, index, reply = self._receive()
            done[reply["id"]] = reply
            del running[index]
            idle.add(index)
        wall = time.perf_counter() - start
        return [done[j.id] for j in jobs], wall

    def close(self) -> None:
        for inbox, proc in zip(self._inboxes, self._procs):
            if proc is not None and proc.is_alive():
                inbox.put(("exit", None))
        for proc in self._procs:
            if proc is not None:
                proc.join(30)
                if proc.is_alive():
                    proc.kill()
                    proc.join(10)
