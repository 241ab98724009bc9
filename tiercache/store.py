"""The TieredStore: the cache's policy (what goes where, when) over tiers that placement.py changes."""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Generator, Sequence
from typing import TYPE_CHECKING

import torch

from tiercache.block import TIER_ORDER, Block, BlockMeta, PutResult, TierStats
from tiercache.config import Config
from tiercache.errors import CapacityExceeded, CorruptBlock, InvalidArgument, NotFound
from tiercache.layout import checksum
from tiercache.placement import Placement, Tiers
from tiercache.reservations import Reservation
from tiercache.store_reserved import ReservedPuts
from tiercache.store_scrub import Scrubber, ScrubProgress

# Re-exported: callers import the store's result types from here.
from tiercache.store_types import EntryInfo, HostLocation, VerifyReport
from tiercache.store_upkeep import StoreUpkeep
from tiercache.tiers.base import DurableTier, SharedMemoryTier, Tier

if TYPE_CHECKING:
    from tiercache.tiers.remote import RemoteTier
    from tiercache.tiers.remote_census import Census

__all__ = ["EntryInfo", "HostLocation", "PutResult", "TieredStore", "VerifyReport"]

logger = logging.getLogger(__name__)

LOOKUP_HITS = {name: f"lookup_hits_{name}" for name in (*TIER_ORDER, "remote")}  # counter names, made once


def _trimmed(tiers: list[str]) -> list[str]:
    """`tiers` up to its last present ("" absent) block."""
    end = len(tiers)
    while end and not tiers[end - 1]:
        end -= 1
    return tiers[:end]


