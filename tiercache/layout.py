"""The canonical block tensor layout [num_layers, 2, num_kv_heads, tokens, head_dim] and its checksum."""

from __future__ import annotations

import mmap
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, cast

import numpy as np
import torch
import xxhash

from tiercache.errors import InvalidArgument
from tiercache.keys import Namespace

# as_uint8 hands read-only buffers to torch, which warns (once) that it cannot mark a tensor read-only:
# every caller only reads or copies out of those tensors. Filtered here, for this module's calls
# only, instead of a catch_warnings per call (it cost more than checksumming a 64 KiB block).
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning,
                        module=__name__)

BytesLike = bytes | bytearray | memoryview | np.ndarray  # what XXH3 reads: a contiguous buffer


class Hasher(Protocol):
    """An incremental XXH3-64 (seed 0) of the bytes fed to update, in order."""

    def update(self, data: BytesLike, /) -> None: ...

    def intdigest(self) -> int: ...


# numpy's stubs give arrays the buffer protocol (__buffer__) only from Python 3.12, though they have it on every
# version (in C): xxhash is typed here, once, to take them, rather than with a cast or a memoryview per block.
xxh3_64_intdigest = cast(Callable[[BytesLike], int], xxhash.xxh3_64_intdigest)  # checksum() of a buffer
xxh3_64 = cast(Callable[[], Hasher], xxhash.xxh3_64)

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
CHECKSUM_ALG = "xxh3_64"


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype for a namespace dtype name; InvalidArgument for an unknown one."""
    try:
        return DTYPES[name]
    except KeyError:
        raise InvalidArgument(f"unknown dtype {name!r}; expected one of {', '.join(DTYPES)}") from None


@dataclass(frozen=True)
class BlockLayout:
    """Shape and size of the blocks of one namespace."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_tokens: int
    dtype: str

    @classmethod
    def of(cls, namespace: Namespace) -> BlockLayout:
        dtype_of(namespace.dtype)
        return cls(namespace.num_layers, namespace.num_kv_heads, namespace.head_dim,
                   namespace.block_tokens, namespace.dtype)

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_of(self.dtype)

    def shape(self, num_tokens: int | None = None) -> tuple[int, int, int, int, int]:
        tokens = self.block_tokens if num_tokens is None else num_tokens
        return (self.num_layers, 2, self.num_kv_heads, tokens, self.head_dim)

    def nbytes(self, num_tokens: int | None = None) -> int:
        n = 1
        for d in self.shape(num_tokens):
            n *= d
        return n * self.torch_dtype.itemsize


def checksum(data: BytesLike | torch.Tensor) -> int:
    """XXH3-64 (seed 0) of the bytes of `data`: every block's checksum, on disk, on the wire, in the slab.

    Every byte's position counts, so swapped pages, swapped words and compensating bit flips are all
    seen (lengths are checked separately); it runs faster than a memcpy of the same bytes. It is not
    a defence against an adversary: block keys are cryptographic, this is for media and paging errors.
    A tensor is read as its bytes in memory order; one on an accelerator is copied to the CPU first.
    """
    if isinstance(data, torch.Tensor):
        flat = data
        if flat.dtype != torch.uint8 or flat.dim() != 1 or not flat.is_contiguous():  # payloads already are
            flat = flat.contiguous().reshape(-1).view(torch.uint8)
        if flat.device.type != "cpu":
            flat = flat.cpu()
        return xxh3_64_intdigest(flat.detach().numpy())
    return xxh3_64_intdigest(data)


def legacy_sum64(data: bytes | bytearray | memoryview) -> int:
    """sum64, the checksum of records written before format v2: the wrapping sum of the little-endian
    u64 words of `data`, zero-padded to 8 bytes. Blind to order (two swapped pages sum the same), so
    it only verifies old records while they are upgraded (tiers/disk_upgrade.py); nothing new uses it."""
    words = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
    n = words.size
    head = n - n % 8
    total = int(words[:head].view(np.uint64).sum(dtype=np.uint64)) if head else 0
    if head != n:
        total += int.from_bytes(words[head:].tobytes() + bytes(8 - (n - head)), "little")
    return total & 0xFFFF_FFFF_FFFF_FFFF


def as_uint8(data: bytes | bytearray | memoryview | mmap.mmap) -> torch.Tensor:
    """A zero-copy 1-D uint8 tensor over a bytes-like object (the caller must not write to it)."""
    view = memoryview(data).cast("B")
    if not len(view):
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(view, dtype=torch.uint8)  # read-only is fine: see the filter above


def block_guidance(layout: BlockLayout, page_bytes: int) -> str:
    """One line on how the blocks of `layout` fit host/gpu pages of page_bytes and, when they waste
    room, which page size (a power of two from 4 KiB to 1 MiB) wastes least (logged by the worker
    at load; the README's configuration section explains it)."""
    size = layout.nbytes()

    def waste(page: int) -> int:
        return -(-size // page) * page - size

    best = min((1 << k for k in range(12, 21)), key=lambda page: (waste(page) / (size + waste(page) or 1), -page))
    advice = "fits exactly" if not waste(page_bytes) else (
        f"wastes {waste(page_bytes)} bytes a block ({100 * waste(page_bytes) / (size + waste(page_bytes)):.0f}%); "
        f"host.page_bytes = {best} wastes {100 * waste(best) / (size + waste(best)):.0f}%")
    return (f"KV block of {layout.block_tokens} tokens = {size} bytes ({layout.num_layers} layers x 2 x "
            f"{layout.num_kv_heads} KV heads x {layout.head_dim} x {layout.dtype}); on pages of {page_bytes} bytes "
            f"it takes {-(-size // page_bytes)}: {advice}")
