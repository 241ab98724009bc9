"""The disk tier's background scrub: every block re-read and verified at a bounded rate, between calls."""

from __future__ import annotations

import bisect
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tiercache.config import DiskConfig
from tiercache.errors import CorruptBlock, TierCacheError
from tiercache.store_types import VerifyReport
from tiercache.tiers.base import DurableTier

logger = logging.getLogger(__name__)

STATE_FORMAT = 1
SAVE_EVERY_S = 30.0  # the position is written at most this often while a pass runs (and at its end, and at stop)
BATCH_S = 0.25  # a batch reads about this many seconds' worth of the rate, then sleeps it off
PAUSE_POLL_S = 0.1  # how often a paused scrub asks whether the calls have stopped


@dataclass(frozen=True)
class ScrubProgress:
    """What the scrub has done since the daemon started, and where its current pass is."""

    bytes_per_s: int  # the configured rate
    bytes_scrubbed: int  # record bytes read and verified
    blocks_scrubbed: int
    damaged_blocks: int  # found damaged, dropped and counted (also in the store's verification_failures)
    passes: int  # full passes completed
    pass_fraction: float  # share of the key space the current pass has covered; 0 between passes
    last_pass_unix_s: float  # when the last full pass ended (kept across restarts); 0: never
    next_pass_unix_s: float  # when the next pass starts, between passes; 0 while one runs
    paused: bool  # waiting for the daemon's calls to stop
    paused_s: float  # seconds spent waiting for calls


def key_fraction(key: bytes) -> float:
    """How far into the sorted key space `key` lies. Store keys are BLAKE2b digests, spread evenly
    over it, so this is also about the share of the blocks that sort before it."""
    return int.from_bytes(key[:8].ljust(8, b"\0"), "big") / 2**64


