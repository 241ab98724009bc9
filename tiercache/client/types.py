"""What the client's calls return: plain frozen records of the daemon's replies, and namespace descriptions."""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field

from tiercache.keys import KEY_BYTES, Namespace
from tiercache.v1 import tiercache_pb2 as pb


def salt_digest(salt: str) -> str:
    """What a namespace description says about a salt: hex BLAKE2b-256 of a tagged salt, "" for none.
    It reveals no more than the namespace digest (itself a hash over the salt) already does."""
    if not salt:
        return ""
    return hashlib.blake2b(b"tiercache.salt.v1\0" + salt.encode(), digest_size=KEY_BYTES).hexdigest()


@dataclass(frozen=True)
class NamespaceDescription:
    """A namespace as its workers describe it to the daemon: the key spec's fields, the salt as a digest."""

    digest: bytes
    model: str
    weights: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_tokens: int
    adapter: str
    salt_digest: str

    @classmethod
    def of(cls, ns: Namespace) -> NamespaceDescription:
        fields = {k: v for k, v in ns.to_dict().items() if k != "salt"}
        # By name, so that a field the namespace gains and this class lacks fails here; a dict of
        # them types its values as str | int, not each field's own type.
        return cls(digest=ns.digest(), salt_digest=salt_digest(ns.salt), **fields)  # type: ignore[arg-type]  # see above

    @classmethod
    def from_pb(cls, m: pb.NamespaceInfo) -> NamespaceDescription:
        return cls(m.digest, m.model, m.weights, m.dtype, m.num_layers, m.num_kv_heads, m.head_dim, m.block_tokens,
                   m.adapter, m.salt_digest)

    def to_pb(self) -> pb.NamespaceInfo:
        return pb.NamespaceInfo(**asdict(self))

    def fields(self) -> dict[str, str | int]:
        """The descriptive fields (everything but the digest)."""
        out = asdict(self)
        del out["digest"]
        return out


@dataclass(frozen=True)
class TierUsage:
    """One tier as Stats reports it; the aggregate counters are 0 unless the caller is tenant "local"."""

    tier: str
    capacity_bytes: int
    tenant_blocks: int
    tenant_bytes: int
    used_bytes: int
    num_blocks: int
    hits: int
    misses: int
    puts: int
    evictions: int
    verification_failures: int
    promotions: int = 0
    lookup_hits: int = 0


@dataclass(frozen=True)
class RemoteUsage:
    """The daemon's traffic with the remote tier (the cluster shared with other daemons), since start;
    its hits, misses, puts and verification failures are in the tier "remote" row of ServiceStats.tiers."""

    bytes_read: int
    bytes_written: int
    blocks_pulled: int
    errors: int
    write_errors: int
    writes_dropped: int
    queue_blocks: int
    cluster_blocks: int = 0  # blocks under the daemon's key prefix in the cluster, estimated (RemoteStats)
    cluster_bytes: int = 0
    census_samples: int = 0  # random keys the estimate drew
    census_failed_primaries: int = 0


@dataclass(frozen=True)
class ScrubUsage:
    """The daemon's background scrub of its disk tier (see ScrubStats in the proto); counters since start."""

    bytes_per_s: int
    bytes_scrubbed: int
    blocks_scrubbed: int
    damaged_blocks: int
    passes: int
    pass_fraction: float  # 0 to 1 of the current pass; 0 between passes
    last_pass_unix_s: float  # 0: never
    next_pass_unix_s: float  # 0 while a pass runs
    paused: bool
    paused_s: float


@dataclass(frozen=True)
class TenantUsage:
    tenant: str
    num_blocks: int
    bytes: int


@dataclass(frozen=True)
class ServiceStats:
    """Stats as the daemon reports them; everything after `version` is 0/empty unless the caller is
    tenant "local". lookups = sum(t.lookup_hits for t in tiers) + lookup_misses (see the proto)."""

    tenant: str
    tiers: list[TierUsage]
    tenant_bytes: int
    tenant_quota_bytes: int
    version: str
    tenants: list[TenantUsage] = field(default_factory=list)
    lookups: int = 0
    lookup_misses: int = 0
    verification_failures: int = 0
    tokens_reused: int = 0
    tokens_computed: int = 0
    requests_reported: int = 0
    remote: RemoteUsage | None = None  # None without a remote tier, or for a tenant other than "local"
    scrub: ScrubUsage | None = None  # None unless the disk scrub runs, or for a tenant other than "local"


@dataclass(frozen=True)
class ListedBlock:
    """One block as List shows it: keys are store keys (tenant-scoped), see the proto."""

    store_key: bytes
    parent_store_key: bytes
    namespace: bytes
    num_tokens: int
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    tiers: tuple[str, ...]
    hits: int
    last_access: float
    pinned: bool
    expires_at: float
    preview: str
    pin_expires_at: float = 0.0  # when the pin lapses; 0: until unpinned (or not pinned)


@dataclass(frozen=True)
class Listing:
    """A List reply: the blocks (most recently used first), how many matched before the limit, and the
    descriptions of the namespaces holding matching blocks."""

    entries: list[ListedBlock]
    num_total: int
    namespaces: list[NamespaceDescription]


@dataclass(frozen=True)
class VerifyResult:
    num_checked: int
    num_failed: int
    dropped_store_keys: list[bytes]
    integrity_ok: bool
    integrity_error: str
