"""The remote tier as the operator and the cluster's ACLs see it: `admin stats` and `admin flush --tier
remote` against real daemons on a real 3-primary Redis Cluster, and keys under per-tenant prefixes."""

from __future__ import annotations

import dataclasses
import os

import pytest

from benchmarks.daemons import assert_intact, chain, running_server, small_config, tokens
from tests.test_admin import run_admin, run_json
from tests.test_cluster import box, client_for, remote_for, stored
from tiercache.block import Block
from tiercache.client import Client
from tiercache.codec import encode_block
from tiercache.errors import InvalidArgument, PermissionDenied
from tiercache.tenancy import LOCAL_TENANT
from tiercache.tiers.remote import RemoteTier
from tiercache.tiers.remote_signing import MAGIC

TOKENS = {"tok-alice": "alice", "tok-bob": "bob"}



def test_admin_stats_shows_the_remote_tier_and_flush_tier_remote_deletes_it_after_asking(cluster, base) -> None:
    remote = remote_for(cluster, base)
    blocks = chain(tokens(2000, 3))
    keys = [b.meta.key for b in blocks]
    store_keys = [stored(b).meta.key for b in blocks]
    with running_server(box(base, "a", remote)) as (store_a, a_addr), \
            running_server(box(base, "b", remote)) as (store_b, b_addr):
        with Client(a_addr) as a:
            a.put(blocks)
        store_a.flush_writes(30)
        with Client(b_addr) as b:
            assert b.lookup(keys) == ["remote"] * 3  # read from the cluster into B's host tier

        code, s = run_json(b_addr, "stats")
        assert code == 0
        (row,) = [t for t in s["tiers"] if t["tier"] == "remote"]
        assert row["hits"] == 3 and row["verification_failures"] == 0 and row["capacity_bytes"] == 0
        assert s["remote"]["blocks_pulled"] == 3 and s["remote"]["bytes_read"] > 3 * blocks[0].meta.nbytes
        assert s["remote"]["bytes_written"] == 0 and s["remote"]["errors"] == 0
        code, s = run_json(a_addr, "stats")
        (row,) = [t for t in s["tiers"] if t["tier"] == "remote"]
        assert row["puts"] == 3 and s["remote"]["bytes_written"] > 3 * blocks[0].meta.nbytes
        assert s["remote"]["queue_blocks"] == 0 and s["remote"]["blocks_pulled"] == 0
        code, out, _ = run_admin(b_addr, "stats")
        assert code == 0 and "remote tier" in out
        header, values = out.split("remote tier")[1].splitlines()[1:3]
        assert header.split()[0] == "HITS" and values.split()[0] == "3", out
        assert "in the cluster: about " in out and " random keys)" in out, out

        # Asked first: no terminal and no --yes refuses; "no" declines; nothing is deleted either way.
        code, _, err = run_admin(a_addr, "flush", "--tier", "remote")
        assert code == 2 and "--yes" in err
        code, _, err = run_admin(a_addr, "flush", "--tier", "remote", answer="n\n")
        assert code == 6 and "remote tier" in err
        assert store_a.remote.present_prefix(store_keys, LOCAL_TENANT) == 3
        code, _, err = run_admin(a_addr, "flush", "--tier", "remote", "--namespace", "ab" * 32, "--yes")
        assert code == 2 and "cannot be combined with --tier remote" in err
        with Client(a_addr) as a, pytest.raises(InvalidArgument, match="cannot be flushed by namespace"):
            a.flush(tier="remote", namespace=blocks[0].meta.namespace)  # the daemon refuses it too
        code, out, _ = run_admin(a_addr, "flush", "--tier", "remote", answer="y\n")
        assert code == 0 and out.startswith("flushed 3 blocks (your blocks, tier remote)"), out
        assert store_a.remote.present_prefix(store_keys, LOCAL_TENANT) == 0
        with Client(a_addr) as a:
            assert a.lookup(keys) == ["host"] * 3  # the daemons' own tiers keep theirs
            assert_intact(a.fetch(keys))
        code, r = run_json(a_addr, "flush", "--tier", "remote", "--yes")
        assert code == 1 and r == {"removed": 0, "tier": "remote", "namespace": None, "tenant": None}

    os.makedirs(os.path.join(base, "plain"))
    with running_server(small_config(os.path.join(base, "plain"))) as (_, plain_addr):  # no remote tier
        code, _, err = run_admin(plain_addr, "flush", "--tier", "remote", "--yes")
        assert code == 1 and "tier 'remote' is not enabled" in err
        code, s = run_json(plain_addr, "stats")
        assert s["remote"] is None and all(t["tier"] != "remote" for t in s["tiers"])


