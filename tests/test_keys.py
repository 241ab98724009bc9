"""Block keys reproduce the normative conformance vectors and reject bad input."""

from __future__ import annotations

import hashlib
import json
import pathlib
import struct
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiercache.keys import Namespace, block_keys, chain_key, tail_keys
from tiercache.tenancy import ScopedKeys, scope_keys

HERE = pathlib.Path(__file__).resolve().parent
COPY = HERE / "spec" / "hash-vectors.json"
SHARED = HERE.parent.parent / "shared" / "spec" / "hash-vectors.json"
CASES = json.loads(COPY.read_text())["cases"]


def test_vector_copy_matches_shared_spec() -> None:
    if not SHARED.exists():
        pytest.skip("../shared is not beside this checkout")
    assert json.loads(COPY.read_text()) == json.loads(SHARED.read_text()), "tests/spec drifted from shared/spec"


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_conformance_vector(case: dict) -> None:
    ns = Namespace.from_dict(case["namespace"])
    assert ns.digest().hex() == case["namespace_digest"]
    keys = block_keys(ns, case["tokens"])
    assert [k.hex() for k in keys] == case["block_keys"]
    tails = tail_keys(ns, case["tokens"], case["breakpoints"], keys)
    assert {str(p): k.hex() for p, k in tails.items()} == case["tail_keys"]


def test_tail_key_differs_from_full_key_with_same_tokens() -> None:
    ns = Namespace.from_dict(CASES[0]["namespace"])
    tokens = list(range(40))
    keys = block_keys(ns, tokens)
    tail = tail_keys(ns, tokens, [37], keys)[37]
    assert tail == chain_key(keys[1], tokens[32:37])
    assert tail not in keys


def _ns(**over: object) -> dict:
    d = dict(CASES[0]["namespace"])
    d.update(over)
    return d


