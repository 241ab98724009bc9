"""An order-sensitive 64-bit checksum of a block's bytes computed with torch ops where the bytes lie (the gpu tier's).

`layout.checksum` (XXH3-64) is the checksum of record: on disk, on the wire, in the slab. It runs on the
CPU, so checking a block in device memory with it means copying the block to the host first. This one
is written in torch tensor ops, so it runs on the tensor's own device and only its 16-byte result
crosses to the host; the same code runs on CPU tensors, which is how the tests cover it.

The function, on a byte string of length n read as u32 words w_0 .. w_{W-1} in native (little-endian)
byte order, the last one zero-padded, is two lanes with their own constants, each the exact integer
sum over positions i of a per-position bijective mix of w_i:

    k_i = (i * PHI + OFFSET) mod 2**32            a Weyl sequence: PHI is odd, so no two positions
                                                  below 2**32 share a key
    x   = ((w_i XOR k_i) * (k_i >> 1 | 1)) mod 2**32   a per-position (odd) multiplier
    x  ^= x >> 16;  x = x * MUL mod 2**32;  x ^= x >> 15
    lane = sum of x over i

and the result is (lane_0 mod 2**32) << 32 | (lane_1 mod 2**32), XOR a mix of n.

Properties, and their limits:
- A change confined to one u32 word (any single bit flip, any damaged byte) always changes the result:
  for a fixed position every step is a bijection of x, and |change of one term| < 2**32, so the
  exact sum changes modulo 2**32 in both lanes.
- A change of the length always changes it: n is mixed in, since the lanes alone cannot tell trailing
  zero bytes from the zero padding.
- Changes to several words (swapped 4 KiB pages, swapped adjacent words, compensating flips such as +1
  in one word and -1 in another, a stale page) depend on the position: they go unseen only if both
  lanes' sums coincide by chance, which for such damage is about 2**-64 if the mixed terms behave as
  random. That is an estimate, not a proof; tests check the patterns above.
- It is not a defence against an adversary: the constants are public and every step is invertible,
  so colliding inputs are easy to construct. Keys are cryptographic; this is for memory, paging and
  copy errors, as XXH3 is for the other tiers. The two are different functions: a block's
  meta.checksum is never compared with this one.
- Every step stays below 2**63 in int64 (u32 values times multipliers below 2**31, positions below
  2**31), so nothing relies on signed overflow: the value is the same on every device and build.
  Blocks are limited to 8 GiB (2**31 words).
- Cost: eighteen elementwise torch ops over int64 tensors of [2 lanes, words], chunk by chunk (bounded
  scratch memory), then one 16-byte copy to the host, which waits for the device. On a CPU that is
  50 to 100 times slower than XXH3 (scripts/bench_device_checksum.py): it is meant for the device, and
  runs on CPU tensors for the tests and for a gpu tier on a CPU pool.
"""

from __future__ import annotations

import torch

from tiercache.page_pool import payload_bytes

MASK32 = 0xFFFF_FFFF
MAX_WORDS = 2**31  # positions (below this) times PHI, plus OFFSET, stay below 2**63
# Words mixed per pass, by where they lie. The int64 scratch of a chunk is about 40 bytes a word. On a
# GPU a 2 MiB block is one chunk (20 MiB of scratch), so each op is one kernel launch per block; on a CPU
# chunks of 2**14 to 2**17 words ran about twice as fast as 2**19 (scratch that stays in cache, and
# below the sizes malloc hands out as fresh pages to be faulted in).
DEVICE_CHUNK_WORDS = 1 << 19
CPU_CHUNK_WORDS = 1 << 15
# Per lane: the Weyl increment and offset of the position keys, and the odd multiplier of the second
# round (below 2**31 so that a u32 times it fits in int64). Golden-ratio, pi and hash-prospector constants.
_PHI = (0x9E3779B9, 0x7F4A7C15)
_OFFSET = (0x243F6A88, 0x85A308D3)
_MUL = (0x7FEB352D, 0x31848BAB)


def _fmix64(value: int) -> int:
    """SplitMix64's finalizer, on Python ints: folds the length into the result."""
    value = (value ^ (value >> 30)) * 0xBF58476D1CE4E5B9 & 0xFFFF_FFFF_FFFF_FFFF
    value = (value ^ (value >> 27)) * 0x94D049BB133111EB & 0xFFFF_FFFF_FFFF_FFFF
    return value ^ (value >> 31)


class _Lanes:
    """The per-lane constants as [2, 1] int64 tensors on one device, broadcast against [1, words]."""

    def __init__(self, device: torch.device) -> None:
        def column(values: tuple[int, int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device).view(2, 1)

        self.phi, self.offset, self.mul = column(_PHI), column(_OFFSET), column(_MUL)


def _mix_sum(words: torch.Tensor, first: int, lanes: _Lanes, sums: torch.Tensor) -> None:
    """Add to `sums` ([2] int64) the mixed terms of `words` (u32 values in int64), the first at position `first`."""
    positions = torch.arange(first, first + words.numel(), dtype=torch.int64, device=words.device).view(1, -1)
    keys = positions.mul(lanes.phi).add_(lanes.offset).bitwise_and_(MASK32)  # [2, words]
    del positions  # scratch is bounded per chunk: free what is done with
    x = torch.bitwise_xor(words.view(1, -1), keys)
    x.mul_(keys.bitwise_right_shift_(1).bitwise_or_(1)).bitwise_and_(MASK32)  # keys, reused as the multipliers
    shifted = keys  # and then as the scratch of the shifts
    x.bitwise_xor_(torch.bitwise_right_shift(x, 16, out=shifted))
    x.mul_(lanes.mul).bitwise_and_(MASK32)
    x.bitwise_xor_(torch.bitwise_right_shift(x, 15, out=shifted))
    sums.add_(x.sum(dim=1))


def device_checksum(data: torch.Tensor) -> int:
    """The checksum (see the module docstring) of the bytes of `data` in memory order, computed on
    data's device; a value in [0, 2**64). Raises ValueError for more than 8 GiB."""
    flat = payload_bytes(data)
    nbytes = flat.numel()
    num_full = nbytes // 4
    if -(-nbytes // 4) > MAX_WORDS:
        raise ValueError(f"device_checksum covers up to {4 * MAX_WORDS} bytes, got {nbytes}")
    if flat.storage_offset() % 4:
        flat = flat.clone()  # a view that starts mid-word cannot be read as words in place
    lanes = _Lanes(flat.device)
    sums = torch.zeros(2, dtype=torch.int64, device=flat.device)
    words = flat[: 4 * num_full].view(torch.int32)
    step = CPU_CHUNK_WORDS if flat.device.type == "cpu" else DEVICE_CHUNK_WORDS
    for start in range(0, num_full, step):
        chunk = words[start : start + step].to(torch.int64).bitwise_and_(MASK32)
        _mix_sum(chunk, start, lanes, sums)
    if nbytes % 4:
        tail = torch.zeros(4, dtype=torch.uint8, device=flat.device)
        tail[: nbytes % 4] = flat[4 * num_full :]
        _mix_sum(tail.view(torch.int32).to(torch.int64).bitwise_and_(MASK32), num_full, lanes, sums)
    # The one transfer to the host: two int64 sums (a sync with the device).
    high, low = (value & MASK32 for value in sums.tolist())
    return (high << 32 | low) ^ _fmix64(nbytes)
