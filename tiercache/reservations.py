"""Room in the host slab that same-host callers write blocks into before they commit them (plain data)."""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from tiercache.block import BlockMeta
from tiercache.errors import NotFound


@dataclass
class Reservation:
    """One caller's room for a chain of blocks: `metas` are their metas under store keys (checksum
    unknown until commit), `pages` the host pages reserved for each, None for a block that was stored
    already when the room was asked for. Held until `deadline` (time.monotonic())."""

    id: int
    tenant: str
    metas: list[BlockMeta]
    pages: list[tuple[int, ...] | None]
    deadline: float
    committing: bool = False  # claimed by a commit: neither lapses nor can be claimed again

    @property
    def nbytes(self) -> int:
        """Payload bytes of the room held (counted against the tenant's quota like stored blocks)."""
        return sum(m.nbytes for m, p in zip(self.metas, self.pages) if p is not None)

    @property
    def num_pages(self) -> int:
        return sum(len(p) for p in self.pages if p is not None)


class Reservations:
    """Reservations by id; ids are random 63-bit numbers, so that one caller cannot guess another's
    (a commit also names its tenant). The caller (the store) holds its lock around every call.

    Invariant: every reservation listed is live or being committed (released, finished or expired
    ones are removed at once); no page is in two of them; bytes_by_tenant[t] is the sum of their
    nbytes for tenant t.
    """

    def __init__(self) -> None:
        self._by_id: dict[int, Reservation] = {}
        self.bytes_by_tenant: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def add(self, tenant: str, metas: list[BlockMeta], pages: list[tuple[int, ...] | None], deadline: float
            ) -> Reservation:
        rid = secrets.randbits(63)
        while rid in self._by_id or not rid:
            rid = secrets.randbits(63)
        reservation = self._by_id[rid] = Reservation(rid, tenant, metas, pages, deadline)
        self._count(tenant, reservation.nbytes)
        return reservation

    def _count(self, tenant: str, delta: int) -> None:
        total = self.bytes_by_tenant.get(tenant, 0) + delta
        if total:
            self.bytes_by_tenant[tenant] = total
        else:
            self.bytes_by_tenant.pop(tenant, None)

    def claim(self, rid: int, tenant: str) -> Reservation:
        """Reservation `rid` of `tenant`, marked as being committed (finish() removes it); NotFound when
        there is none (never made, committed or released already, lapsed, or another tenant's)."""
        reservation = self._by_id.get(rid)
        if reservation is None or reservation.tenant != tenant or reservation.committing:
            raise NotFound(f"reservation {rid} is unknown: never made, committed or released already, "
                           "or held past its lease and given back")
        reservation.committing = True
        return reservation

    def take(self, rid: int, tenant: str) -> Reservation:
        """Remove and return reservation `rid` of `tenant` (see claim for NotFound)."""
        reservation = self.claim(rid, tenant)
        self.finish(reservation)
        return reservation

    def finish(self, reservation: Reservation) -> None:
        """Remove a reservation (its room now stored or given back)."""
        del self._by_id[reservation.id]
        self._count(reservation.tenant, -reservation.nbytes)

    def lapsed(self, now: float) -> list[Reservation]:
        """Remove and return the reservations whose deadline has passed (not those being committed)."""
        gone = [r for r in self._by_id.values() if r.deadline <= now and not r.committing]
        for reservation in gone:
            self.finish(reservation)
        return gone

    def all_pages(self) -> list[tuple[int, ...]]:
        return [p for r in self._by_id.values() for p in r.pages if p is not None]

    def check_integrity(self) -> None:
        pages = [page for run in self.all_pages() for page in run]
        assert len(pages) == len(set(pages)), "a page is in two reservations"
        totals: dict[str, int] = {}
        for r in self._by_id.values():
            totals[r.tenant] = totals.get(r.tenant, 0) + r.nbytes
        assert {t: b for t, b in totals.items() if b} == self.bytes_by_tenant, "reserved bytes per tenant drifted"
