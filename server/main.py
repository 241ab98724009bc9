"""serve(config): the daemon's lifetime, from single-instance checks to a drained, clean exit."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING

from server.instance import DataDirLock, SocketClaim
from tiercache.config import Config
from tiercache.errors import DeadlineExceeded

if TYPE_CHECKING:
    from server.auth import Activity
    from tiercache.store import TieredStore

logger = logging.getLogger(__name__)


def _tune_process() -> None:
    """Per-process settings for a daemon that moves multi-MiB blocks from many threads at once."""
    import torch

    from tiercache.malloc import tune_malloc

    # Parallelism comes from concurrent calls; intra-op OpenMP threads only spin against them.
    torch.set_num_threads(1)
    tune_malloc()  # block-sized buffers stay on the heap: no fresh page faults per record


MAX_POSTPONED = 10  # maintenance waits for a quiet moment at most this many intervals


def _maintain(store: TieredStore, activity: Activity, interval_s: float, integrity_s: float,
              stop: threading.Event) -> None:
    """Every interval_s, expire TTLs (between calls when possible), and at most every integrity_s
    (0: never) check the store's integrity, only between calls. The check holds the store's lock
    for O(blocks) time (about 13 ms per 1,000 blocks here): every few seconds, or forced under
    load, it would stall a large store's callers."""
    postponed = 0
    checked_at = time.monotonic()
    while not stop.wait(interval_s):
        busy = bool(activity.in_flight)
        if busy and postponed < MAX_POSTPONED:
            postponed += 1  # a busy daemon still gets its TTL expiry, just later
            continue
        postponed = 0
        try:
            expired = store.expire()
            # Only between calls, never forced: under constant traffic it waits for a quiet moment.
            if integrity_s and not busy and time.monotonic() - checked_at >= integrity_s:
                started = checked_at = time.monotonic()
                store.check_integrity()
                logger.info("integrity check passed in %.0f ms", (time.monotonic() - started) * 1e3)
            if expired:
                logger.info("expired blocks=%d", expired)
        except AssertionError as e:
            logger.error("store integrity check failed: %s", e)
        except Exception:  # noqa: BLE001 - maintenance must never take the daemon down
            logger.exception("maintenance failed")


def serve(config: Config) -> int:
    """Run the daemon until SIGTERM or SIGINT; return the exit status (0 after a clean drain).

    Raises AlreadyRunning, before touching anything (or even importing torch), when another daemon
    owns the data directory or the socket. On a signal: stop accepting calls, let in-flight ones
    finish for up to server.drain_timeout_s, queue to disk the host-only blocks the write policy
    keeps over a restart (write_back; pinned ones under selective; for up to drain_timeout_s), wait
    for queued disk writes, close the store. Writes still queued after another drain_timeout_s are
    committed all the same (a warning says so): the exit comes later, nothing accepted is lost. The
    process ignores SIGTERM and SIGINT after: it is meant to exit then.
    """
    started = time.monotonic()
    stop = threading.Event()
    # A signal handler runs between two bytecodes of the main thread, which may be holding a lock
    # at that moment (inside Event.wait, or inside the previous signal's handler): a handler that
    # took one (Event.set) could hang the daemon for good. So it only writes a byte to a pipe, and
    # the main thread, blocked reading that pipe, sets `stop` itself.
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)

    def on_signal(signum: int, frame: object) -> None:
        with contextlib.suppress(BlockingIOError):  # the pipe is full: the main thread is woken already
            os.write(wake_w, b"\0")

    # First thing: a SIGTERM during a slow start must still end in a clean shutdown.
    previous = {signum: signal.signal(signum, on_signal) for signum in (signal.SIGTERM, signal.SIGINT)}
    # The kernel hands a process's signal to any of its threads (gRPC's, the disk writer's...). The
    # Python handler above only runs once the main thread executes bytecode, which it never does
    # while blocked reading the pipe: the signal was lost and the daemon ran on. The wakeup fd is
    # written by the C-level handler, in whichever thread took the signal, and wakes the read.
    previous_wakeup = signal.set_wakeup_fd(wake_w)
    drained = False
    lock = claim = store = None
    try:
        lock = DataDirLock(config.data_dir)
        claim = SocketClaim(config.server.socket) if config.server.socket else None
        from server.app import create_server  # heavy (torch, grpc): only once we own the instance
        from server.auth import Activity
        from tiercache.store import TieredStore

        _tune_process()
        store = TieredStore.open(config)
        for tier in store.tier_stats():
            logger.info("tier %s: capacity_bytes=%d blocks=%d used_bytes=%d", tier.name, tier.capacity_bytes,
                        tier.num_blocks, tier.used_bytes)
        activity = Activity()
        server, address = create_server(config, store, claim=claim, activity=activity)
        server.start()
        addresses = " ".join(dict.fromkeys(a for a in (f"unix:{config.server.socket}" if claim else "", address) if a))
        logger.info("listening on %s (started in %.0f ms)", addresses, (time.monotonic() - started) * 1e3)
        sys.stdout.write(f"tiercache listening on {addresses}\n")
        sys.stdout.flush()
        maintenance = threading.Thread(target=_maintain, name="maintenance", daemon=True,
                                       args=(store, activity, config.server.idle_check_s,
                                             config.server.integrity_check_s, stop))
        maintenance.start()
        os.read(wake_r, 1)  # until SIGTERM or SIGINT
        stop.set()
        logger.info("shutting down: draining in-flight calls for up to %.1f s", config.server.drain_timeout_s)
        server.stop(config.server.drain_timeout_s).wait()
        maintenance.join()
        saved = store.save_host_blocks(config.server.drain_timeout_s)
        if saved:
            logger.info("queued blocks=%d host-only blocks to disk (write_policy=%s)", saved,
                        config.disk.write_policy)
        try:
            store.flush_writes(config.server.drain_timeout_s)
            logger.info("in-flight calls and disk writes drained")
        except DeadlineExceeded as e:  # store.close() below commits them all: a late exit, not a loss
            logger.warning("%s; committing them before exiting", e)
        drained = True
    finally:
        stop.set()
        if store is not None:
            store.close()
        if claim is not None:
            claim.release()
        if lock is not None:
            lock.release()
        # Drained, later signals of a burst are ignored from here to the exit: the interpreter's
        # shutdown would put back the default action (death by SIGTERM, after a clean drain), and
        # the pipe stays open (our handler may still run once; a closed descriptor could be another
        # file's by then). A start that failed puts the caller's handlers back and closes the pipe.
        for signum, handler in previous.items():  # None: a handler not installed from Python
            signal.signal(signum, signal.SIG_IGN if drained else signal.SIG_DFL if handler is None else handler)
        signal.set_wakeup_fd(previous_wakeup)
        if not drained:  # our handler is gone: nothing writes to the pipe any more
            os.close(wake_r)
            os.close(wake_w)
    logger.info("stopped")
    return 0
