"""The block vocabulary every layer speaks: a block's metadata and the one table of its fields (from
which every encoding of a meta is derived), the block itself, the tiers' names and counters, and
what a put did."""

from __future__ import annotations

import enum
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, TypeVar

import torch

from tiercache.errors import InvalidArgument
from tiercache.keys import KEY_BYTES

Message = TypeVar("Message")


@dataclass(frozen=True)
class BlockMeta:
    """What the store knows about one block besides its bytes.

    `key` is the store's key (already scoped to the tenant by the server), `namespace` the 32-byte
    namespace digest, `checksum` the XXH3-64 of the raw (uncompressed) payload bytes, `nbytes` their
    count. `parent` is the key of the previous block in the chain (b"" for the first block).
    A field is added here and in META_FIELDS below (same order), and nowhere else.
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

    def to_dict(self) -> dict[str, Any]:
        """The meta as JSON values: its form in a record header and in a disk meta record."""
        return {name: to_json(getattr(self, name)) for name, to_json in zip(_NAMES, _TO_JSON)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> BlockMeta:
        """The meta of to_dict's form. A field with a default may be absent (older versions wrote
        fewer); a malformed one raises KeyError, TypeError, ValueError or InvalidArgument."""
        try:  # every field there, as this version writes them: one positional call, the fastest
            return cls(*map(operator.call, _FROM_JSON, map(d.__getitem__, _NAMES)))
        except KeyError:
            return cls(**{name: from_json(d[name]) for name, from_json in zip(_NAMES, _FROM_JSON) if name in d})

    def to_wire(self, message: Callable[..., Message]) -> Message:
        """The proto's BlockMeta of this meta: pass the generated class (tiercache.v1's BlockMeta),
        which the core may not import. Fields off the wire (tenant) are left out."""
        return message(**{wire: getattr(self, name) for name, wire, _ in _WIRE})

    @classmethod
    def from_wire(cls, message: object) -> BlockMeta:
        """The meta of a proto BlockMeta (validated: it comes from another process); fields off the
        wire take their defaults."""
        return cls(**{name: from_wire(getattr(message, wire)) for name, wire, from_wire in _WIRE})

    @classmethod
    def checked_already(cls, key: bytes, namespace: bytes, num_tokens: int, dtype: str, shape: tuple[int, ...],
                        nbytes: int, checksum: int, parent: bytes, preview: str = "") -> BlockMeta:
        """A client's meta (the fields on the wire, in the table's order, tenant "") from fields that
        cannot fail __post_init__'s checks (32-byte keys, unsigned counts: a verified record's meta
        under other 32-byte keys), made without them: a quarter of the cost, which counts when a
        worker's read of a chain makes a meta per block. Written out rather than through the table,
        which cost 15 % more (tests/test_block_fields.py checks that it makes every field)."""
        meta = object.__new__(cls)
        meta.__dict__.update(key=key, namespace=namespace, num_tokens=num_tokens, dtype=dtype, shape=shape,
                             nbytes=nbytes, checksum=checksum, parent=parent, tenant="", preview=preview)
        return meta

    def with_checksum(self, checksum: int) -> BlockMeta:
        """This meta with another checksum (a block hashed where it lies); a copy of its fields, not
        dataclasses.replace, which checks them all again (a fifth of a commit's time per block)."""
        meta = object.__new__(type(self))
        meta.__dict__.update(self.__dict__, checksum=checksum)
        return meta

    def scoped(self, key: bytes, parent: bytes, tenant: str) -> BlockMeta:
        """This (checked) meta under a tenant's store keys (tiercache/tenancy.py), its checksum 0: what
        a Reserve asks room for. 32-byte keys, as scoping makes them, need no check again."""
        if len(key) != KEY_BYTES or (parent and len(parent) != KEY_BYTES):
            raise InvalidArgument(f"store keys must be {KEY_BYTES} bytes")
        meta = object.__new__(type(self))
        meta.__dict__.update(self.__dict__, key=key, parent=parent, tenant=tenant, checksum=0)
        return meta

    @classmethod
    def checked_already_columns(cls, columns: Mapping[str, Sequence[Any]]) -> list[BlockMeta]:
        """checked_already for many metas, given field by field: `columns` maps fields to their values
        (as many metas as the shortest has values); a field it lacks takes its default. Filled column
        by column, which costs less than a call per meta (a slot reader makes them so)."""
        new = object.__new__
        metas = [new(cls) for _ in range(min(map(len, columns.values())))]
        states = [meta.__dict__ for meta in metas]
        for name in _NAMES:
            values = columns.get(name)
            if values is None:
                default = DEFAULTS[name]  # KeyError: a field without a default must be given
                for state in states:
                    state[name] = default
            else:
                for state, value in zip(states, values):
                    state[name] = value
        return metas


class Kind(enum.Enum):
    """The type of a meta field, which fixes its form in each encoding: every encoder maps every kind
    (an encoder missing one fails at import)."""

    KEY = "32 bytes; JSON: 64 hex digits"
    LINK = "b'' or 32 bytes; JSON: '' or 64 hex digits"
    COUNT = "an int >= 0; JSON: a number"
    DTYPE = "a name of layout.DTYPES; JSON: a string"
    DIMS = "a tuple of ints; JSON: a list of numbers"
    TEXT = "a str; JSON: a string"


SlotType = str | tuple[str, int]  # a numpy type in a shared-index slot, or (type, count) for an array of them


@dataclass(frozen=True)
class MetaField:
    """One field of BlockMeta and its form in each encoding of a meta.

    The record header and the disk meta record carry every field as JSON under its name (`kind`
    fixes the form); a slot of the shared index (samehost/index.py) keeps the fields with a `slot`
    type, and a meta read from a slot takes those with `from_slot` from it, the others from the
    reader or their defaults; the proto's BlockMeta carries the fields with a `wire` name. `why`
    says why an encoding leaves a field out or takes it from elsewhere."""

    name: str
    kind: Kind
    slot: SlotType | None
    from_slot: bool
    wire: str | None
    why: str = ""


META_FIELDS: tuple[MetaField, ...] = (
    MetaField("key", Kind.KEY, ("u1", 32), False, "key",
              "a slot keeps the store key (readers find the slot by it); a meta read from it takes the reader's "
              "client key"),
    MetaField("namespace", Kind.KEY, ("u1", 32), True, "namespace"),
    MetaField("num_tokens", Kind.COUNT, "<u4", True, "num_tokens"),
    MetaField("dtype", Kind.DTYPE, "<u4", True, "dtype", "a slot keeps its code (samehost/index.py DTYPE_CODES)"),
    MetaField("shape", Kind.DIMS, ("<u4", 5), True, "shape"),
    MetaField("nbytes", Kind.COUNT, "<u8", True, "nbytes"),
    MetaField("checksum", Kind.COUNT, "<u8", True, "checksum"),
    MetaField("parent", Kind.LINK, ("u1", 32), False, "parent",
              "a slot keeps the parent's store key; a meta read from it takes the reader's client key of the parent"),
    MetaField("tenant", Kind.TEXT, None, False, None,
              "the store's scope of a block: the server clears it in every meta a caller sees (client_meta), so "
              "neither the wire nor a slot (read by same-host callers) carries it"),
    MetaField("preview", Kind.TEXT, None, False, "preview",
              "a hint of any length, which a slot's fixed room cannot keep: a meta read from a slot has none"),
)

# The table lists BlockMeta's fields, in the dataclass's order (which is their order in a record header).
assert tuple(f.name for f in META_FIELDS) == tuple(f.name for f in fields(BlockMeta)), "META_FIELDS != BlockMeta"
_NAMES = tuple(f.name for f in META_FIELDS)
DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(BlockMeta) if f.default is not MISSING}


