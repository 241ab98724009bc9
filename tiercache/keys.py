"""Block keys: the normative, versioned chained-hash spec of DESIGN.md ("Block keys")."""

from __future__ import annotations

import hashlib
import json
import sys
from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from functools import cached_property

from tiercache.errors import InvalidArgument

KEY_BYTES = 32
_NS_TAG = b"tiercache.ns.v1\0"
_BLOCK_TAG = b"tiercache.block.v1\0"
_MAX_TOKEN = 2**32
_STR_FIELDS = ("model", "weights", "dtype", "adapter", "salt")
_INT_FIELDS = ("num_layers", "num_kv_heads", "head_dim", "block_tokens")
# array's typecode for a C unsigned int of 4 bytes (every platform torch runs on has one); packed
# ids are byte-swapped on a big-endian host so that the hashed bytes are u32le everywhere.
_U32 = next(code for code in "IL" if array(code).itemsize == 4)
_SWAP = sys.byteorder == "big"
# H's state after the block tag: each block's hash starts from a copy() of it, which costs less than
# a new blake2b (argument parsing, parameter block) plus hashing the tag again.
_BLOCK_PREFIX = hashlib.blake2b(_BLOCK_TAG, digest_size=KEY_BYTES)


def _h(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=KEY_BYTES).digest()


def canonical(obj: object) -> bytes:
    """The canonical JSON encoding that every implementation hashes."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


@dataclass(frozen=True)
class Namespace:
    """Everything that decides whether two workers' KV for the same tokens is interchangeable.

    Any change to any field changes every key: `weights` is a digest of the model's weights,
    `adapter` names a LoRA or other adapter, `salt` isolates users who must not share.
    """

    model: str
    weights: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_tokens: int
    adapter: str = ""
    salt: str = ""

    def __post_init__(self) -> None:
        for name in _STR_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, str):
                raise ValueError(f"namespace field {name!r} must be a str, got {type(value).__name__}: {value!r}")
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"namespace field {name!r} must be an int, got {type(value).__name__}: {value!r}")
            if value < 1:
                raise ValueError(f"namespace field {name!r} must be >= 1, got {value}")

    @classmethod
    def from_dict(cls, fields: Mapping[str, object]) -> Namespace:
        """Build from a mapping that has exactly the nine fields; raises ValueError naming any other."""
        expected = set(_STR_FIELDS) | set(_INT_FIELDS)
        missing = sorted(expected - set(fields))
        unknown = sorted(set(fields) - expected)
        if missing:
            raise ValueError(f"namespace is missing field(s): {', '.join(missing)}")
        if unknown:
            raise ValueError(f"namespace has unknown field(s): {', '.join(unknown)}")
        return cls(**fields)  # type: ignore[arg-type]  # values of any type: __post_init__ checks each one

    def to_dict(self) -> dict[str, str | int]:
        return asdict(self)

    def digest(self) -> bytes:
        """namespace_digest = H("tiercache.ns.v1\\0" + canonical(namespace)); also key_0 of every chain."""
        return self._digest

    @cached_property
    def _digest(self) -> bytes:
        # Once per namespace (it is frozen): asdict and the JSON encoding take about 25 us, a fifth of
        # what the keys of 2000 tokens take.
        return _h(_NS_TAG + canonical(self.to_dict()))


def _check_tokens(tokens: Sequence[int]) -> None:
    for position, token in enumerate(tokens):
        if isinstance(token, bool) or not isinstance(token, int):
            raise ValueError(f"token at position {position} is not an int: {token!r}")
        if not 0 <= token < _MAX_TOKEN:
            raise ValueError(f"token at position {position} is {token}, outside [0, 2**32)")


def _pack(tokens: Sequence[int]) -> bytes:
    """u32le(t) for t in tokens, in one C loop; ValueError naming the first bad token.

    array() range-checks every id (OverflowError below 0 or above 2**32-1) but also takes bools and
    any object with __index__ (numpy ints), which the spec's ids are not: a check that every type is
    exactly int rules those out first. Any failure reruns the per-token check, which names the position.
    """
    if list(map(type, tokens)).count(int) == len(tokens):  # count() compares by identity first: fast
        try:
            packed = array(_U32, tokens)
        except OverflowError:
            pass
        else:
            if _SWAP:
                packed.byteswap()
            return packed.tobytes()
    _check_tokens(tokens)
    raise AssertionError(f"_check_tokens passed tokens that array({_U32!r}) rejected: {tokens!r}")


def _chain(parent: bytes, packed: bytes, run_tokens: int) -> list[bytes]:
    """The keys chained onto `parent` by each run of `run_tokens` ids in `packed` (u32le ids), in order;
    a trailing partial run gets no key."""
    step = 4 * run_tokens
    length = run_tokens.to_bytes(4, "little")
    runs = [length + packed[start : start + step] for start in range(0, len(packed) - step + 1, step)]
    new = _BLOCK_PREFIX.copy
    keys: list[bytes] = []
    append = keys.append
    # The loop is most of the cost of a chain, so a block is five C calls on a copy of the pre-fed
    # prefix: a new blake2b per block (keyword parsing, the tag hashed again) took 1.7 times as long.
    h = new()
    h.update(parent)
    for run in runs:
        h.update(run)
        parent = h.digest()
        append(parent)
        h = new()
        h.update(parent)
    return keys


def chain_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """key_i = H("tiercache.block.v1\\0" + key_{i-1} + u32le(len(tokens_i)) + u32le(t) for t in tokens_i)."""
    if len(parent) != KEY_BYTES:
        raise ValueError(f"parent key must be {KEY_BYTES} bytes, got {len(parent)}")
    h = _BLOCK_PREFIX.copy()
    h.update(parent)
    h.update(len(tokens).to_bytes(4, "little"))
    h.update(_pack(tokens))
    return h.digest()


def block_keys(namespace: Namespace, tokens: Sequence[int]) -> list[bytes]:
    """Keys of every full block of `tokens`, in order; a trailing partial run gets no key."""
    return _chain(namespace.digest(), _pack(tokens), namespace.block_tokens)


def tail_keys(namespace: Namespace, tokens: Sequence[int], breakpoints: Iterable[int],
              full_keys: Sequence[bytes] | None = None) -> dict[int, bytes]:
    """One tail key per breakpoint that does not fall on a block boundary, keyed by the breakpoint.

    A breakpoint b (0 < b <= len(tokens)) says "cache up to token b"; its tail key chains the
    partial run tokens[b - b % block_tokens : b] onto the key of the last full block before it.
    """
    size = namespace.block_tokens
    keys = list(full_keys) if full_keys is not None else block_keys(namespace, tokens)
    tails: dict[int, bytes] = {}
    for point in breakpoints:
        if isinstance(point, bool) or not isinstance(point, int) or not 0 < point <= len(tokens):
            raise InvalidArgument(f"breakpoint {point!r} is outside (0, {len(tokens)}]")
        remainder = point % size
        if remainder == 0:
            continue
        full = point // size
        parent = keys[full - 1] if full else namespace.digest()
        tails[point] = chain_key(parent, tokens[point - remainder : point])
    return tails