@pytest.mark.parametrize(
    "fields, message",
    [
        (_ns(block_tokens=0), "block_tokens"),
        (_ns(num_layers="4"), "num_layers"),
        (_ns(model=3), "model"),
        (_ns(head_dim=True), "head_dim"),
        ({k: v for k, v in _ns().items() if k != "salt"}, "salt"),
        (_ns(extra="x"), "extra"),
    ],
)
def test_bad_namespace_is_rejected(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Namespace.from_dict(fields)


@pytest.mark.parametrize("tokens", [[-1], [2**32], [1.5], [True]])
def test_bad_tokens_are_rejected(tokens: list) -> None:
    ns = Namespace.from_dict(_ns())
    with pytest.raises(ValueError, match="position 0"):
        block_keys(ns, tokens * 16)


@pytest.mark.parametrize("bad, message", [
    (-1, "is -1, outside"), (2**32, "is 4294967296, outside"), (2**70, "outside"), (1.0, "not an int"),
    (True, "not an int"), (False, "not an int"), ("7", "not an int"), (None, "not an int"),
])
def test_a_bad_token_anywhere_is_named_by_its_position(bad: object, message: str) -> None:
    """The packed fast path rejects what the per-token check does, with the same message."""
    ns = Namespace.from_dict(_ns())
    tokens: list = [2**32 - 1] * 40
    tokens[37] = bad
    calls = [(lambda: block_keys(ns, tokens), 37), (lambda: tail_keys(ns, tokens, [39]), 37),
             (lambda: chain_key(ns.digest(), tokens[32:]), 5)]  # a run's own positions
    for call, position in calls:
        with pytest.raises(ValueError, match=f"token at position {position} ") as caught:
            call()
        assert message in str(caught.value)


def test_a_bad_token_in_a_tail_is_named_by_its_position_in_the_run() -> None:
    ns = Namespace.from_dict(_ns(block_tokens=16))
    with pytest.raises(ValueError, match="token at position 5 is -3"):
        chain_key(ns.digest(), [0, 1, 2, 3, 4, -3])


def _spec_keys(namespace: dict, tokens: list[int]) -> tuple[list[bytes], dict[int, bytes]]:
    """DESIGN.md's formula written out plainly (one hash per block), the oracle of the fast path."""
    def h(data: bytes) -> bytes:
        return hashlib.blake2b(data, digest_size=32).digest()

    def link(parent: bytes, run: list[int]) -> bytes:
        return h(b"tiercache.block.v1\0" + parent + struct.pack("<I", len(run)) + b"".join(struct.pack("<I", t)
                                                                                          for t in run))

    canonical = json.dumps(namespace, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    size = namespace["block_tokens"]
    chain = [h(b"tiercache.ns.v1\0" + canonical)]
    for start in range(0, len(tokens) - size + 1, size):
        chain.append(link(chain[-1], tokens[start : start + size]))
    tails = {point: link(chain[point // size], tokens[point - point % size : point])
             for point in range(1, len(tokens) + 1) if point % size}
    return chain[1:], tails


# Ids cluster at both ends of the u32 range, where an off-by-one in packing or range checks would show.
TOKEN = st.one_of(st.integers(0, 2**32 - 1), st.integers(2**32 - 300, 2**32 - 1), st.integers(0, 300))


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(TOKEN, max_size=90), block_tokens=st.integers(1, 20),
       salt=st.text(max_size=8), model=st.text(max_size=8))
def test_fast_path_equals_the_plain_spec_formula(tokens: list[int], block_tokens: int, salt: str, model: str) -> None:
    fields = _ns(block_tokens=block_tokens, salt=salt, model=model)
    expected_keys, expected_tails = _spec_keys(fields, tokens)
    ns = Namespace.from_dict(fields)
    keys = block_keys(ns, tokens)
    assert keys == expected_keys
    points = list(range(1, len(tokens) + 1))
    assert tail_keys(ns, tokens, points, keys) == expected_tails
    assert tail_keys(ns, tokens, points) == expected_tails
    assert tail_keys(ns, tuple(tokens), points) == expected_tails  # any Sequence of ints


def test_top_of_the_u32_range_and_a_partial_last_run() -> None:
    fields = _ns(block_tokens=16)
    tokens = [2**32 - 1 - i for i in range(16 * 3 + 5)]
    keys = block_keys(Namespace.from_dict(fields), tokens)
    assert len(keys) == 3 and keys == _spec_keys(fields, tokens)[0]


def test_namespace_digest_is_computed_once_and_follows_the_fields() -> None:
    ns = Namespace.from_dict(_ns())
    assert ns.digest() is ns.digest()
    canonical = json.dumps(_ns(), sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    assert ns.digest() == hashlib.blake2b(b"tiercache.ns.v1\0" + canonical, digest_size=32).digest()
    assert Namespace.from_dict(_ns(salt="other")).digest() != ns.digest()
    assert ns == Namespace.from_dict(_ns()) and hash(ns) == hash(Namespace.from_dict(_ns()))


def test_bench_keys_runs_and_prints_both_medians_and_the_ratio() -> None:
    script = HERE.parent / "scripts" / "bench_keys.py"
    proc = subprocess.run([sys.executable, str(script), "--tokens", "50", "--repeat", "3"],
                          check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "reference (spec written plainly, before)" in proc.stdout
    assert "tiercache.keys block_keys (after)" in proc.stdout and "x" in proc.stdout
    assert "target: block_keys of 50 tokens <= 0.2 ms" in proc.stdout


def test_bad_breakpoint_is_rejected() -> None:
    ns = Namespace.from_dict(_ns())
    with pytest.raises(ValueError, match="breakpoint"):
        tail_keys(ns, list(range(10)), [11])


def test_any_field_changes_every_key() -> None:
    tokens = list(range(32))
    base = block_keys(Namespace.from_dict(_ns()), tokens)
    for field, value in [("weights", "abc"), ("adapter", "lora"), ("salt", "bob"), ("dtype", "float16")]:
        other = block_keys(Namespace.from_dict(_ns(**{field: value})), tokens)
        assert not set(base) & set(other), field


def test_remembered_store_keys_follow_the_formula_and_stay_bounded() -> None:
    memo = ScopedKeys("alice", limit=5)
    keys = [bytes([i]) * 32 for i in range(8)]
    for named in (keys[:3], keys[:3], keys[2:6], keys, keys[::-1], keys[:2], keys[1:]):
        assert memo(named) == scope_keys("alice", named)
        assert len(memo) <= 5
    assert ScopedKeys("bob")(keys[:1]) != memo(keys[:1])