def _hex(value: bytes) -> str:
    return value.hex()


def _dims(value: Any) -> tuple[int, ...]:
    return tuple(map(int, value))


def _same(value: Any) -> Any:
    return value


# kind -> (value to JSON, JSON to value); the JSON parsers reject a wrong JSON type (bytes.fromhex
# takes only a str) as they did when from_dict was written field by field.
_JSON_FORMS: dict[Kind, tuple[Callable[[Any], Any], Callable[[Any], Any]]] = {
    Kind.KEY: (_hex, bytes.fromhex), Kind.LINK: (_hex, bytes.fromhex), Kind.COUNT: (_same, int),
    Kind.DTYPE: (_same, str), Kind.DIMS: (list, _dims), Kind.TEXT: (_same, str),
}
_TO_JSON = tuple(_JSON_FORMS[f.kind][0] for f in META_FIELDS)
_FROM_JSON = tuple(_JSON_FORMS[f.kind][1] for f in META_FIELDS)
# The proto's forms: a repeated field reads back as a container, the rest as they are.
_FROM_WIRE: dict[Kind, Callable[[Any], Any]] = {Kind.KEY: _same, Kind.LINK: _same, Kind.COUNT: _same,
                                                Kind.DTYPE: _same, Kind.DIMS: tuple, Kind.TEXT: _same}
_WIRE = tuple((f.name, f.wire, _FROM_WIRE[f.kind]) for f in META_FIELDS if f.wire is not None)


TIER_ORDER = ("gpu", "host", "disk")  # the indexed tiers, fastest first


class PutResult(enum.Enum):
    """What a put did with one block."""

    STORED = "stored"
    ALREADY_PRESENT = "already_present"  # the key was there: its bytes kept, only its pin and TTL applied


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
