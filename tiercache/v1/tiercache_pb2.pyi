from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_GPU: _ClassVar[Tier]
    TIER_HOST: _ClassVar[Tier]
    TIER_DISK: _ClassVar[Tier]
    TIER_REMOTE: _ClassVar[Tier]

class PutResult(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PUT_RESULT_UNSPECIFIED: _ClassVar[PutResult]
    PUT_RESULT_STORED: _ClassVar[PutResult]
    PUT_RESULT_ALREADY_PRESENT: _ClassVar[PutResult]
TIER_UNSPECIFIED: Tier
TIER_GPU: Tier
TIER_HOST: Tier
TIER_DISK: Tier
TIER_REMOTE: Tier
PUT_RESULT_UNSPECIFIED: PutResult
PUT_RESULT_STORED: PutResult
PUT_RESULT_ALREADY_PRESENT: PutResult

class BlockMeta(_message.Message):
    __slots__ = ("key", "namespace", "num_tokens", "dtype", "shape", "nbytes", "checksum", "parent", "preview")
    KEY_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    PREVIEW_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    namespace: bytes
    num_tokens: int
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    nbytes: int
    checksum: int
    parent: bytes
    preview: str
    def __init__(self, key: _Optional[bytes] = ..., namespace: _Optional[bytes] = ..., num_tokens: _Optional[int] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., nbytes: _Optional[int] = ..., checksum: _Optional[int] = ..., parent: _Optional[bytes] = ..., preview: _Optional[str] = ...) -> None: ...

class NamespaceInfo(_message.Message):
    __slots__ = ("digest", "model", "weights", "dtype", "num_layers", "num_kv_heads", "head_dim", "block_tokens", "adapter", "salt_digest")
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    SALT_DIGEST_FIELD_NUMBER: _ClassVar[int]
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
    def __init__(self, digest: _Optional[bytes] = ..., model: _Optional[str] = ..., weights: _Optional[str] = ..., dtype: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., block_tokens: _Optional[int] = ..., adapter: _Optional[str] = ..., salt_digest: _Optional[str] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("keys", "probe", "holes")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PROBE_FIELD_NUMBER: _ClassVar[int]
    HOLES_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    probe: bool
    holes: bool
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., probe: _Optional[bool] = ..., holes: _Optional[bool] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("tiers",)
    TIERS_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedScalarFieldContainer[Tier]
    def __init__(self, tiers: _Optional[_Iterable[_Union[Tier, str]]] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("keys", "shared_memory", "store_keys")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    STORE_KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    shared_memory: bool
    store_keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., shared_memory: _Optional[bool] = ..., store_keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class SlabInfo(_message.Message):
    __slots__ = ("path", "page_bytes", "header_bytes", "num_pages", "index_path", "disk_path", "staging_dir", "remote")
    PATH_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    HEADER_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    INDEX_PATH_FIELD_NUMBER: _ClassVar[int]
    DISK_PATH_FIELD_NUMBER: _ClassVar[int]
    STAGING_DIR_FIELD_NUMBER: _ClassVar[int]
    REMOTE_FIELD_NUMBER: _ClassVar[int]
    path: str
    page_bytes: int
    header_bytes: int
    num_pages: int
    index_path: str
    disk_path: str
    staging_dir: str
    remote: bool
    def __init__(self, path: _Optional[str] = ..., page_bytes: _Optional[int] = ..., header_bytes: _Optional[int] = ..., num_pages: _Optional[int] = ..., index_path: _Optional[str] = ..., disk_path: _Optional[str] = ..., staging_dir: _Optional[str] = ..., remote: _Optional[bool] = ...) -> None: ...

class StagedPayload(_message.Message):
    __slots__ = ("file", "offset")
    FILE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    file: str
    offset: int
    def __init__(self, file: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class SlabBlock(_message.Message):
    __slots__ = ("meta", "pages", "generations")
    META_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    meta: BlockMeta
    pages: _containers.RepeatedScalarFieldContainer[int]
    generations: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, meta: _Optional[_Union[BlockMeta, _Mapping]] = ..., pages: _Optional[_Iterable[int]] = ..., generations: _Optional[_Iterable[int]] = ...) -> None: ...

class FetchedBlock(_message.Message):
    __slots__ = ("index", "record", "slab_block", "pad")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    RECORD_FIELD_NUMBER: _ClassVar[int]
    SLAB_BLOCK_FIELD_NUMBER: _ClassVar[int]
    PAD_FIELD_NUMBER: _ClassVar[int]
    index: int
    record: bytes
    slab_block: SlabBlock
    pad: bytes
    def __init__(self, index: _Optional[int] = ..., record: _Optional[bytes] = ..., slab_block: _Optional[_Union[SlabBlock, _Mapping]] = ..., pad: _Optional[bytes] = ...) -> None: ...

class FetchResponse(_message.Message):
    __slots__ = ("slab", "blocks")
    SLAB_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    slab: SlabInfo
    blocks: _containers.RepeatedCompositeFieldContainer[FetchedBlock]
    def __init__(self, slab: _Optional[_Union[SlabInfo, _Mapping]] = ..., blocks: _Optional[_Iterable[_Union[FetchedBlock, _Mapping]]] = ...) -> None: ...

class PutRequest(_message.Message):
    __slots__ = ("record", "ttl_s", "pin", "preview", "last", "namespace", "import_tenant", "durable", "staged")
    RECORD_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    PREVIEW_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    IMPORT_TENANT_FIELD_NUMBER: _ClassVar[int]
    DURABLE_FIELD_NUMBER: _ClassVar[int]
    STAGED_FIELD_NUMBER: _ClassVar[int]
    record: bytes
    ttl_s: float
    pin: bool
    preview: str
    last: bool
    namespace: NamespaceInfo
    import_tenant: str
    durable: bool
    staged: StagedPayload
    def __init__(self, record: _Optional[bytes] = ..., ttl_s: _Optional[float] = ..., pin: _Optional[bool] = ..., preview: _Optional[str] = ..., last: _Optional[bool] = ..., namespace: _Optional[_Union[NamespaceInfo, _Mapping]] = ..., import_tenant: _Optional[str] = ..., durable: _Optional[bool] = ..., staged: _Optional[_Union[StagedPayload, _Mapping]] = ...) -> None: ...

class PutBatchRequest(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[PutRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[PutRequest, _Mapping]]] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedScalarFieldContainer[PutResult]
    def __init__(self, results: _Optional[_Iterable[_Union[PutResult, str]]] = ...) -> None: ...

class PrefetchRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PrefetchResponse(_message.Message):
    __slots__ = ("num_promoted",)
    NUM_PROMOTED_FIELD_NUMBER: _ClassVar[int]
    num_promoted: int
    def __init__(self, num_promoted: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("tier", "capacity_bytes", "tenant_blocks", "tenant_bytes", "used_bytes", "num_blocks", "hits", "misses", "puts", "evictions", "verification_failures", "promotions", "lookup_hits")
    TIER_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    TENANT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TENANT_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    PUTS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    VERIFICATION_FAILURES_FIELD_NUMBER: _ClassVar[int]
    PROMOTIONS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_HITS_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
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
    promotions: int
    lookup_hits: int
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ..., capacity_bytes: _Optional[int] = ..., tenant_blocks: _Optional[int] = ..., tenant_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., num_blocks: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., puts: _Optional[int] = ..., evictions: _Optional[int] = ..., verification_failures: _Optional[int] = ..., promotions: _Optional[int] = ..., lookup_hits: _Optional[int] = ...) -> None: ...

class TenantUsage(_message.Message):
    __slots__ = ("tenant", "num_blocks", "bytes")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    num_blocks: int
    bytes: int
    def __init__(self, tenant: _Optional[str] = ..., num_blocks: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("tenant", "tiers", "tenant_bytes", "tenant_quota_bytes", "version", "tenants", "lookups", "lookup_misses", "verification_failures", "tokens_reused", "tokens_computed", "requests_reported", "remote", "scrub")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    TENANT_BYTES_FIELD_NUMBER: _ClassVar[int]
    TENANT_QUOTA_BYTES_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_MISSES_FIELD_NUMBER: _ClassVar[int]
    VERIFICATION_FAILURES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_REUSED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_REPORTED_FIELD_NUMBER: _ClassVar[int]
    REMOTE_FIELD_NUMBER: _ClassVar[int]
    SCRUB_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    tenant_bytes: int
    tenant_quota_bytes: int
    version: str
    tenants: _containers.RepeatedCompositeFieldContainer[TenantUsage]
    lookups: int
    lookup_misses: int
    verification_failures: int
    tokens_reused: int
    tokens_computed: int
    requests_reported: int
    remote: RemoteStats
    scrub: ScrubStats
    def __init__(self, tenant: _Optional[str] = ..., tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., tenant_bytes: _Optional[int] = ..., tenant_quota_bytes: _Optional[int] = ..., version: _Optional[str] = ..., tenants: _Optional[_Iterable[_Union[TenantUsage, _Mapping]]] = ..., lookups: _Optional[int] = ..., lookup_misses: _Optional[int] = ..., verification_failures: _Optional[int] = ..., tokens_reused: _Optional[int] = ..., tokens_computed: _Optional[int] = ..., requests_reported: _Optional[int] = ..., remote: _Optional[_Union[RemoteStats, _Mapping]] = ..., scrub: _Optional[_Union[ScrubStats, _Mapping]] = ...) -> None: ...

class ScrubStats(_message.Message):
    __slots__ = ("bytes_per_s", "bytes_scrubbed", "blocks_scrubbed", "damaged_blocks", "passes", "pass_fraction", "last_pass_unix_s", "next_pass_unix_s", "paused", "paused_s")
    BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    BYTES_SCRUBBED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_SCRUBBED_FIELD_NUMBER: _ClassVar[int]
    DAMAGED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PASSES_FIELD_NUMBER: _ClassVar[int]
    PASS_FRACTION_FIELD_NUMBER: _ClassVar[int]
    LAST_PASS_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    NEXT_PASS_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    PAUSED_S_FIELD_NUMBER: _ClassVar[int]
    bytes_per_s: int
    bytes_scrubbed: int
    blocks_scrubbed: int
    damaged_blocks: int
    passes: int
    pass_fraction: float
    last_pass_unix_s: float
    next_pass_unix_s: float
    paused: bool
    paused_s: float
    def __init__(self, bytes_per_s: _Optional[int] = ..., bytes_scrubbed: _Optional[int] = ..., blocks_scrubbed: _Optional[int] = ..., damaged_blocks: _Optional[int] = ..., passes: _Optional[int] = ..., pass_fraction: _Optional[float] = ..., last_pass_unix_s: _Optional[float] = ..., next_pass_unix_s: _Optional[float] = ..., paused: _Optional[bool] = ..., paused_s: _Optional[float] = ...) -> None: ...

class RemoteStats(_message.Message):
    __slots__ = ("bytes_read", "bytes_written", "blocks_pulled", "errors", "write_errors", "writes_dropped", "queue_blocks", "cluster_blocks", "cluster_bytes", "census_samples", "census_failed_primaries")
    BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_PULLED_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    WRITE_ERRORS_FIELD_NUMBER: _ClassVar[int]
    WRITES_DROPPED_FIELD_NUMBER: _ClassVar[int]
    QUEUE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_BYTES_FIELD_NUMBER: _ClassVar[int]
    CENSUS_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    CENSUS_FAILED_PRIMARIES_FIELD_NUMBER: _ClassVar[int]
    bytes_read: int
    bytes_written: int
    blocks_pulled: int
    errors: int
    write_errors: int
    writes_dropped: int
    queue_blocks: int
    cluster_blocks: int
    cluster_bytes: int
    census_samples: int
    census_failed_primaries: int
    def __init__(self, bytes_read: _Optional[int] = ..., bytes_written: _Optional[int] = ..., blocks_pulled: _Optional[int] = ..., errors: _Optional[int] = ..., write_errors: _Optional[int] = ..., writes_dropped: _Optional[int] = ..., queue_blocks: _Optional[int] = ..., cluster_blocks: _Optional[int] = ..., cluster_bytes: _Optional[int] = ..., census_samples: _Optional[int] = ..., census_failed_primaries: _Optional[int] = ...) -> None: ...

class ListRequest(_message.Message):
    __slots__ = ("namespace", "limit")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    limit: int
    def __init__(self, namespace: _Optional[bytes] = ..., limit: _Optional[int] = ...) -> None: ...

class Entry(_message.Message):
    __slots__ = ("store_key", "parent_store_key", "namespace", "num_tokens", "dtype", "shape", "nbytes", "tiers", "hits", "last_access_unix_s", "pinned", "expires_unix_s", "preview", "pin_expires_unix_s")
    STORE_KEY_FIELD_NUMBER: _ClassVar[int]
    PARENT_STORE_KEY_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    LAST_ACCESS_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    PREVIEW_FIELD_NUMBER: _ClassVar[int]
    PIN_EXPIRES_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    store_key: bytes
    parent_store_key: bytes
    namespace: bytes
    num_tokens: int
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    nbytes: int
    tiers: _containers.RepeatedScalarFieldContainer[Tier]
    hits: int
    last_access_unix_s: float
    pinned: bool
    expires_unix_s: float
    preview: str
    pin_expires_unix_s: float
    def __init__(self, store_key: _Optional[bytes] = ..., parent_store_key: _Optional[bytes] = ..., namespace: _Optional[bytes] = ..., num_tokens: _Optional[int] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., nbytes: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[Tier, str]]] = ..., hits: _Optional[int] = ..., last_access_unix_s: _Optional[float] = ..., pinned: _Optional[bool] = ..., expires_unix_s: _Optional[float] = ..., preview: _Optional[str] = ..., pin_expires_unix_s: _Optional[float] = ...) -> None: ...

class ListResponse(_message.Message):
    __slots__ = ("entries", "num_total", "namespaces")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[Entry]
    num_total: int
    namespaces: _containers.RepeatedCompositeFieldContainer[NamespaceInfo]
    def __init__(self, entries: _Optional[_Iterable[_Union[Entry, _Mapping]]] = ..., num_total: _Optional[int] = ..., namespaces: _Optional[_Iterable[_Union[NamespaceInfo, _Mapping]]] = ...) -> None: ...

class FlushRequest(_message.Message):
    __slots__ = ("tier", "namespace", "tenant")
    TIER_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    namespace: bytes
    tenant: str
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ..., namespace: _Optional[bytes] = ..., tenant: _Optional[str] = ...) -> None: ...

class FlushResponse(_message.Message):
    __slots__ = ("num_removed",)
    NUM_REMOVED_FIELD_NUMBER: _ClassVar[int]
    num_removed: int
    def __init__(self, num_removed: _Optional[int] = ...) -> None: ...

class EvictRequest(_message.Message):
    __slots__ = ("keys", "store_keys")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    STORE_KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    store_keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., store_keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class EvictResponse(_message.Message):
    __slots__ = ("num_evicted",)
    NUM_EVICTED_FIELD_NUMBER: _ClassVar[int]
    num_evicted: int
    def __init__(self, num_evicted: _Optional[int] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("keys", "store_keys", "ttl_s")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    STORE_KEYS_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    store_keys: _containers.RepeatedScalarFieldContainer[bytes]
    ttl_s: float
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., store_keys: _Optional[_Iterable[bytes]] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class PinResponse(_message.Message):
    __slots__ = ("num_pinned",)
    NUM_PINNED_FIELD_NUMBER: _ClassVar[int]
    num_pinned: int
    def __init__(self, num_pinned: _Optional[int] = ...) -> None: ...

class UnpinRequest(_message.Message):
    __slots__ = ("keys", "store_keys")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    STORE_KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    store_keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., store_keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class UnpinResponse(_message.Message):
    __slots__ = ("num_unpinned",)
    NUM_UNPINNED_FIELD_NUMBER: _ClassVar[int]
    num_unpinned: int
    def __init__(self, num_unpinned: _Optional[int] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("store_keys",)
    STORE_KEYS_FIELD_NUMBER: _ClassVar[int]
    store_keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, store_keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("num_checked", "num_failed", "dropped_store_keys", "integrity_ok", "integrity_error")
    NUM_CHECKED_FIELD_NUMBER: _ClassVar[int]
    NUM_FAILED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_STORE_KEYS_FIELD_NUMBER: _ClassVar[int]
    INTEGRITY_OK_FIELD_NUMBER: _ClassVar[int]
    INTEGRITY_ERROR_FIELD_NUMBER: _ClassVar[int]
    num_checked: int
    num_failed: int
    dropped_store_keys: _containers.RepeatedScalarFieldContainer[bytes]
    integrity_ok: bool
    integrity_error: str
    def __init__(self, num_checked: _Optional[int] = ..., num_failed: _Optional[int] = ..., dropped_store_keys: _Optional[_Iterable[bytes]] = ..., integrity_ok: _Optional[bool] = ..., integrity_error: _Optional[str] = ...) -> None: ...

class ReportRequest(_message.Message):
    __slots__ = ("prompt_tokens", "cached_tokens", "computed_tokens", "ttft_s", "prefill_s")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    ttft_s: float
    prefill_s: float
    def __init__(self, prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., computed_tokens: _Optional[int] = ..., ttft_s: _Optional[float] = ..., prefill_s: _Optional[float] = ...) -> None: ...

class ReportResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TouchRequest(_message.Message):
    __slots__ = ("keys", "lookup_calls", "lookup_blocks", "lookup_misses", "lookup_disk_blocks", "reports")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_CALLS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_MISSES_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_DISK_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REPORTS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    lookup_calls: int
    lookup_blocks: int
    lookup_misses: int
    lookup_disk_blocks: int
    reports: _containers.RepeatedCompositeFieldContainer[ReportRequest]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., lookup_calls: _Optional[int] = ..., lookup_blocks: _Optional[int] = ..., lookup_misses: _Optional[int] = ..., lookup_disk_blocks: _Optional[int] = ..., reports: _Optional[_Iterable[_Union[ReportRequest, _Mapping]]] = ...) -> None: ...

class TouchResponse(_message.Message):
    __slots__ = ("num_touched", "num_reported")
    NUM_TOUCHED_FIELD_NUMBER: _ClassVar[int]
    NUM_REPORTED_FIELD_NUMBER: _ClassVar[int]
    num_touched: int
    num_reported: int
    def __init__(self, num_touched: _Optional[int] = ..., num_reported: _Optional[int] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("blocks", "lease_s", "namespace")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    blocks: _containers.RepeatedCompositeFieldContainer[BlockMeta]
    lease_s: float
    namespace: NamespaceInfo
    def __init__(self, blocks: _Optional[_Iterable[_Union[BlockMeta, _Mapping]]] = ..., lease_s: _Optional[float] = ..., namespace: _Optional[_Union[NamespaceInfo, _Mapping]] = ...) -> None: ...

class ReservedPages(_message.Message):
    __slots__ = ("pages",)
    PAGES_FIELD_NUMBER: _ClassVar[int]
    pages: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, pages: _Optional[_Iterable[int]] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("slab", "reservation", "blocks", "lease_s")
    SLAB_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    slab: SlabInfo
    reservation: int
    blocks: _containers.RepeatedCompositeFieldContainer[ReservedPages]
    lease_s: float
    def __init__(self, slab: _Optional[_Union[SlabInfo, _Mapping]] = ..., reservation: _Optional[int] = ..., blocks: _Optional[_Iterable[_Union[ReservedPages, _Mapping]]] = ..., lease_s: _Optional[float] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("reservation", "ttl_s", "pin", "durable")
    RESERVATION_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    DURABLE_FIELD_NUMBER: _ClassVar[int]
    reservation: int
    ttl_s: float
    pin: bool
    durable: bool
    def __init__(self, reservation: _Optional[int] = ..., ttl_s: _Optional[float] = ..., pin: _Optional[bool] = ..., durable: _Optional[bool] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("reservation",)
    RESERVATION_FIELD_NUMBER: _ClassVar[int]
    reservation: int
    def __init__(self, reservation: _Optional[int] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("num_pages",)
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    num_pages: int
    def __init__(self, num_pages: _Optional[int] = ...) -> None: ...
