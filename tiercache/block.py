"""The block vocabulary every layer speaks: a block's metadata, the block itself, a tier's counters."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from tiercache.errors import InvalidArgument
from tiercache.keys import KEY_BYTES


@dataclass(frozen=True)
class BlockMeta:
    """What the store knows about one block besides its bytes.

    `key` is the store's key (already scoped to the tenant by the server), `namespace` the 32-byte
    namespace digest, `checksum` the XXH3-64 of the raw (uncompressed) payload bytes, `nbytes` their
    count. `parent` is the key of the previous block in the chain (b"" for the first block).
    """

    key: bytes
    namespace: bytes
    num_tokens: int
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    checksum: int
    parent: bytes = b""
    tenant: str = ""
    preview: str = ""

    def __post_init__(self) -> None:
        if len(self.key) != KEY_BYTES:
            raise InvalidArgument(f"block key must be {KEY_BYTES} bytes, got {len(self.key)}")
        if len(self.namespace) != KEY_BYTES:
            raise InvalidArgument(f"namespace digest must be {KEY_BYTES} bytes, got {len(self.namespace)}")
        if self.parent and len(self.parent) != KEY_BYTES:
            raise InvalidArgument(f"parent key must be empty or {KEY_BYTES} bytes, got {len(self.parent)}")
        if self.nbytes < 0 or self.num_tokens < 0:
            raise InvalidArgument(f"nbytes and num_tokens must be >= 0, got {self.nbytes}, {self.num_tokens}")

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(key=self.key.hex(), namespace=self.namespace.hex(), parent=self.parent.hex(), shape=list(self.shape))
        return d

    @classmethod
    def checked_already(cls, key: bytes, namespace: bytes, num_tokens: int, dtype: str, shape: tuple[int, ...],
                        nbytes: int, checksum: int, parent: bytes, preview: str = "") -> BlockMeta:
        """A meta from fields that cannot fail __post_init__'s checks (32-byte keys, unsigned counts:
        a slot of the shared index, a verified record's meta under other 32-byte keys), made without
        them: a quarter of the cost, which counts when a worker's read of a chain makes a meta per block."""
        meta = object.__new__(cls)
        meta.__dict__.update(key=key, namespace=namespace, num_tokens=num_tokens, dtype=dtype, shape=shape,
                             nbytes=nbytes, checksum=checksum, parent=parent, tenant="", preview=preview)
        return meta

    @classmethod
    def from_dict(cls, d: dict) -> BlockMeta:
        return cls(
            key=bytes.fromhex(d["key"]), namespace=bytes.fromhex(d["namespace"]), num_tokens=int(d["num_tokens"]),
            dtype=str(d["dtype"]), shape=tuple(int(x) for x in d["shape"]), nbytes=int(d["nbytes"]),
            checksum=int(d["checksum"]), parent=bytes.fromhex(d.get("parent", "")), tenant=str(d.get("tenant", "")),
            preview=str(d.get("preview", "")),
        )


@dataclass(frozen=True)
class Block:
    """A block's metadata and its raw payload: a contiguous 1-D uint8 tensor of meta.nbytes bytes."""

    meta: BlockMeta
    payload: torch.Tensor = field(repr=False)


@dataclass
class TierStats:
    """Counters of one tier; used_bytes is capacity in use (whole pages; disk: stored record bytes)."""

    name: str
    capacity_bytes: int
    used_bytes: int = 0
    num_blocks: int = 0
    hits: int = 0
    misses: int = 0
    puts: int = 0
    evictions: int = 0
    removals: int = 0
    verification_failures: int = 0