class TieredStore:
    """Blocks across gpu / host / disk tiers under one lock, and optionally a remote tier shared
    with other machines' daemons (tiers/remote.py), which the index never lists.

    Policy: a put lands in host (and reaches disk per write_policy); a get reads the fastest tier,
    promotes disk hits to host and frequent host hits to gpu; a tier past its high watermark evicts
    least-recently-used unpinned blocks down to its low watermark, demoting each to the next tier
    when it is not there yet. Operations over a chain touch its keys tail first, so the head of a
    prefix is always more recently used than its tail and eviction takes tails first. With a
    remote tier, new blocks are queued for it (remote.write_policy), and a lookup that runs past the
    local tiers reads the rest of the prefix from it into host. The store decides; every change to
    the index and the tiers is made by its Placement.
    """

    def __init__(self, cfg: Config, *, host: SharedMemoryTier, disk: DurableTier | None = None,
                 gpu: Tier | None = None, remote: RemoteTier | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.cfg = cfg
        self.host, self.disk, self.gpu, self.remote = host, disk, gpu, remote
        self._clock = clock
        self._lock = threading.RLock()
        self.counters: Counter[str] = Counter()
        self._placement = Placement(cfg, Tiers(host, disk, gpu, remote), self.counters, clock)
        self.index = self._placement.index  # read by the metrics and tools; changed by placement only
        self._upkeep = StoreUpkeep(cfg, self._placement, self._lock, clock)
        self._reserved = ReservedPuts(cfg, self._placement, self._lock, clock, self.counters)
        self._scrubber: Scrubber | None = None  # see start_scrub
        self._closed = False
        if disk is not None:
            logger.info("store opened: blocks_on_disk=%d", self._placement.load_durable())

    @classmethod
    def open(cls, cfg: Config) -> TieredStore:
        """Build the tiers the config asks for (gpu only with CUDA) and the store over them."""
        from tiercache.tiers.host import HostTier

        host = HostTier(cfg.host)
        disk = gpu = remote = None
        try:
            if cfg.remote.enabled:
                try:
                    from tiercache.tiers.remote import RemoteTier
                except ModuleNotFoundError as e:
                    raise InvalidArgument(f"remote.enabled needs the {e.name!r} package: pip install "
                                          "'tiercache[remote]' (redis, hiredis, cryptography)") from None
                remote = RemoteTier(cfg.remote, max_block_bytes=cfg.store.max_block_bytes)
            if cfg.disk.enabled:
                from tiercache.tiers.disk import DiskTier

                disk = DiskTier(os.path.join(cfg.data_dir, "disk"), cfg.disk, max_block_bytes=cfg.store.max_block_bytes)
            if cfg.gpu.capacity_bytes and torch.cuda.is_available():
                from tiercache.tiers.gpu import GpuTier

                gpu = GpuTier(cfg.gpu)
        except BaseException:
            host.close()
            for tier in (disk, remote):
                if tier is not None:
                    tier.close()
            raise
        return cls(cfg, host=host, disk=disk, gpu=gpu, remote=remote)

    # ---- reads -------------------------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes], *, counted: bool = True, tenant: str = "", holes: bool = False
               ) -> list[str]:
        """Tier name of each block of the longest present prefix of `keys`. Where the local tiers'
        prefix ends, a remote tier is asked for the rest under `tenant`'s key prefix there (the
        store keys' tenant; "" is BlockMeta.tenant's default): the blocks it holds are promoted into
        host and reported as "remote" (see _pull_remote). `holes`: every key's tier up to the last
        present one, "" for an absent one, and the remote tier is asked for each key the local tiers
        lack (see LookupRequest.holes). Otherwise mutates nothing but the lookup counters (not even
        those when not `counted`: a probe, which asks the local tiers only; see LookupRequest.probe)."""
        now = self._clock()
        with self._lock:
            self._placement.forget_lost_writes()
            tiers = self.index.present_prefix(keys, now)
            if holes and len(tiers) < len(keys):
                tiers += self.index.tiers_of(keys[len(tiers):], now)
        if not counted:
            return _trimmed(tiers) if holes else tiers
        if self.remote is not None and (len(tiers) < len(keys) or "" in tiers):
            tiers += [""] * (len(keys) - len(tiers))
            wanted = [i for i, tier in enumerate(tiers) if not tier]  # without holes: the suffix
            for i in self._pull_remote(keys, wanted, tenant, holes=holes):
                tiers[i] = "remote"
            if not holes:
                tiers = tiers[: tiers.index("") if "" in tiers else len(tiers)]
        # Without holes every tier is present (the common Lookup: no second list).
        found = [tier for tier in tiers if tier] if holes else tiers
        tiers = _trimmed(tiers) if holes else tiers
        with self._lock:
            self.counters["lookups"] += 1
            self.counters["lookup_blocks_hit"] += len(found)
            for tier in set(found):
                self.counters[LOOKUP_HITS[tier]] += found.count(tier)
            self.counters["lookup_blocks_missed"] += len(keys) - len(found)
        return tiers

    def count_lookups(self, calls: int, blocks_hit: int, blocks_missed: int, disk_hits: int = 0) -> None:
        """Count lookups answered elsewhere (by a reader of the shared index and of the disk tier):
        `blocks_hit` found, `disk_hits` of them in disk, the rest in host."""
        with self._lock:
            self.counters["lookups"] += calls
            self.counters["lookup_blocks_hit"] += blocks_hit
            self.counters[LOOKUP_HITS["host"]] += blocks_hit - disk_hits
            self.counters[LOOKUP_HITS["disk"]] += disk_hits
            self.counters["lookup_blocks_missed"] += blocks_missed

    def get(self, key: bytes) -> Block:
        """The block from its fastest tier, promoting per policy. Raises NotFound or CorruptBlock
        (the damaged copy has then been dropped and counted)."""
        with self._lock:
            self._placement.forget_lost_writes()
            return self._placement.get(key, self._clock())

    def fetch(self, keys: Sequence[bytes]) -> Generator[Block, None, None]:
        """Blocks of `keys` in order, stopping at the first miss or damaged block."""
        fetched: list[bytes] = []
        try:
            for key in keys:
                try:
                    block = self.get(key)
                except (NotFound, CorruptBlock):
                    return
                fetched.append(key)
                yield block
        finally:
            with self._lock:
                self._placement.touch_tail_first(fetched)

    def locate_host(self, keys: Sequence[bytes]) -> list[HostLocation]:
        """Slab pages of each block of the longest present prefix: a read, as get() would make it (hits
        counted, disk hits promoted into host, frequent hits per policy, LRU order)."""
        out: list[HostLocation] = []
        placement = self._placement
        with self._lock, placement.snapshot_reads():
            placement.forget_lost_writes()
            now = self._clock()
            for key in keys:
                try:
                    entry = placement.live(key, now)
                    if "host" in entry.tiers:
                        try:
                            placement.host_hit(entry, now)
                        except CorruptBlock:  # read to be promoted, the host copy was damaged (now
                            if not entry.tiers:  # dropped and counted): another copy may remain
                                raise
                    if "host" not in entry.tiers:
                        block = placement.get(key, now)  # promotes into host when there is room
                        if "host" not in entry.tiers:  # a disk read may be a view of the snapshot: copied
                            out.append(HostLocation(entry.meta, (), (), Block(block.meta, block.payload.clone())))
                            continue
                except (NotFound, CorruptBlock):
                    break
                pages, generations = placement.locate(key)
                out.append(HostLocation(entry.meta, tuple(pages), tuple(generations)))
            placement.touch_tail_first([loc.meta.key for loc in out])
        return out

    def touch(self, keys: Sequence[bytes]) -> int:
        """Record reads made elsewhere (a same-host reader's, through the shared index or the disk
        tier's files) of the present prefix of `keys`: hits counted, TTLs refreshed, LRU order tail
        first. No block moves between tiers (see promote). Returns the prefix's length."""
        with self._lock:
            self._placement.forget_lost_writes()
            now = self._clock()
            read: list[bytes] = []
            for key in keys:
                entry = self.index.get(key)
                if entry is None or entry.is_expired(now):
                    break
                self._placement.record_hit(entry, entry.fastest_tier(), now)
                read.append(key)
            self._placement.touch_tail_first(read)
        return len(read)

    def prefetch(self, keys: Sequence[bytes]) -> int:
        """Promote the present prefix of `keys` from disk into host now; returns blocks promoted."""
        return self._promote(keys, hot=False)

    def promote(self, keys: Sequence[bytes]) -> int:
        """The promotions a read earns, for reads made elsewhere (after touch()): the present prefix's
        disk-only blocks into host, and frequent hits per policy (gpu, selective disk, remote).
        Returns blocks promoted into host."""
        return self._promote(keys, hot=True)

    def _promote(self, keys: Sequence[bytes], *, hot: bool) -> int:
        promoted = 0
        placement = self._placement
        with self._lock, placement.snapshot_reads():
            placement.forget_lost_writes()
            now = self._clock()
            for key in keys:
                entry = self.index.get(key)
                if entry is None or entry.is_expired(now):
                    break
                block, name = None, entry.fastest_tier()
                try:
                    if name == "disk":
                        block = placement.read(entry, "disk")
                        if not placement.promote(entry, "host", block):
                            break
                        promoted += 1
                    if hot:
                        placement.promote_hot(entry, name, block)
                except (CorruptBlock, NotFound):
                    break
        return promoted

    # ---- writes ------------------------------------------------------------------------------

    def put(self, block: Block, *, ttl_s: float | None = None, pin: bool = False) -> PutResult:
        """Store a block in host (and disk per write_policy). A present key keeps its bytes: only its
        pin and TTL are applied (see Placement.refresh_ttl).
        Raises InvalidArgument for a malformed block, CapacityExceeded when no room can be made."""
        return self.put_many([block], ttl_s=ttl_s, pin=pin)[0]

    def put_many(self, blocks: Sequence[Block], *, ttl_s: float | None = None, pin: bool = False,
                 verified: bool = False) -> list[PutResult]:
        """Put a chain of blocks; each is validated before anything is stored. `verified`: the caller
        has just checked every payload against its checksum (the daemon's Put decodes each record)."""
        for block in blocks:
            self._validate(block, verified)
        results: list[PutResult] = []
        protect = {b.meta.key for b in blocks}
        ttl = self.cfg.store.default_ttl_s if ttl_s is None else ttl_s
        if ttl < 0:
            raise InvalidArgument(f"ttl_s must be >= 0, got {ttl}")
        with self._lock:
            self._placement.forget_lost_writes()
            now = self._clock()
            for block in blocks:
                results.append(self._put_one(block, ttl, pin, protect, now))
            self._placement.touch_tail_first([b.meta.key for b in blocks])
        if self.remote is not None and self.cfg.remote.write_policy == "all":
            self.remote.put_many([b for b, r in zip(blocks, results) if r is PutResult.STORED])
        return results

    def _put_one(self, block: Block, ttl: float, pin: bool, protect: set[bytes], now: float,
                 counted: bool = True) -> PutResult:
        placement = self._placement
        entry = self.index.get(block.meta.key)
        if entry is not None and not entry.is_expired(now):
            placement.put_again(entry, ttl, pin, now)
            return PutResult.ALREADY_PRESENT
        if entry is not None:
            placement.drop(block.meta.key)
        entry = placement.add(block, protect, now, ttl_s=ttl, pinned=pin)
        placement.write_through(entry, block, protect)
        self.counters["puts"] += counted
        return PutResult.STORED

    def _pull_remote(self, keys: Sequence[bytes], wanted: Sequence[int], tenant: str, *, holes: bool) -> list[int]:
        """Promote into host the blocks of `keys[i]` for i in `wanted` (ascending) the remote tier
        holds (asked and read outside the store's lock: they wait on the network); returns the
        indices promoted. Without `holes` only the longest run from wanted[0] on: a block absent,
        vanished between the question and the read, failing verification, or finding no room in
        host ends it. With `holes`, such a block ends only its own run of consecutive keys. Not
        written back to the remote tier: they came from there."""
        assert self.remote is not None
        if not wanted:
            return []
        held = self.remote.present([keys[i] for i in wanted], tenant)
        runs: list[list[int]] = []  # consecutive indices the cluster holds, each run read in order
        for i, present in zip(wanted, held):
            if not present:
                if not holes:
                    break
                continue
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                if runs and not holes:
                    break
                runs.append([i])
        pulled: list[int] = []
        step = self.cfg.remote.batch_blocks
        for run in runs:
            for start in range(0, len(run), step):
                batch = run[start : start + step]
                blocks = self.remote.get_many([keys[i] for i in batch], tenant)
                stored = 0
                with self._lock:
                    now = self._clock()
                    protect = set(keys[: batch[0] + len(blocks)])
                    for block in blocks:
                        try:
                            self._put_one(block, self.cfg.store.default_ttl_s, False, protect, now, counted=False)
                        except CapacityExceeded as e:
                            logger.debug("remote block not promoted: %s", e)
                            break
                        stored += 1
                pulled += batch[:stored]
                if stored < len(batch):
                    break
            if not holes and (not pulled or pulled[-1] != run[-1]):
                break
        with self._lock:
            self.counters["remote_blocks_pulled"] += len(pulled)
        return pulled

    # ---- puts in place (store_reserved.py) ----------------------------------------------------------

    def reserve(self, metas: Sequence[BlockMeta], *, tenant: str = "", lease_s: float | None = None
                ) -> Reservation:
        """ReservedPuts.reserve: host pages a same-host caller writes each new block of `metas` into."""
        return self._reserved.reserve(metas, tenant=tenant, lease_s=lease_s)

    def commit(self, rid: int, *, tenant: str = "", ttl_s: float | None = None, pin: bool = False,
               durable: bool = False, timeout_s: float | None = None) -> list[PutResult]:
        """ReservedPuts.commit: the reserved blocks stored as written, with a put's TTL, pin and write
        policies; `durable`: then written to disk and committed (as persist(), within timeout_s).
        InvalidArgument for a negative TTL; NotFound for an unknown or lapsed reservation."""
        ttl = self.cfg.store.default_ttl_s if ttl_s is None else ttl_s
        if ttl < 0:
            raise InvalidArgument(f"ttl_s must be >= 0, got {ttl}")
        results, copies, keys = self._reserved.commit(rid, tenant=tenant, ttl_s=ttl, pin=pin)
        if copies and self.remote is not None:
            self.remote.put_many(copies)
        if durable:
            self._upkeep.persist(keys, timeout_s)
        return results

    def release(self, rid: int, *, tenant: str = "") -> int:
        """ReservedPuts.release: reservation `rid`'s room given back unused; pages freed."""
        return self._reserved.release(rid, tenant=tenant)

    def pin(self, keys: Sequence[bytes], ttl_s: float | None = None) -> int:
        """Pin present blocks so no tier evicts them (for ttl_s seconds, or until unpinned)."""
        with self._lock:
            until = math.inf if not ttl_s else self._clock() + ttl_s
            return self._set_pin(keys, until)

    def unpin(self, keys: Sequence[bytes]) -> int:
        """Release the pins of present blocks; returns how many were pinned (a lapsed pin is none)."""
        with self._lock:
            now = self._clock()
            return self._set_pin([key for key in keys if (entry := self.index.get(key)) is not None
                                  and entry.is_pinned(now)], 0.0)

    def _set_pin(self, keys: Sequence[bytes], until: float) -> int:
        entries = [entry for entry in map(self.index.get, keys) if entry is not None]
        for entry in entries:
            self._placement.set_pin(entry, until)
        return len(entries)

    def remove(self, keys: Sequence[bytes]) -> int:
        """Delete blocks from every tier (an explicit Evict, pins notwithstanding); returns how many."""
        with self._lock:
            return sum(self._placement.drop(key) for key in keys)

    # ---- upkeep and admin (store_upkeep.py) -------------------------------------------------------

    def flush(self, *, tier: str | None = None, namespace: bytes | None = None, tenant: str | None = None) -> int:
        """StoreUpkeep.flush."""
        return self._upkeep.flush(tier=tier, namespace=namespace, tenant=tenant)

    def expire(self) -> int:
        """StoreUpkeep.expire (blocks past their TTL; returns how many), and reservations past their lease."""
        self._reserved.lapse()
        return self._upkeep.expire()

    def verify(self, *, tenant: str | None = None, keys: Sequence[bytes] | None = None) -> VerifyReport:
        """StoreUpkeep.verify."""
        return self._upkeep.verify(tenant=tenant, keys=keys)

    def entries(self, *, namespace: bytes | None = None, tenant: str | None = None) -> list[EntryInfo]:
        """StoreUpkeep.entries."""
        return self._upkeep.entries(namespace=namespace, tenant=tenant)

    def persist(self, keys: Sequence[bytes], timeout_s: float | None = None) -> None:
        """StoreUpkeep.persist."""
        self._upkeep.persist(keys, timeout_s)

    def flush_writes(self, timeout_s: float | None = None) -> None:
        """StoreUpkeep.flush_writes."""
        self._upkeep.flush_writes(timeout_s)

    def save_host_blocks(self, timeout_s: float | None = None) -> int:
        """StoreUpkeep.save_host_blocks."""
        return self._upkeep.save_host_blocks(timeout_s)

    def start_scrub(self, busy: Callable[[], bool]) -> None:
        """Start the disk tier's background scrub (store_scrub.Scrubber; the daemon calls this): it reads
        only while `busy()` is false, drops what fails through verify(), keeps its position in
        <data_dir>/scrub.json. No-op without a disk tier, at disk.scrub_bytes_per_s 0, or when started."""
        if self.disk is None or not self.cfg.disk.scrub_bytes_per_s or self._scrubber is not None:
            return
        self._scrubber = Scrubber(self.cfg.disk, self.disk, lambda keys: self._upkeep.verify(keys=keys),
                                  os.path.join(self.cfg.data_dir, "scrub.json"), self._clock)
        self._scrubber.start(busy)

    def stop_scrub(self) -> None:
        """Stop the background scrub after its current batch, its position kept. Idempotent."""
        if self._scrubber is not None:
            self._scrubber.stop()

    def scrub_progress(self) -> ScrubProgress | None:
        """The background scrub's figures; None when it was not started."""
        return self._scrubber.progress() if self._scrubber is not None else None

    def check_integrity(self) -> None:
        """StoreUpkeep.check_integrity, and the reservations'."""
        self._upkeep.check_integrity()
        with self._lock:
            self._reserved.reservations.check_integrity()

    # ---- introspection -------------------------------------------------------------------------

    def remote_census(self) -> Census | None:
        """The remote tier's blocks and bytes, estimated (tiers/remote_census.py); None without one."""
        return self.remote.census() if self.remote is not None else None

    def remote_counters(self) -> dict[str, int]:
        """The remote tier's counters (hits, misses, bytes read and written, errors, queue); empty without one."""
        return self.remote.remote_counters() if self.remote is not None else {}

    def snapshot_counters(self) -> dict[str, int]:
        """A consistent copy of `counters` (taken under the lock, so related counters agree)."""
        with self._lock:
            return dict(self.counters)

    def tier_stats(self) -> list[TierStats]:
        with self._lock:
            return [self._placement.tier(name).stats() for name in TIER_ORDER if name in self._placement.names]

    def tenant_bytes(self, tenant: str) -> int:
        """Payload bytes the tenant's blocks take, and the room it holds reserved (quotas count both)."""
        with self._lock:
            self._placement.forget_lost_writes()
            reserved = self._reserved.reservations.bytes_by_tenant.get(tenant, 0)
            return self.index.bytes_by_tenant.get(tenant, 0) + reserved

    def close(self) -> None:
        """Stop the scrub, finish queued disk writes and release every tier. Idempotent."""
        self.stop_scrub()  # not under the lock: its last batch may be waiting for it
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._upkeep.close()

    # ---- internals -------------------------------------------------------------------------------

    def _validate(self, block: Block, verified: bool = False) -> None:
        meta, payload = block.meta, block.payload
        if payload.dtype != torch.uint8 or payload.dim() != 1 or not payload.is_contiguous():
            raise InvalidArgument("payload must be a contiguous 1-D uint8 tensor")
        if payload.numel() != meta.nbytes:
            raise InvalidArgument(f"payload has {payload.numel()} bytes, meta says nbytes={meta.nbytes}")
        if meta.nbytes > self.cfg.store.max_block_bytes:
            raise InvalidArgument(f"block of {meta.nbytes} bytes exceeds store.max_block_bytes="
                                  f"{self.cfg.store.max_block_bytes}")
        if not verified and checksum(payload) != meta.checksum:
            raise CorruptBlock(f"block {meta.key.hex()[:16]} payload does not match its checksum")