class Scrubber:
    """Re-reads and verifies every committed block of a disk tier, in key order, at up to
    cfg.scrub_bytes_per_s, only while `busy()` is false (no call in flight for cfg.scrub_idle_s).

    A pass walks a sorted snapshot of the tier's keys taken when it starts (blocks written later wait
    for the next pass) in batches of about BATCH_S seconds' worth of the rate; DurableTier.check reads
    each without a lock and changes nothing. A block that fails is handed to `verify` (the store's
    Verify of those keys), which reads it again under the store's lock and drops and counts it as any
    failed read does; what that confirms is counted as damaged. The last key checked, the start of
    the pass and the end of the last one are kept in `state_path` (JSON, written every SAVE_EVERY_S,
    at the end of a pass and at stop), so a restarted daemon goes on after that key; a new pass
    starts cfg.scrub_interval_s after the previous one started.
    """

    def __init__(self, cfg: DiskConfig, disk: DurableTier, verify: Callable[[Sequence[bytes]], VerifyReport],
                 state_path: str | Path, clock: Callable[[], float] = time.time) -> None:
        self.cfg = cfg
        self._disk = disk
        self._verify = verify
        self._state_path = Path(state_path)
        self._clock = clock
        self._mu = threading.Lock()  # the figures progress() reads; the pass itself is the thread's own
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Lock()  # held by stop() until the position is kept (see stop)
        self._position, self._pass_started, self._last_pass, clean = self._load()
        if not clean and self._position:
            self._position = self._skip_after_a_crash(self._position)
        self._keys: list[bytes] | None = None  # the current pass's snapshot; None between passes
        self._next = 0
        self._saved_at = time.monotonic()
        self._bytes = self._blocks = self._damaged = self._passes = 0
        self._paused = False
        self._paused_s = 0.0

    # ---- the thread ---------------------------------------------------------------------------------

    def start(self, busy: Callable[[], bool]) -> None:
        """Run the scrub on a thread of its own until stop(). A no-op at rate 0."""
        if not self.cfg.scrub_bytes_per_s or self._thread is not None:
            return
        self._save()  # "not stopped" from now on: a crash before the next save still counts as one (see _load)
        self._thread = threading.Thread(target=self._run, args=(busy,), name="tiercache-scrub", daemon=True)
        self._thread.start()
        logger.info("disk scrub: bytes_per_s=%d, resuming at %.1f%% of a pass", self.cfg.scrub_bytes_per_s,
                    100 * key_fraction(self._position) if self._position else 0.0)

    def stop(self) -> None:
        """Stop the thread (after its current batch) and keep the position. Idempotent."""
        self._stop.set()
        # Two threads may stop it at once (the daemon's shutdown and store.close): the first joins the
        # thread and keeps the position; the second waits until it has (returning while the state
        # file still said "not stopped" would let a clean exit read as a crash at the next start).
        with self._stopping:
            thread, self._thread = self._thread, None
            if thread is None:
                return
            thread.join()
            self._save(stopped=True)

    def _run(self, busy: Callable[[], bool]) -> None:
        while not self._stop.is_set():
            until_due = self._until_due()
            if until_due > 0:  # between passes: nothing to pause
                with self._mu:
                    self._paused = False
                self._stop.wait(until_due)
                continue
            if busy():
                with self._mu:
                    self._paused = True
                started = time.monotonic()
                self._stop.wait(PAUSE_POLL_S)
                with self._mu:
                    self._paused_s += time.monotonic() - started
                continue
            with self._mu:
                self._paused = False
            try:
                wait = self.step()
            except TierCacheError as e:  # the tier closing, a lost read: try again later
                logger.warning("disk scrub: batch failed: %s", e)
                wait = 1.0
            except Exception:  # noqa: BLE001 - the scrub must never take the daemon down
                logger.exception("disk scrub: batch failed")
                wait = 60.0
            if wait > 0:
                self._stop.wait(wait)

    # ---- one batch ----------------------------------------------------------------------------------

    def _until_due(self) -> float:
        """Seconds until the next pass is due; 0 while one runs (or was stopped midway)."""
        if self._keys is not None or self._position:
            return 0.0
        return max(0.0, self._pass_started + self.cfg.scrub_interval_s - self._clock())

    def step(self) -> float:
        """Check the next batch of the current pass (starting a pass when none runs, due or not);
        returns how long to wait before the next batch, so that the reads average cfg.scrub_bytes_per_s."""
        rate = self.cfg.scrub_bytes_per_s
        if self._keys is None:
            keys = sorted(self._disk.lru_keys())
            with self._mu:
                if not self._position:
                    self._pass_started = self._clock()
                self._keys = keys
                self._next = bisect.bisect_right(keys, self._position) if self._position else 0
        started = time.monotonic()
        budget = max(1, int(rate * BATCH_S))
        read = checked = 0
        suspects: list[bytes] = []
        while self._next < len(self._keys) and read < budget:
            key = self._keys[self._next]
            self._next += 1
            try:
                nbytes = self._disk.check(key)
            except CorruptBlock as e:
                logger.debug("disk scrub: block %s failed a check: %s", key.hex(), e)
                suspects.append(key)
                checked += 1
                continue
            read += nbytes
            checked += nbytes > 0
        # Only what the store's own read confirms, and of that only the disk copies (Verify also checks
        # the block's other copies: a damaged host copy is dropped there, but is no finding of the scrub).
        damaged = len({k for k in self._verify(suspects).dropped_keys if not self._disk.contains(k)}) \
            if suspects else 0
        if damaged:
            logger.warning("disk scrub: dropped damaged blocks=%d", damaged)
        done = self._next >= len(self._keys)
        with self._mu:
            self._bytes += read
            self._blocks += checked
            self._damaged += damaged
            if done:
                self._passes += 1
                self._last_pass = self._clock()
                self._position, self._keys = b"", None
            elif self._next:
                self._position = self._keys[self._next - 1]
        if done:
            logger.info("disk scrub: pass done: blocks=%d damaged=%d (since start)", self._blocks, self._damaged)
        if done or time.monotonic() - self._saved_at >= SAVE_EVERY_S:
            self._save()
        return max(0.0, read / rate - (time.monotonic() - started))

    def progress(self) -> ScrubProgress:
        with self._mu:
            between = self._keys is None and not self._position
            return ScrubProgress(
                self.cfg.scrub_bytes_per_s, self._bytes, self._blocks, self._damaged, self._passes,
                key_fraction(self._position) if self._position else 0.0, self._last_pass,
                self._pass_started + self.cfg.scrub_interval_s if between else 0.0, self._paused, self._paused_s)

    # ---- the kept position --------------------------------------------------------------------------

    def _load(self) -> tuple[bytes, float, float, bool]:
        """(position, start of the current or last pass, end of the last pass, whether the daemon that
        wrote it stopped its scrub cleanly) from state_path; a missing or unreadable file starts afresh."""
        try:
            state = json.loads(self._state_path.read_text())
            if state.get("format") != STATE_FORMAT:
                raise ValueError(f"format {state.get('format')!r}, not {STATE_FORMAT}")
            return (bytes.fromhex(state["position"]), float(state["pass_started_unix_s"]),
                    float(state["last_pass_unix_s"]), bool(state.get("stopped", True)))
        except FileNotFoundError:
            return b"", 0.0, 0.0, True
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            logger.warning("disk scrub: %s unreadable (%s): starting a new pass", self._state_path, e)
            return b"", 0.0, 0.0, True

    def _skip_after_a_crash(self, position: bytes) -> bytes:
        """The position past what the scrub may have read since it was last kept, when the daemon did
        not stop cleanly: a damaged LMDB page that takes the process down (bug 1's remaining risk)
        would otherwise be read again after every restart, a crash loop. What is skipped (about
        SAVE_EVERY_S of reading, as a share of the key space: store keys are spread evenly over it)
        waits for the next pass."""
        used = max(self._disk.used_bytes, 1)
        share = min(1.0, SAVE_EVERY_S * self.cfg.scrub_bytes_per_s / used)
        at = int.from_bytes(position[:8].ljust(8, b"\0"), "big") + int(share * 2**64)
        if at >= 2**64:
            logger.warning("disk scrub: the daemon stopped while scrubbing; the rest of the pass is skipped "
                           "in case what it read last took it down")
            return b"\xff" * 32
        logger.warning("disk scrub: the daemon stopped while scrubbing; skipping %.1f%% of the key space after "
                       "the kept position in case what it read last took it down", 100 * share)
        return at.to_bytes(8, "big") + b"\xff" * 24

    def _save(self, stopped: bool = False) -> None:
        """Write the position atomically (a crash leaves the old file or the new one, never half of one);
        `stopped` only when the thread has ended (stop())."""
        with self._mu:
            state = {"format": STATE_FORMAT, "position": self._position.hex(),
                     "pass_started_unix_s": self._pass_started, "last_pass_unix_s": self._last_pass,
                     "stopped": stopped}
        tmp = self._state_path.with_name(self._state_path.name + ".tmp")
        try:
            tmp.write_text(json.dumps(state) + "\n")
            os.replace(tmp, self._state_path)
        except OSError as e:
            logger.warning("disk scrub: cannot keep the position in %s: %s", self._state_path, e)
        self._saved_at = time.monotonic()
