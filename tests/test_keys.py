"""Block keys reproduce the normative conformance vectors and reject bad input."""

from __future__ import annotations

import json
import pathlib

import pytest

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
