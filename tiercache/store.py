"""The TieredStore: index, write policies, pins, TTLs and verification over tiers that placement.py fills."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from tiercache.config import Config
from tiercache.errors import CapacityExceeded, CorruptBlock, InvalidArgument, NotFound
from tiercache.index import TIER_ORDER, Entry, Index
from tiercache.layout import checksum
from tiercache.placement import Placement
# Re-exported: callers import the store's result types from here.
from tiercache.store_types import EntryInfo, HostLocation, PutResult, VerifyReport
from tiercache.store_upkeep import StoreUpkeep
from tiercache.block import Block, TierStats
from tiercache.tiers.base import Tier

if TYPE_CHECKING:
    from tiercache.tiers.remote import RemoteTier

logger = logging.getLogger(__name__)

LOOKUP_HITS = {name: f"lookup_hits_{name}" for name in TIER_ORDER}  # counter names, made once


class TieredStore(StoreUpkeep):
    """Blocks across gpu / host / disk tiers under one lock, and optionally a remote tier shared
    with other machines' daemons (tiers/remote.py), which the index never lists.

    Policy: a put lands in host (and reaches disk per write_policy); a get reads the fastest tier,
    promotes disk hits to host and frequent host hits to gpu; a tier past its high watermark evicts
    least-recently-used unpinned blocks down to its low watermark, demoting each to the next tier
    when it is not there yet. Operations over a chain touch its keys tail first, so the head of a
    prefix is always more recently used than its tail and eviction takes tails first. With a
    remote tier, new blocks are queued for it (remote.write_policy), and a lookup that runs past the
    local tiers reads the rest of the prefix from it into host.
    """

    def __init__(self, cfg: Config, *, host: Tier, disk: Tier | None = None, gpu: Tier | None = None,
                 remote: RemoteTier | None = None, clock: Callable[[], float] = time.time) -> None:
        self.cfg = cfg
        self.host = host
        self.disk = disk
        self.gpu = gpu
        self.remote = remote
        self._tiers: dict[str, Tier] = {"host": host}
        if gpu is not None:
            self._tiers["gpu"] = gpu
        if disk is not None:
            self._tiers["disk"] = disk
        if remote is not None:
            self._tiers["remote"] = remote
            _every_key_maybe_present(host)
        self._clock = clock
        self._lock = threading.RLock()
        # The host tier's shared index keeps a presence filter of every key (samehost/index.py).
        self.index = Index(on_change=getattr(host, "note_presence", None))
        self.counters: Counter[str] = Counter()
        self._placement = Placement(cfg, self._tiers, self.index, self.counters, clock)
        self._closed = False
        if disk is not None:
            for meta, attrs in disk.records():  # type: ignore[attr-defined]
                entry = Entry(meta, {"disk"})
                entry.load_attrs(attrs)
                self.index.add(entry)
            logger.info("store opened: blocks_on_disk=%d", len(self.index))

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
                    raise InvalidArgument(f"remote.enabled needs the {e.name!r} package: pip install 'redis>=5' "
                                          "hiredis") from None
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

    def lookup(self, keys: Sequence[bytes], *, counted: bool = True, tenant: str = "") -> list[str]:
        """Tier name of each block of the longest present prefix of `keys`. Where the local tiers'
        prefix ends, a remote tier is asked for the rest under `tenant`'s key prefix there (the
        store keys' tenant; "" is BlockMeta.tenant's default): the blocks it holds are promoted into
        host and reported as host (see _pull_remote). Otherwise mutates nothing but the lookup counters
        (not even those when not `counted`: a probe, which asks the local tiers only; see
        LookupRequest.probe)."""
        now = self._clock()
        with self._lock:
            self._placement.forget_lost_writes()
            tiers = self.index.present_prefix(keys, now)
        if not counted:
            return tiers
        if self.remote is not None and len(tiers) < len(keys):
            pulled = self._pull_remote(keys[len(tiers):], tenant)
            tiers += ["host"] * pulled
        with self._lock:
            self.counters["lookups"] += 1
            self.counters["lookup_blocks_hit"] += len(tiers)
            for tier in set(tiers):
                self.counters[LOOKUP_HITS[tier]] += tiers.count(tier)
            self.counters["lookup_blocks_missed"] += len(keys) - len(tiers)
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

    def fetch(self, keys: Sequence[bytes]) -> Iterator[Block]:
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
            self._touch_tail_first(fetched)

    def locate_host(self, keys: Sequence[bytes]) -> list[HostLocation]:
        """Slab pages of each block of the longest present prefix, promoting disk hits into host."""
        out: list[HostLocation] = []
        with self._lock, self._disk_snapshot():
            self._placement.forget_lost_writes()
            now = self._clock()
            for key in keys:
                try:
                    entry = self._placement.live(key, now)
                    if "host" in entry.tiers:
                        try:
                            self._placement.host_hit(entry, now)
                        except CorruptBlock:  # read to be promoted, the host copy was damaged (now
                            if not entry.tiers:  # dropped and counted): another copy may remain
                                raise
                    if "host" not in entry.tiers:
                        block = self._placement.get(key, now)  # promotes into host when there is room
                        if "host" not in entry.tiers:  # a disk read may be a view of the snapshot: copied
                            out.append(HostLocation(entry.meta, (), (), Block(block.meta, block.payload.clone())))
                            continue
                except (NotFound, CorruptBlock):
                    break
                pages, generations = self.host.locate(key)  # type: ignore[attr-defined]
                out.append(HostLocation(entry.meta, tuple(pages), tuple(generations)))
            self._touch_tail_first([loc.meta.key for loc in out])
        return out

    def _disk_snapshot(self) -> contextlib.AbstractContextManager[None]:
        """The disk tier's snapshot_reads, for a chain of promotions (its reads are views until the
        block exits: only promoted, or copied, never kept)."""
        return self.disk.snapshot_reads() if self.disk is not None else contextlib.nullcontext()  # type: ignore[attr-defined]

    def prefetch(self, keys: Sequence[bytes]) -> int:
        """Promote the present prefix of `keys` from disk into host now; returns blocks promoted."""
        promoted = 0
        with self._lock, self._disk_snapshot():
            self._placement.forget_lost_writes()
            now = self._clock()
            for key in keys:
                entry = self.index.get(key)
                if entry is None or entry.is_expired(now):
                    break
                if "host" in entry.tiers or "gpu" in entry.tiers:
                    continue
                try:
                    block = self._placement.read(entry, "disk")
                    self._placement.place("host", block, protect={key})
                except (CorruptBlock, NotFound):
                    break
                except CapacityExceeded:
                    break
                entry.tiers.add("host")
                self.counters["promotions_to_host"] += 1
                promoted += 1
        return promoted

    # ---- writes ------------------------------------------------------------------------------

    def put(self, block: Block, *, ttl_s: float | None = None, pin: bool = False) -> PutResult:
        """Store a block in host (and disk per write_policy). A present key keeps its bytes: only its
        pin and TTL are applied (see _refresh_ttl).
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
            self._touch_tail_first([b.meta.key for b in blocks])
        if self.remote is not None and self.cfg.remote.write_policy == "all":
            self.remote.put_many([b for b, r in zip(blocks, results) if r is PutResult.STORED])
        return results

    def _pull_remote(self, keys: Sequence[bytes], tenant: str) -> int:
        """Promote into host the blocks of the longest prefix of `keys` the remote tier holds (asked
        and read outside the store's lock: they wait on the network); returns how many. A block
        that vanished between the question and the read, failed verification, or finds no room in
        host ends the prefix there."""
        assert self.remote is not None
        present = self.remote.present_prefix(keys, tenant)
        pulled = 0
        step = self.cfg.remote.batch_blocks
        for start in range(0, present, step):
            blocks = self.remote.get_many(keys[start : min(present, start + step)], tenant)
            with self._lock:
                now = self._clock()
                protect = set(keys[:start + len(blocks)])
                for block in blocks:
                    if not self._adopt(block, protect, now):
                        break
                    pulled += 1
            if pulled < start + step:
                break
        with self._lock:
            self.counters["remote_blocks_pulled"] += pulled
        return pulled

    def _adopt(self, block: Block, protect: set[bytes], now: float) -> bool:
        """A block read from the remote tier, into host (and disk per its write policy); False when
        there is no room. Not written back to the remote tier: it came from there."""
        try:
            self._put_one(block, self.cfg.store.default_ttl_s, False, protect, now, counted=False)
        except CapacityExceeded as e:
            logger.debug("remote block not promoted: %s", e)
            return False
        return True

    def flush(self, *, tier: str | None = None, namespace: bytes | None = None, tenant: str | None = None) -> int:
        """As StoreUpkeep.flush; tier "remote" deletes `tenant`'s keys under this daemon's
        remote.key_prefix (every tenant's when None), whichever daemon wrote them. Not by namespace:
        a remote key names its tenant but not its namespace, which only a read of every value tells."""
        if tier == "remote" and self.remote is not None:
            if namespace is not None:
                raise InvalidArgument("the remote tier cannot be flushed by namespace (its keys name the tenant, "
                                      "not the namespace): flush the tenant's whole remote tier, or other tiers")
            removed = self.remote.clear(tenant)
            logger.info("flush: tier=remote tenant=%s keys=%d", tenant, removed)
            return removed
        return super().flush(tier=tier, namespace=namespace, tenant=tenant)

    def flush_writes(self, timeout_s: float | None = None) -> None:
        """Wait until every queued disk write is committed and every queued remote write sent."""
        super().flush_writes(timeout_s)
        if self.remote is not None:
            self.remote.flush(timeout_s)

    def remote_counters(self) -> dict[str, int]:
        """The remote tier's counters (hits, misses, bytes read and written, errors, queue); empty without one."""
        return self.remote.remote_counters() if self.remote is not None else {}

    def pin(self, keys: Sequence[bytes], ttl_s: float | None = None) -> int:
        """Pin present blocks so no tier evicts them (for ttl_s seconds, or until unpinned)."""
        with self._lock:
            now = self._clock()
            until = math.inf if not ttl_s else now + ttl_s
            return self._set_pin(keys, until)

    def unpin(self, keys: Sequence[bytes]) -> int:
        """Release the pins of present blocks; returns how many were pinned (a lapsed pin is none)."""
        with self._lock:
            now = self._clock()
            return self._set_pin([key for key in keys if (entry := self.index.get(key)) is not None
                                  and entry.is_pinned(now)], 0.0)

    def remove(self, keys: Sequence[bytes]) -> int:
        """Delete blocks from every tier (an explicit Evict, pins notwithstanding); returns how many."""
        with self._lock:
            return sum(self._placement.drop(key) for key in keys)

    # ---- introspection -------------------------------------------------------------------------

    def snapshot_counters(self) -> dict[str, int]:
        """A consistent copy of `counters` (taken under the lock, so related counters agree)."""
        with self._lock:
            return dict(self.counters)

    def tier_stats(self) -> list[TierStats]:
        with self._lock:
            return [self._tiers[name].stats() for name in TIER_ORDER if name in self._tiers]

    def tenant_bytes(self, tenant: str) -> int:
        with self._lock:
            self._placement.forget_lost_writes()
            return self.index.bytes_by_tenant.get(tenant, 0)

    def close(self) -> None:
        """Finish queued disk writes and release every tier. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._placement.forget_lost_writes()
            if self.disk is not None:
                for entry in self.index.values():
                    if "disk" in entry.tiers and entry.hits:
                        self.disk.set_attrs(entry.meta.key, entry.attrs())  # type: ignore[attr-defined]
            for tier in self._tiers.values():
                tier.close()

    # ---- internals (lock held) ---------------------------------------------------------------

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

    def _put_one(self, block: Block, ttl: float, pin: bool, protect: set[bytes], now: float,
                 counted: bool = True) -> PutResult:
        key = block.meta.key
        entry = self.index.get(key)
        if entry is not None and not entry.is_expired(now):
            if pin:
                self._set_pin([key], math.inf)
            self._refresh_ttl(entry, ttl, now)
            return PutResult.ALREADY_PRESENT
        if entry is not None:
            self._placement.drop(key)
        self._placement.place("host", block, protect)
        entry = Entry(block.meta, {"host"}, last_access=now, ttl_s=ttl, expires_at=now + ttl if ttl else 0.0,
                      pinned_until=math.inf if pin else 0.0)
        self.index.add(entry)
        if self.disk is not None and self.cfg.disk.write_policy == "write_through":
            try:
                self._placement.place("disk", block, protect, attrs=entry.attrs())
                entry.tiers.add("disk")
            except CapacityExceeded as e:
                # The block stays cached in host; losing write-through for it beats failing the put.
                # The message, not the exception: a handler that keeps records (a test's log capture, a
                # queue) would otherwise keep the traceback's frames and with them the caller's gRPC call.
                logger.warning("write_through skipped: %s", str(e))
                self.counters["disk_write_skipped"] += 1
        self.counters["puts"] += counted
        return PutResult.STORED

    def _refresh_ttl(self, entry: Entry, ttl: float, now: float) -> None:
        """A present block put again: its TTL restarts as on a hit, and the longer of its TTL and
        `ttl` is kept (0, none, the longest): a shared cache keeps a block as long as any caller asked."""
        if not entry.ttl_s:
            return
        entry.ttl_s = max(entry.ttl_s, ttl) if ttl else 0.0
        entry.expires_at = now + entry.ttl_s if entry.ttl_s else 0.0
        if self.disk is not None and "disk" in entry.tiers:
            self.disk.set_attrs(entry.meta.key, entry.attrs())  # type: ignore[attr-defined]

    def _touch_tail_first(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            by_tier: dict[str, list[bytes]] = {}
            for key in reversed(keys):
                entry = self.index.get(key)
                if entry is not None:
                    for name in entry.tiers:
                        by_tier.setdefault(name, []).append(key)
            for name, touched in by_tier.items():  # one call per tier: the disk tier checks and locks once
                self._tiers[name].touch_many(touched)

    def _set_pin(self, keys: Sequence[bytes], until: float) -> int:
        count = 0
        for key in keys:
            entry = self.index.get(key)
            if entry is None:
                continue
            entry.pinned_until = until
            count += 1
            if self.disk is not None and "disk" in entry.tiers:
                self.disk.set_attrs(key, entry.attrs())  # type: ignore[attr-defined]
        return count


def _every_key_maybe_present(host: Tier) -> None:
    """Saturate the host tier's presence filter (samehost/index.py), so that same-host clients ask
    this daemon about every key their own read of the index misses: only the daemon can ask the
    remote tier. Saturated counters never come down again, which is what we need here."""
    index = getattr(host, "_index", None)
    presence = getattr(index, "_presence", None)
    if presence is not None:
        presence[:] = 255
