"""The API's pool of worker processes: a request goes to an idle worker, a bounded queue waits for one."""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from tiercache.api.child import WorkerSpec, serve

logger = logging.getLogger(__name__)


class QueueFull(Exception):
    """Every worker is busy and the queue holds max_queue requests already."""


class NotReady(Exception):
    """No worker has loaded the model yet (or every worker has died)."""


class WorkerFailed(Exception):
    """The worker refused or failed the request: `kind` is the exception's name ("InvalidArgument", "internal")."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass
class _Process:
    index: int
    process: Any
    conn: Any
    info: dict = field(default_factory=dict)
    alive: bool = True
    rid: int | None = None  # the request it runs
    events: asyncio.Queue | None = None  # where that request's events go


class Generation:
    """One request on one worker: iterate for generated token ids; `result` holds the worker's figures
    once the iteration ends. `cancel()` (idempotent) stops it after the current token; `finish()` then
    waits for the worker's figures."""

    def __init__(self, pool: WorkerPool, proc: _Process, rid: int, events: asyncio.Queue) -> None:
        self._pool, self._proc, self._rid, self._events = pool, proc, rid, events
        self.result: dict | None = None
        self.cached_tokens = 0  # known once the prompt is prefilled (before the first token)
        self.done = False
        self._cancelled = False

    def __aiter__(self) -> AsyncIterator[int]:
        return self._tokens()

    async def _tokens(self) -> AsyncIterator[int]:
        while not self.done:
            event = await self._events.get()
            if event[0] == "token":
                yield event[2]
            elif event[0] == "prefilled":
                self.cached_tokens = event[2]
            elif event[0] == "done":
                self.done, self.result = True, event[2]
            else:  # ("error", rid, kind, message)
                self.done = True
                raise WorkerFailed(event[2], event[3])

    def cancel(self) -> None:
        if not self.done and not self._cancelled:
            self._cancelled = True
            self._pool._cancel(self._proc, self._rid)

    async def finish(self) -> None:
        """After cancel(): the remaining tokens are dropped and `result` is set (the worker is idle again)."""
        async for _ in self._tokens():
            pass


