"""The remote tier's signed values on a real 3-primary Redis Cluster: the TCR2 format round-trips at
real block sizes, secrets rotate without a flag day, forged, damaged, moved and other tenants' values
are misses counted and never served, and TCR1 values verify by their HMAC while their secret is listed."""

from __future__ import annotations

import dataclasses
import hmac
import os

import pytest
import torch

from benchmarks.daemons import assert_intact, chain, tokens
from benchmarks.redis_cluster import RedisCluster, write_secret
from tests.test_cluster import client_for, remote_for
from tiercache.block import Block, BlockMeta
from tiercache.codec import encode_block
from tiercache.config import Config, RemoteConfig, load_config
from tiercache.errors import InvalidArgument
from tiercache.layout import checksum
from tiercache.tiers.remote import RemoteTier
from tiercache.tiers.remote_signing import LEGACY_MAGIC, MAC_BYTES, MAGIC, Signer, Unverified

OLD, NEW, STRANGER = b"the secret of last year", b"the secret of this year", b"a secret nobody listed"


def tier_for(cluster: RedisCluster, base: str, secrets: list[bytes], prefix: str = "") -> RemoteTier:
    """A remote tier that signs with secrets[0] and verifies secrets[1:] too, under key_prefix `prefix`
    (default: the test's own, so that tiers built with other secrets share the keys)."""
    files = [write_secret(os.path.join(base, f"verify-{len(os.listdir(base))}"), s) for s in secrets[1:]]
    cfg = remote_for(cluster, base, secret=secrets[0], verify_secret_files=",".join(files))
    if prefix:
        cfg = dataclasses.replace(cfg, key_prefix=prefix)
    return RemoteTier(cfg, max_block_bytes=4 << 20)