def test_keys_carry_the_tenant_so_an_acl_confines_a_daemon_to_some_tenants(cluster, base) -> None:
    """<key_prefix>:<tenant>:<store key>: a daemon whose ACL user may only touch alice's keys serves
    alice from the cluster and gives bob misses (his keys are out of its reach), and a tenant's
    remote flush deletes that tenant's keys only."""
    prefix = f"q{os.path.basename(base)}"
    user = f"alice-{os.path.basename(base)}"
    for port in cluster.procs:  # the ACL line of docs/scale-out.md, for one tenant's keys
        assert cluster.cli(port, "ACL", "SETUSER", user, "on", ">pw", "resetkeys", f"~{prefix}:alice:*",
                           "resetchannels", "-@all", "+get", "+set", "+exists", "+unlink", "+scan", "+ping", "+info",
                           "+command", "+cluster|slots", "+cluster|shards", "+cluster|nodes", "+readonly", "+hello",
                           "+auth", "+dbsize", "+randomkey", "+strlen") == "OK"
    with open(os.path.join(base, "pw"), "w") as f:
        f.write("pw\n")
    full = remote_for(cluster, base, key_prefix=prefix)
    confined = dataclasses.replace(full, username=user, password_file=os.path.join(base, "pw"))
    alice_blocks, bob_blocks = chain(tokens(2100, 3)), chain(tokens(2200, 2))
    tcp = dict(listen="127.0.0.1:0", tokens=TOKENS)
    rc = client_for(cluster)
    try:
        with running_server(box(base, "a", full, **tcp)) as (store_a, a_addr), \
                running_server(box(base, "c", confined, **tcp)) as (store_c, c_addr):
            with Client(a_addr, token="tok-alice") as alice_a, Client(a_addr, token="tok-bob") as bob_a:
                alice_a.put(alice_blocks)
                bob_a.put(bob_blocks)
            store_a.flush_writes(30)
            in_cluster = sorted(k for node in rc.get_primaries()
                                for k in rc.get_redis_connection(node).scan_iter(match=f"{prefix}:*"))
            assert [k.rsplit(b":", 1)[0] for k in in_cluster] == [f"{prefix}:alice".encode()] * 3 + \
                [f"{prefix}:bob".encode()] * 2
            assert all(len(k.rsplit(b":", 1)[1]) == 64 for k in in_cluster)

            alice_keys, bob_keys = [b.meta.key for b in alice_blocks], [b.meta.key for b in bob_blocks]
            with Client(c_addr, token="tok-alice") as alice_c, Client(c_addr, token="tok-bob") as bob_c:
                assert alice_c.lookup(alice_keys) == ["remote"] * 3
                assert_intact(alice_c.fetch(alice_keys))
                assert bob_c.lookup(bob_keys) == []  # in the cluster, but not this daemon's to read
                bob_c.put(chain(tokens(2300, 2)))
            store_c.flush_writes(30)
            assert store_c.remote_counters()["write_errors"] == 2  # NOPERM: nor to write
            code, s = run_json(c_addr, "stats", "--token", "tok-alice")  # a network tenant: no aggregates
            assert code == 0 and s["remote"] is None
            assert [(t["tier"], t["hits"]) for t in s["tiers"]][-1] == ("remote", 0)
            code, out, _ = run_admin(c_addr, "stats", "--token", "tok-alice")
            assert code == 0 and "remote tier: on" in out

            # The operator flushes bob's remote keys (this daemon holds none of his blocks); alice's stay.
            code, _, err = run_admin(c_addr, "flush", "--tier", "remote", "--tenant", "bob", "--yes",
                                     "--token", "tok-alice")
            assert code == 4 and "PermissionDenied" in err
            operator_addr = f"unix:{store_a.cfg.server.socket}"
            with Client(operator_addr) as operator, Client(a_addr, token="tok-bob") as bob_a:
                with pytest.raises(PermissionDenied):
                    bob_a.flush(tier="remote", tenant="alice")
                assert operator.flush(tier="remote", tenant="bob") == 2
            left = [k for node in rc.get_primaries()
                    for k in rc.get_redis_connection(node).scan_iter(match=f"{prefix}:*")]
            assert sorted(k.rsplit(b":", 1)[0] for k in left) == [f"{prefix}:alice".encode()] * 3
            code, out, _ = run_admin(a_addr, "flush", "--tier", "remote", "--yes", "--token", "tok-alice")
            assert code == 0 and out.startswith("flushed 3 blocks"), out
    finally:
        rc.close()


def test_a_tenant_name_is_percent_encoded_and_a_value_naming_another_tenant_is_a_miss(cluster, base) -> None:
    tier = RemoteTier(remote_for(cluster, base), max_block_bytes=1 << 20)
    try:
        (block,) = chain(tokens(2400, 1))
        key = block.meta.key
        assert tier.redis_key(key, "a:b*c") == f"{tier.cfg.key_prefix}:a%3Ab%2Ac:{key.hex()}".encode()
        assert tier.redis_key(key, "alice") == f"{tier.cfg.key_prefix}:alice:{key.hex()}".encode()
        # Signed with the secret under bob's key, but the record says alice: never served to bob.
        record = encode_block(Block(dataclasses.replace(block.meta, tenant="alice"), block.payload))
        rkey = tier.redis_key(key, "bob")
        rc = client_for(cluster)
        rc.set(rkey, MAGIC + tier.mac(rkey, record) + record)
        rc.close()
        assert tier.present_prefix([key], "bob") == 1 and tier.get_many([key], "bob") == []
        assert tier.remote_counters()["verification_failures"] == 1
        tier.put_many([Block(dataclasses.replace(block.meta, tenant="alice"), block.payload)])
        assert tier.flush(30)
        assert [b.meta.tenant for b in tier.get_many([key], "alice")] == ["alice"]
        assert tier.clear("bob") == 1 and tier.clear() == 1
    finally:
        tier.close()