class WorkerPool:
    """`num_workers` processes running `serve(spec)`; at most `max_queue` requests wait for one.

    Each process has one duplex pipe. A reader thread per process hands its messages to the event
    loop; a worker goes back to the idle queue when its request's "done" or "error" arrives, so a
    request whose client went away (cancelled) frees its worker within one token. A worker that exits
    after loading the model (killed, out of memory) fails its request and is started again.
    """

    def __init__(self, spec: WorkerSpec, num_workers: int, max_queue: int = 64) -> None:
        if num_workers < 1:
            raise ValueError(f"--workers must be >= 1, got {num_workers}")
        if max_queue < 0:
            raise ValueError(f"--max-queue must be >= 0, got {max_queue}")
        self.spec, self.num_workers, self.max_queue = spec, num_workers, max_queue
        self._procs: list[_Process] = []
        self._idle: asyncio.Queue[_Process] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ids = itertools.count(1)
        self.num_waiting = 0
        self.num_tokens = 0  # generated tokens received, those of cancelled requests included
        self.num_restarts = 0  # workers started again after one exited
        self._closing = False
        self.info: dict = {}  # the first ready worker's model info: name, context, vocab_size, ...

    @property
    def ready(self) -> bool:
        return bool(self.info) and any(p.alive and p.info for p in self._procs)

    @property
    def loading(self) -> bool:
        """Not ready, and a worker is still loading the model (or none has been started yet)."""
        return not self.ready and (not self._procs or any(p.alive for p in self._procs))

    @property
    def num_ready(self) -> int:
        return sum(1 for p in self._procs if p.alive and p.info)

    @property
    def num_busy(self) -> int:
        return sum(1 for p in self._procs if p.rid is not None)

    @property
    def _queue(self) -> asyncio.Queue[_Process]:
        assert self._idle is not None, "the pool was not started"
        return self._idle

    @property
    def _running_loop(self) -> asyncio.AbstractEventLoop:
        assert self._loop is not None, "the pool was not started"
        return self._loop

    def start(self) -> None:
        """Spawn the processes (call from the event loop that will use the pool); returns at once."""
        self._loop = asyncio.get_running_loop()
        self._idle = asyncio.Queue()
        self._procs = [self._spawn(index) for index in range(self.num_workers)]

    def _spawn(self, index: int) -> _Process:
        ctx = multiprocessing.get_context("spawn")  # never fork a process with threads and gRPC channels
        ours, theirs = ctx.Pipe(duplex=True)
        process = ctx.Process(target=serve, args=(theirs, self.spec), name=f"tiercache-api-worker-{index}",
                              daemon=True)
        process.start()
        theirs.close()
        proc = _Process(index, process, ours)
        threading.Thread(target=self._read, args=(proc,), name=f"tiercache-api-reader-{index}", daemon=True).start()
        return proc

    async def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Until every worker has loaded its model (or died); NotReady when none is up after timeout_s."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while any(p.alive and not p.info for p in self._procs) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if not self.ready:
            raise NotReady("no worker process loaded the model")

    async def wait_loaded(self, timeout_s: float) -> None:
        """Until one worker has loaded the model. NotReady at once when none was started or all have exited,
        and after timeout_s while they are still loading."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not self.ready:
            if not self._procs:
                raise NotReady("the workers have not started")
            if not any(p.alive for p in self._procs):
                raise NotReady("every worker process has exited")
            if loop.time() >= deadline:
                raise NotReady(f"the model is still loading (waited {timeout_s:g} s)")
            await asyncio.sleep(0.05)

    def _read(self, proc: _Process) -> None:
        while True:
            try:
                message = proc.conn.recv()
            except (EOFError, OSError):
                self._running_loop.call_soon_threadsafe(self._died, proc)
                return
            self._running_loop.call_soon_threadsafe(self._deliver, proc, message)

    def _deliver(self, proc: _Process, message: tuple) -> None:
        if message[0] == "ready":
            proc.info = message[1]
            self.info = self.info or message[1]
            self._queue.put_nowait(proc)
            logger.info("worker %d ready: pid=%d model=%s", proc.index, message[1]["pid"], message[1]["name"])
            return
        if message[0] == "token":
            self.num_tokens += 1
        if message[1] != proc.rid or proc.events is None:
            return  # a token of a request that was cancelled and already released
        proc.events.put_nowait(message)
        if message[0] in ("done", "error"):
            proc.rid, proc.events = None, None
            self._queue.put_nowait(proc)

    def _died(self, proc: _Process) -> None:
        if not proc.alive:
            return
        proc.alive = False
        if proc.events is not None:
            proc.events.put_nowait(("error", proc.rid, "internal", "the worker process exited"))
            proc.rid, proc.events = None, None
        if self._closing:
            return
        if not proc.info:  # it never loaded the model: another try would fail the same way
            logger.error("worker %d (pid %s) exited while loading the model", proc.index, proc.process.pid)
            return
        logger.error("worker %d (pid %s) exited; starting another", proc.index, proc.process.pid)
        self.num_restarts += 1
        self._procs[proc.index] = self._spawn(proc.index)

    def _cancel(self, proc: _Process, rid: int) -> None:
        if proc.rid == rid and proc.alive:
            try:
                proc.conn.send(("cancel", rid))
            except OSError:
                pass  # the reader sees it die

    async def submit(self, fields: dict[str, Any]) -> Generation:
        """Send one request (worker.Request fields plus temperature, top_p, seed) to the next idle worker,
        waiting for one in the queue. Raises NotReady, QueueFull."""
        if not self.ready:
            if not self._procs:
                raise NotReady("the workers have not started")
            raise NotReady("the model is still loading" if any(p.alive for p in self._procs)
                           else "every worker process has exited")
        if self._queue.empty() and self.num_waiting >= self.max_queue:
            raise QueueFull(f"all {self.num_workers} workers are busy and {self.num_waiting} requests are queued")
        self.num_waiting += 1
        try:
            while True:
                proc = await self._queue.get()
                if proc.alive:
                    break
        finally:
            self.num_waiting -= 1
        rid = next(self._ids)
        proc.rid, proc.events = rid, asyncio.Queue()
        try:
            proc.conn.send(("run", rid, fields))
        except OSError:
            self._died(proc)
        return Generation(self, proc, rid, proc.events)

    def close(self, timeout_s: float = 10.0) -> None:
        """Ask every worker to stop (finishing its queued Puts), then end what is left."""
        self._closing = True
        for proc in self._procs:
            try:
                proc.conn.send(("stop",))
            except OSError:
                pass
        for proc in self._procs:
            proc.process.join(timeout_s)
            if proc.process.is_alive():
                proc.process.terminate()
                proc.process.join(5)
            proc.conn.close()