def big_block(seed: int, nbytes: int = 1179648) -> Block:
    """A block the size of one of a Llama-3-8B-shaped model (18 x 64 KiB = 1.1 MiB of 16 tokens)."""
    g = torch.Generator().manual_seed(seed)
    payload = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    key = torch.randint(0, 256, (32,), dtype=torch.uint8, generator=g).numpy().tobytes()
    return Block(BlockMeta(key=key, namespace=b"n" * 32, num_tokens=16, dtype="float16",
                           shape=(nbytes // 65536, 2, 8, 16, 128), nbytes=nbytes, checksum=checksum(payload)), payload)


def written(tier: RemoteTier, blocks: list[Block]) -> list[bytes]:
    """Put `blocks` through `tier`'s writer; their store keys."""
    assert tier.put_many(blocks) == len(blocks) and tier.flush(30)
    return [b.meta.key for b in blocks]


def failures(tier: RemoteTier) -> int:
    return tier.remote_counters()["verification_failures"]


def test_the_new_format_round_trips_at_real_block_sizes(cluster, base) -> None:
    tier = tier_for(cluster, base, [NEW])
    rc = client_for(cluster)
    try:
        blocks = [big_block(1), big_block(2, 65536)] + chain(tokens(3, 2))
        keys = written(tier, blocks)
        got = tier.get_many(keys)
        assert [b.meta for b in got] == [b.meta for b in blocks]
        assert all(torch.equal(g.payload, b.payload) for g, b in zip(got, blocks))
        value = rc.get(tier.redis_key(keys[0]))
        assert value[:4] == MAGIC == b"TCR2" and len(value) == tier.cost_bytes(blocks[0].meta)
        assert value[4 + MAC_BYTES :] == encode_block(blocks[0])  # the record itself, as it was
        assert tier.remote_counters()["hits"] == 4 and failures(tier) == 0
    finally:
        rc.close()
        tier.close()


def test_a_rotation_serves_the_old_secrets_values_while_listed_and_misses_them_once_dropped(cluster, base) -> None:
    """The three steps of docs/scale-out.md: every daemon lists the new secret, then signs with it,
    then drops the old one; at no step is a value of a listed secret missed."""
    before = tier_for(cluster, base, [OLD])
    step1 = tier_for(cluster, base, [OLD, NEW])  # knows NEW, still signs with OLD
    step2 = tier_for(cluster, base, [NEW, OLD])  # signs with NEW, still verifies OLD
    after = tier_for(cluster, base, [NEW])
    tiers = (before, step1, step2, after)
    try:
        by_old = written(before, chain(tokens(10, 3)))
        by_step1 = written(step1, chain(tokens(11, 3)))
        by_new = written(step2, chain(tokens(12, 3)))
        for tier in (before, step1, step2):  # OLD still listed: served
            got = tier.get_many(by_old) + tier.get_many(by_step1)
            assert len(got) == 6
            assert_intact(got)
        for tier in (step1, step2, after):  # NEW listed: served
            assert len(tier.get_many(by_new)) == 3
        assert all(failures(t) == 0 for t in (before, step1, step2))
        # OLD dropped: its values are misses (the chain's first ends it), counted, never served.
        assert after.get_many(by_old) == [] and after.get_many(by_step1) == []
        assert failures(after) == 2 and after.remote_counters()["hits"] == 3
        # A daemon not yet at step 1 misses what step 2 signed: why step 1 comes first everywhere.
        assert before.get_many(by_new) == [] and failures(before) == 1
        # The same store key rewritten by `after` is a hit for it again.
        written(after, chain(tokens(10, 3)))
        assert len(after.get_many(by_old)) == 3
    finally:
        for tier in tiers:
            tier.close()


def test_forged_damaged_moved_and_other_tenants_values_are_misses_counted_never_served(cluster, base) -> None:
    tier = tier_for(cluster, base, [NEW, OLD])
    stranger = tier_for(cluster, base, [STRANGER])
    rc = client_for(cluster)
    try:
        block = big_block(20)
        record = encode_block(block)
        good = MAGIC + tier.mac(tier.redis_key(block.meta.key), record) + record

        def served(value: bytes, tenant: str = "") -> bool:
            rc.set(tier.redis_key(block.meta.key, tenant), value)
            return tier.get_many([block.meta.key], tenant) != []

        assert served(good)
        forged = MAGIC + stranger.mac(tier.redis_key(block.meta.key), record) + record  # a secret nobody lists
        with_our_key_id = good[:12] + forged[12 : 4 + MAC_BYTES] + record  # a listed key id, a guessed tag
        flipped = bytearray(good)
        flipped[len(good) // 2] ^= 1  # one bit of the payload
        tag_flipped = bytearray(good)
        tag_flipped[4 + MAC_BYTES - 1] ^= 1
        bad_values = [forged, with_our_key_id, bytes(flipped), bytes(tag_flipped), good[:-1], good[: 4 + MAC_BYTES],
                      good[:20], b"TCR2", os.urandom(len(good)), b"TCR3" + good[4:], record]
        for i, value in enumerate(bad_values):
            assert not served(value), i
        assert failures(tier) == len(bad_values)
        # Signed under alice's key, copied under bob's: the key is bound into the MAC.
        rkey_alice = tier.redis_key(block.meta.key, "alice")
        alice = encode_block(Block(dataclasses.replace(block.meta, tenant="alice"), block.payload))
        signed_for_alice = MAGIC + tier.mac(rkey_alice, alice) + alice
        assert served(signed_for_alice, "alice")
        assert not served(signed_for_alice, "bob")
        # Signed under bob's key by a holder of the secret, but the record names alice: the tenant check.
        assert not served(MAGIC + tier.mac(tier.redis_key(block.meta.key, "bob"), alice) + alice, "bob")
        assert failures(tier) == len(bad_values) + 2
        # Under another key_prefix with the same secrets (another group of daemons), then copied here:
        # the record's own key and tenant match, only the MAC, over the Redis key, tells.
        other = tier_for(cluster, base, [NEW, OLD], prefix=tier.cfg.key_prefix + "-other")
        try:
            written(other, [block])
            assert len(other.get_many([block.meta.key])) == 1
            assert not served(rc.get(other.redis_key(block.meta.key)))
        finally:
            other.close()
        assert failures(tier) == len(bad_values) + 3
        assert tier.remote_counters()["hits"] == 2
    finally:
        rc.close()
        stranger.close()
        tier.close()


def test_tcr1_values_verify_by_their_hmac_while_their_secret_is_listed(cluster, base) -> None:
    tier = tier_for(cluster, base, [NEW, OLD])
    after = tier_for(cluster, base, [NEW])
    rc = client_for(cluster)
    try:
        blocks = chain(tokens(30, 3))
        keys = [b.meta.key for b in blocks]
        for block in blocks:  # as a daemon of the version before wrote them, with OLD
            rkey, record = tier.redis_key(block.meta.key), encode_block(block)
            rc.set(rkey, LEGACY_MAGIC + hmac.digest(OLD, rkey + record, "sha256") + record)
        got = tier.get_many(keys)
        assert len(got) == 3
        assert_intact(got)
        assert tier.remote_counters()["legacy_reads"] == 3 and failures(tier) == 0
        assert after.get_many(keys) == [] and failures(after) == 1  # OLD dropped: a miss
        rkey, record = tier.redis_key(keys[0]), encode_block(blocks[0])
        damaged = LEGACY_MAGIC + hmac.digest(OLD, rkey + record, "sha256") + record[:-1] + bytes([record[-1] ^ 1])
        rc.set(rkey, damaged)
        assert tier.get_many(keys) == [] and failures(tier) == 1
        written(tier, blocks[:1])  # writes always use the new format
        assert rc.get(rkey)[:4] == MAGIC
    finally:
        rc.close()
        after.close()
        tier.close()


def test_every_signature_has_its_own_salt_and_the_first_secrets_key_id() -> None:
    signer, other = Signer([NEW, OLD]), Signer([OLD, NEW])
    sigs = {signer.sign(b"p:t:00", b"the same record") for _ in range(1000)}
    assert len(sigs) == 1000 and len({s[8:24] for s in sigs}) == 1000  # fresh salts, so fresh keys
    assert {s[:8].hex() for s in sigs} == {signer.key_ids[0]} and other.key_ids == signer.key_ids[::-1]
    value = MAGIC + other.sign(b"p:t:00", b"r") + b"r"
    assert bytes(signer.record(b"p:t:00", value)[0]) == b"r"
    with pytest.raises(Unverified, match="does not list"):
        Signer([NEW]).record(b"p:t:00", value)


def test_secret_files_are_checked_with_errors_naming_the_field(base) -> None:
    cfg = RemoteConfig(enabled=True, urls="redis://127.0.0.1:1", timeout_ms=50,
                       secret_file=write_secret(os.path.join(base, "s"), NEW))
    empty, missing = write_secret(os.path.join(base, "empty"), b" \n"), os.path.join(base, "missing")
    for fields, field in (({"secret_file": empty}, "remote.secret_file '.*' is empty"),
                          ({"secret_file": missing}, "remote.secret_file '.*': cannot read it"),
                          ({"verify_secret_files": empty}, "remote.verify_secret_files '.*' is empty"),
                          ({"verify_secret_files": f"{cfg.secret_file},{missing}"},
                           "remote.verify_secret_files '.*missing': cannot read it")):
        with pytest.raises(InvalidArgument, match=field):
            RemoteTier(dataclasses.replace(cfg, **fields), max_block_bytes=1 << 20)
    with pytest.raises(ValueError, match="remote.verify_secret_files"):
        Config(remote=dataclasses.replace(cfg, verify_secret_files=f"{cfg.secret_file},,{empty}"))
    loaded = load_config(env={"TIERCACHE_REMOTE__ENABLED": "1", "TIERCACHE_REMOTE__URLS": "redis://a:1",
                              "TIERCACHE_REMOTE__SECRET_FILE": cfg.secret_file,
                              "TIERCACHE_REMOTE__VERIFY_SECRET_FILES": "~/old.secret,/etc/older.secret",
                              "TIERCACHE_DATA_DIR": base})
    assert loaded.remote.verify_secret_files == "~/old.secret,/etc/older.secret"  # ~ expands when read
