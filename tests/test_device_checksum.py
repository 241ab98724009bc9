"""device_checksum: the documented formula, the damage it must see (on CPU tensors, the same code as on a
GPU), its edges; and scripts/gpu_check.sh, which runs the CUDA-only checks where a GPU is at hand."""

from __future__ import annotations

import os
import pathlib
import subprocess

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tiercache.device_checksum as dc
from tiercache.device_checksum import device_checksum

REPO = pathlib.Path(__file__).resolve().parent.parent
PAGE = 4096
M32, M64 = 2**32 - 1, 2**64 - 1


def random_bytes(nbytes: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)


def reference(data: bytes) -> int:
    """The module docstring's formula on Python ints, word by word: the oracle of the tensor code."""
    padded = data + bytes(-len(data) % 4)
    lanes = []
    for phi, offset, mul in zip(dc._PHI, dc._OFFSET, dc._MUL):
        total = 0
        for i in range(len(padded) // 4):
            w = int.from_bytes(padded[4 * i : 4 * i + 4], "little")
            k = (i * phi + offset) & M32
            x = ((w ^ k) * (k >> 1 | 1)) & M32
            x ^= x >> 16
            x = (x * mul) & M32
            x ^= x >> 15
            total += x
        lanes.append(total & M32)
    n = len(data)
    n = ((n ^ (n >> 30)) * 0xBF58476D1CE4E5B9) & M64
    n = ((n ^ (n >> 27)) * 0x94D049BB133111EB) & M64
    return (lanes[0] << 32 | lanes[1]) ^ n ^ (n >> 31)


def swapped(data: torch.Tensor, a: int, b: int, size: int) -> torch.Tensor:
    """A copy of data with the `size`-byte stretches at a and b exchanged."""
    out = data.clone()
    out[a : a + size], out[b : b + size] = data[b : b + size], data[a : a + size]
    return out


@pytest.mark.parametrize("nbytes", [0, 1, 3, 4, 5, 7, 8, 9, 63, 64, 65, 4099])
def test_matches_the_documented_formula(nbytes: int) -> None:
    data = random_bytes(nbytes, seed=nbytes)
    assert device_checksum(data) == reference(bytes(data.numpy()))


def test_chunks_do_not_change_the_value(monkeypatch: pytest.MonkeyPatch) -> None:
    data = random_bytes(3 * PAGE + 6)
    whole = device_checksum(data)
    monkeypatch.setattr(dc, "CPU_CHUNK_WORDS", 7)  # many chunks, none aligned to a page, a tail word after
    assert device_checksum(data) == whole


def test_any_view_of_the_same_bytes_gives_the_same_value() -> None:
    data = random_bytes(2 * PAGE + 8)
    value = device_checksum(data[1:])  # starts mid-word: read through an aligned copy
    assert value == device_checksum(data[1:].clone())
    as_floats = data[: 2 * PAGE].view(torch.float32).view(8, 256)  # a payload's dtype and shape: its bytes count
    assert device_checksum(as_floats) == device_checksum(data[: 2 * PAGE].clone())
    strided = data[: 2 * PAGE].view(2, PAGE)[:, :100]  # not contiguous: its elements in order
    assert device_checksum(strided) == device_checksum(strided.contiguous())
    assert 0 <= value <= M64


def test_swapped_4k_pages_change_it() -> None:
    data = random_bytes(16 * PAGE)
    value = device_checksum(data)
    for a, b in [(0, 1), (0, 15), (3, 4), (7, 12)]:
        assert device_checksum(swapped(data, a * PAGE, b * PAGE, PAGE)) != value, (a, b)
    pages = data.view(16, PAGE)
    assert device_checksum(pages.flip(0).contiguous()) != value  # every page in reverse order


def test_a_stale_page_changes_it() -> None:
    # A page the copy never reached still holds an older block's bytes.
    data, older = random_bytes(8 * PAGE, seed=1), random_bytes(8 * PAGE, seed=2)
    value = device_checksum(data)
    for page in range(8):
        damaged = data.clone()
        damaged[page * PAGE : (page + 1) * PAGE] = older[page * PAGE : (page + 1) * PAGE]
        assert device_checksum(damaged) != value, page


@pytest.mark.parametrize("word", [4, 8])
def test_swapped_adjacent_words_change_it(word: int) -> None:
    data = random_bytes(PAGE + 12)
    value = device_checksum(data)
    for start in range(0, data.numel() - 2 * word + 1, 37 * word):
        assert device_checksum(swapped(data, start, start + word, word)) != value, start


@pytest.mark.parametrize("word, delta", [(4, 1), (8, 1), (4, 2**31), (4, 12345), (8, 2**40)])
def test_compensating_changes_change_it(word: int, delta: int) -> None:
    """+delta in one little-endian word and -delta in another keep a plain sum of words: not this."""
    data = random_bytes(4 * PAGE)
    value = device_checksum(data)
    raw = bytearray(data.numpy().tobytes())
    bits = 8 * word
    for i, j in [(0, 1), (0, 511), (17, 300), (100, 101)]:
        damaged = bytearray(raw)
        for index, sign in ((i, 1), (j, -1)):
            at = index * word
            old = int.from_bytes(damaged[at : at + word], "little")
            damaged[at : at + word] = ((old + sign * delta) % 2**bits).to_bytes(word, "little")
        assert device_checksum(torch.frombuffer(damaged, dtype=torch.uint8)) != value, (i, j)


def test_the_same_bit_flipped_in_two_words_changes_it() -> None:
    data = random_bytes(2 * PAGE)
    value = device_checksum(data)
    for bit in range(32):
        damaged = data.clone()
        for word in (3, 700):
            damaged[4 * word + bit // 8] ^= 1 << bit % 8
        assert device_checksum(damaged) != value, bit


def test_every_single_bit_flip_of_a_small_block_changes_it() -> None:
    data = random_bytes(37)
    value = device_checksum(data)
    for at in range(37):
        for bit in range(8):
            damaged = data.clone()
            damaged[at] ^= 1 << bit
            assert device_checksum(damaged) != value, (at, bit)


@settings(max_examples=150, deadline=None)
@given(nbytes=st.integers(1, 3 * PAGE + 7), seed=st.integers(0, 2**16), data=st.data())
def test_a_flipped_bit_anywhere_changes_it(nbytes: int, seed: int, data: st.DataObject) -> None:
    """Guaranteed, not probable: a change within one word always changes both lanes (module docstring)."""
    block = random_bytes(nbytes, seed)
    at = data.draw(st.integers(0, nbytes - 1))
    bit = data.draw(st.integers(0, 7))
    damaged = block.clone()
    damaged[at] ^= 1 << bit
    assert device_checksum(damaged) != device_checksum(block)


def test_lengths_not_a_multiple_of_the_word_and_zero_padding_differ() -> None:
    zeros = torch.zeros(17, dtype=torch.uint8)
    values = [device_checksum(zeros[:n]) for n in range(18)]  # 0..17 zero bytes: padding alike, lengths not
    assert len(set(values)) == 18
    data = random_bytes(4099)
    for n in (4093, 4094, 4095, 4097, 4098):  # the last word partial: every tail byte counts
        damaged = data[:n].clone()
        damaged[-1] ^= 0x80
        assert device_checksum(damaged) != device_checksum(data[:n])


def test_empty_has_a_value_and_is_no_other_length() -> None:
    empty = device_checksum(torch.empty(0, dtype=torch.uint8))
    assert empty == reference(b"") and 0 <= empty <= M64
    assert empty != device_checksum(torch.zeros(1, dtype=torch.uint8))


def test_more_than_8_gib_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dc, "MAX_WORDS", 4)  # what 2**31 words are to a real block
    assert device_checksum(random_bytes(16)) == reference(bytes(random_bytes(16).numpy()))
    with pytest.raises(ValueError, match="up to 16 bytes, got 17"):
        device_checksum(random_bytes(17))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("nbytes", [0, 5, PAGE, 1179648 + 3, 2 * 2**20])
def test_cuda_gives_the_cpu_value(nbytes: int) -> None:
    data = random_bytes(nbytes, seed=nbytes)
    on_device = data.cuda()
    assert device_checksum(on_device) == device_checksum(data)
    if nbytes > 1:
        assert device_checksum(on_device[1:]) == device_checksum(data[1:])


# ---- scripts/gpu_check.sh --------------------------------------------------------------------------


def test_gpu_check_says_no_gpu_and_succeeds_without_one() -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: gpu_check.sh would run the CUDA checks, which this test does not")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh")], cwd=REPO, env=env, check=False,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "no GPU"


def test_gpu_check_runs_every_cuda_marked_test_and_the_gpu_bench_rows() -> None:
    script = (REPO / "scripts" / "gpu_check.sh").read_text()
    assert "pytest" in script and "-m cuda" in script
    assert "scripts/bench_store.py" in script  # its gpu row runs on the device when there is one
    assert "scripts/bench_device_checksum.py" in script
    assert os.access(REPO / "scripts" / "gpu_check.sh", os.X_OK)
