"""Puts in place: room in the host slab that a same-host caller writes a chain into, then commits."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence

from tiercache.block import Block, BlockMeta, PutResult
from tiercache.config import Config
from tiercache.errors import CapacityExceeded, InvalidArgument
from tiercache.index import Entry
from tiercache.placement import Placement
from tiercache.record_header import meta_problem
from tiercache.reservations import Reservation, Reservations

logger = logging.getLogger("tiercache.store")


class ReservedPuts:
    """A TieredStore's puts in place, made through its Placement under its lock (the same objects,
    handed in). reserve() takes host pages for each block not stored yet; the caller writes the
    payloads there (tiercache/samehost/writer.py) and commit()s: the store hashes each block where it
    lies, outside its lock (no reader sees the pages before they are published), then makes the pages
    the block, published and indexed, and applies the write policy as a put does (the disk tier reads
    the bytes from the slab, its pages kept from reuse until written). A reservation neither
    committed nor released by its deadline is given back (lapse(), on every call and by the daemon's
    idle maintenance), so a caller that died leaks nothing for longer than the lease.

    The trust boundary is the caller's uid: bytes it writes after its commit make the block fail its
    checksum, so every reader (which verifies) treats it as a miss, never as an answer.
    """

    def __init__(self, cfg: Config, placement: Placement, lock: threading.RLock, clock: Callable[[], float],
                 counters: Counter[str]) -> None:
        self.cfg = cfg
        self._placement = placement
        self._lock = lock
        self._clock = clock
        self.counters = counters
        self.reservations = Reservations()

    def reserve(self, metas: Sequence[BlockMeta], *, tenant: str, lease_s: float | None = None) -> Reservation:
        """Room for each block of `metas` (store keys; their checksums are ignored) that is not stored:
        host pages, for lease_s seconds (at most server.reserve_lease_s). InvalidArgument for a meta
        unlike the canonical layout or over store.max_block_bytes, a key given twice, or a lease <= 0;
        CapacityExceeded, reserving nothing, when the host tier cannot make room."""
        limit = self.cfg.server.reserve_lease_s
        lease = limit if lease_s is None else min(lease_s, limit)
        if not lease > 0:
            raise InvalidArgument(f"lease_s must be > 0, got {lease_s}")
        for i, meta in enumerate(metas):
            problem = meta_problem(meta)
            if problem:
                raise InvalidArgument(f"blocks[{i}]: {problem}")
            if meta.nbytes > self.cfg.store.max_block_bytes:
                raise InvalidArgument(f"blocks[{i}] of {meta.nbytes} bytes exceeds store.max_block_bytes="
                                      f"{self.cfg.store.max_block_bytes}")
        if len({m.key for m in metas}) != len(metas):
            raise InvalidArgument("a key is given twice in one reservation")
        placement = self._placement
        with self._lock:
            self._lapse_locked()
            placement.forget_lost_writes()
            now, protect = self._clock(), {m.key for m in metas}
            pages: list[tuple[int, ...] | None] = []
            try:
                for meta in metas:
                    entry = placement.index.get(meta.key)
                    present = entry is not None and not entry.is_expired(now)
                    pages.append(None if present else placement.reserve(meta.nbytes, protect))
            except CapacityExceeded:
                for held in pages:
                    if held is not None:
                        placement.unreserve(held)
                raise
            reservation = self.reservations.add(tenant, list(metas), pages, time.monotonic() + lease)
            self.counters["reservations"] += 1
        return reservation

    def commit(self, rid: int, *, tenant: str, ttl_s: float, pin: bool = False
               ) -> tuple[list[PutResult], list[Block], list[bytes]]:
        """Store reservation `rid`'s blocks from what the caller wrote: one result per block; when the
        remote tier's write policy wants every new block, verified copies of those stored (for the
        caller to queue outside the lock); the reservation's store keys. NotFound for an unknown or
        lapsed reservation."""
        placement = self._placement
        with self._lock:
            self._lapse_locked()
            reservation = self.reservations.claim(rid, tenant)  # its bytes still count for its tenant
        # Hashed where they lie, outside the lock: nobody but the caller sees these pages yet.
        host = placement.tiers.host
        try:
            written = [(p, m.nbytes) for m, p in zip(reservation.metas, reservation.pages) if p is not None]
            sums = iter(host.checksums(written))
        except BaseException:
            with self._lock:
                self.reservations.finish(reservation)
                self._give_back(reservation)
            raise
        results: list[PutResult] = []
        stored: list[Entry] = []
        with self._lock:
            self.reservations.finish(reservation)
            placement.forget_lost_writes()
            now = self._clock()
            protect = {m.key for m in reservation.metas}
            for meta, pages in zip(reservation.metas, reservation.pages):
                total = next(sums) if pages is not None else 0
                entry = placement.index.get(meta.key)
                if entry is not None and not entry.is_expired(now):  # stored before, or meanwhile
                    if pages is not None:
                        placement.unreserve(pages)
                    placement.put_again(entry, ttl_s, pin, now)
                    results.append(PutResult.ALREADY_PRESENT)
                    continue
                if pages is None:  # present at reserve time, gone since: nothing was written for it
                    results.append(PutResult.ALREADY_PRESENT)
                    continue
                if entry is not None:
                    placement.drop(meta.key)
                entry = placement.adopt(meta.with_checksum(total), pages, now, ttl_s=ttl_s, pinned=pin)
                results.append(PutResult.STORED)
                stored.append(entry)
                self.counters["puts"] += 1
            placement.write_through_host(stored, protect)
            placement.touch_tail_first([m.key for m in reservation.metas])
            copies = [placement.read(entry, "host") for entry in stored] \
                if placement.tiers.remote is not None and self.cfg.remote.write_policy == "all" else []
            self.counters["reserved_blocks_committed"] += len(stored)
        return results, copies, [m.key for m in reservation.metas]

    def release(self, rid: int, *, tenant: str) -> int:
        """Give reservation `rid`'s room back unused; returns the pages freed. NotFound if unknown."""
        with self._lock:
            reservation = self.reservations.take(rid, tenant)
            self._give_back(reservation)
        return reservation.num_pages

    def lapse(self) -> int:
        """Give back every reservation past its deadline; returns how many."""
        with self._lock:
            return self._lapse_locked()

    def _lapse_locked(self) -> int:
        gone = self.reservations.lapsed(time.monotonic())
        for reservation in gone:
            logger.info("reservation lapsed: blocks=%d pages=%d given back", len(reservation.metas),
                        reservation.num_pages)
            self._give_back(reservation)
        self.counters["reservations_lapsed"] += len(gone)
        return len(gone)

    def _give_back(self, reservation: Reservation) -> None:
        for pages in reservation.pages:
            if pages is not None:
                self._placement.unreserve(pages)
