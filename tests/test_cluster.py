"""The remote tier on a real 3-primary Redis Cluster: daemons on two "machines" share prefixes, a shard
dies and comes back, forged and damaged values are misses, tenants stay apart."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import time

import pytest
import torch
from redis.cluster import ClusterNode
from redis.cluster import RedisCluster as ClusterClient

from benchmarks.daemons import REPO, Daemon, assert_intact, chain, running_server, small_config, tokens, write_config
from benchmarks.redis_cluster import RedisCluster, find_binaries, remote_toml, write_secret
from tiercache.block import Block
from tiercache.client import Client
from tiercache.codec import encode_block
from tiercache.config import Config, RemoteConfig, load_config
from tiercache.keys import block_keys
from tiercache.store import TieredStore
from tiercache.tenancy import LOCAL_TENANT, scope_key
from tiercache.tiers.remote import RemoteTier
from tiercache.tiers.remote_signing import MAC_BYTES, MAGIC

SECRET = b"the cluster secret of this test"



def remote_for(cluster: RedisCluster, base: str, *, secret: bytes = SECRET, **fields: object) -> RemoteConfig:
    secret_file = write_secret(os.path.join(base, f"secret-{len(os.listdir(base))}"), secret)
    # Generous deadlines: this machine may be slow; the point here is what a failure leads to.
    values: dict = dict(enabled=True, urls=cluster.urls, secret_file=secret_file, timeout_ms=2000, retry_after_s=0.2,
                        key_prefix=f"t{os.path.basename(base)}")
    return RemoteConfig(**{**values, **fields})


def box(base: str, name: str, remote: RemoteConfig, **server: object) -> Config:
    """The config of one "machine": its own data dir, socket and slab; the shared remote tier."""
    os.makedirs(os.path.join(base, name))
    return dataclasses.replace(small_config(os.path.join(base, name), host_pages=256, **server), remote=remote)


def client_for(cluster: RedisCluster) -> ClusterClient:
    return ClusterClient(startup_nodes=[ClusterNode("127.0.0.1", p) for p in cluster.ports],
                         require_full_coverage=False)


def stored(block: Block) -> Block:
    """`block` under its store key, as the daemon keeps a block that a tokenless local client put."""
    meta = dataclasses.replace(block.meta, key=scope_key(LOCAL_TENANT, block.meta.key),
                               parent=scope_key(LOCAL_TENANT, block.meta.parent) if block.meta.parent else b"",
                               tenant=LOCAL_TENANT)
    return Block(meta, block.payload)


def test_a_prefix_computed_on_one_machine_is_a_bit_identical_hit_on_another(cluster, base) -> None:
    """Two daemon processes with their own data dirs share only the cluster: blocks put through A
    come back from B byte for byte, and a worker on B reuses A's prefix with the scores of a recompute."""
    from tests.test_worker import assert_same, tiny, toks
    from tiercache.worker import Request, Worker

    remote = remote_for(cluster, base)
    daemons = []
    for name in ("a", "b"):
        cfg = box(base, name, remote)
        path = write_config(os.path.join(base, f"{name}.toml"), cfg)
        with open(path, "a") as f:
            f.write(remote_toml(remote.urls, remote.secret_file, key_prefix=remote.key_prefix, timeout_ms=2000))
        daemons.append(Daemon(config=path))
    try:
        a_addr, b_addr = (f"unix:{d.wait_ready()[0].removeprefix('unix:')}" for d in daemons)
        blocks = chain(tokens(7, 12))
        keys = [b.meta.key for b in blocks]
        with Client(a_addr) as a:
            a.put(blocks)
        cluster.wait_for_keys(remote.key_prefix, len(blocks))
        with Client(b_addr) as b:  # tokenless on B's socket: B's shared index is asked first
            assert b.lookup(keys) == ["remote"] * len(keys)  # read from the cluster into B's host tier
            assert b.lookup(keys) == ["host"] * len(keys)  # where it is now
            fetched = b.fetch(keys)
        assert [f.meta for f in fetched] == [x.meta for x in blocks]
        assert all(torch.equal(f.payload, x.payload) for f, x in zip(fetched, blocks))
        assert_intact(fetched)

        loaded = tiny("llama")
        prefix = toks(64, 11)
        on_a = Worker(loaded, lambda: Client(a_addr), retry_after_s=0.0)
        first = on_a.run(Request(tuple(prefix + toks(5, 12)), max_new_tokens=4, return_scores=5))
        on_a.drain()
        on_a.close()
        assert first.cached_tokens == 0
        cluster.wait_for_keys(remote.key_prefix, len(blocks) + 4)
        on_b = Worker(loaded, lambda: Client(b_addr), retry_after_s=0.0)
        on_b.cost.worth_fetching = lambda *args: True  # a tiny model recomputes faster than it fetches
        prompt = tuple(prefix + toks(6, 13))
        hit = on_b.run(Request(prompt, max_new_tokens=4, return_scores=5))
        full = on_b.run(Request(prompt, max_new_tokens=4, return_scores=5, cache=False))
        on_b.close()
        assert hit.cached_tokens == 64 and not hit.degraded
        assert_same(hit, full)
    finally:
        for d in daemons:
            d.stop()
    assert all(d.proc.returncode == 0 for d in daemons), [d.stderr[-2000:] for d in daemons]


def put_singles(a: Client, store_a: TieredStore, rc: ClusterClient, seed: int,
                n: int) -> tuple[list[list[Block]], list[int]]:
    """`n` one-block chains (one shard each) put through `a` and written to the cluster, and each one's slot."""
    singles = [chain(tokens(seed + i, 1)) for i in range(n)]
    for blocks in singles:
        a.put(blocks)
    store_a.flush_writes(30)
    assert store_a.remote is not None
    return singles, [rc.keyslot(store_a.remote.redis_key(stored(c[0]).meta.key, LOCAL_TENANT)) for c in singles]


def test_a_killed_shard_means_misses_for_its_keys_only_and_hits_return_with_it(cluster, base) -> None:
    remote = remote_for(cluster, base)
    rc = client_for(cluster)
    with running_server(box(base, "a", remote)) as (store_a, a_addr), \
            running_server(box(base, "b", remote)) as (store_b, b_addr), Client(a_addr) as a, Client(b_addr) as b:
        singles, slots = put_singles(a, store_a, rc, 100, 24)
        victim = cluster.ports[1]
        on_victim = [rc.nodes_manager.get_node_from_slot(slot).port == victim for slot in slots]
        assert 0 < sum(on_victim) < len(singles)
        cluster.kill_node(victim)
        found = [b.lookup([c[0].meta.key]) for c in singles]  # no call fails
        assert [f == ["remote"] for f in found] == [not v for v in on_victim], (found, on_victim)
        fetched = [b.fetch([c[0].meta.key]) for c, v in zip(singles, on_victim) if not v]
        assert_intact([f[0] for f in fetched])
        assert store_b.remote_counters()["errors"] >= 1

        cluster.restart_node(victim)  # back empty (no persistence): new blocks reach it again
        time.sleep(remote.retry_after_s)  # each daemon asks a failed shard again after retry_after_s
        later = [chain(tokens(200 + i, 1)) for i in range(24)]
        for blocks in later:
            a.put(blocks)
        store_a.flush_writes(30)
        assert all(b.lookup([c[0].meta.key]) == ["remote"] for c in later)
        store_b.check_integrity()
    rc.close()


def test_a_killed_primary_without_replicas_costs_long_prompts_only_its_share(base) -> None:
    """One of three primaries SIGKILLed, no replica: a worker on a daemon that never saw the prompts
    computes the blocks the dead shard held (holes) and reuses the cached blocks after them, so
    prompts of 1500+ tokens keep at least 60% of their cached tokens (a prefix alone stops at its
    first lost block), with the answers of a recompute; the holes are written back."""
    from tests.test_worker import assert_same, tiny, toks
    from tiercache.worker import Request, Worker

    loaded = tiny("llama")
    prompts = [toks(1520, 500 + i) for i in range(4)]
    with RedisCluster(3) as own:
        remote = remote_for(own, base, queue_blocks=4096)

        def machine(name: str) -> Config:
            os.makedirs(os.path.join(base, name))
            return dataclasses.replace(small_config(os.path.join(base, name), host_pages=2048, disk_bytes=64 << 20),
                                       remote=remote)

        with running_server(machine("a")) as (store_a, a_addr):
            worker = Worker(loaded, lambda: Client(a_addr), retry_after_s=0.0)
            for p in prompts:
                worker.run(Request(tuple(p), max_new_tokens=1))
            worker.drain()
            worker.close()
            store_a.flush_writes(30)
        ns = worker.namespace()
        chains = [block_keys(ns, p + toks(8, 1))[:95] for p in prompts]  # what a request's lookup asks for
        own.wait_for_keys(remote.key_prefix, 4 * 95)
        with running_server(machine("b")) as (store_b, b_addr), Client(b_addr) as b:
            before = sum(len(b.lookup(keys)) * 16 for keys in chains)
            census = b.stats().remote  # only these blocks in this cluster: the estimate is the count
            assert census is not None and census.cluster_blocks == 4 * 95 and census.census_failed_primaries == 0
            assert 4 * 95 * (16 * 512) < census.cluster_bytes < 4 * 95 * (16 * 512 + 1024)
        assert before == 4 * 95 * 16
        own.kill_node(own.ports[0])
        with running_server(machine("c")) as (store_c, c_addr):
            with Client(c_addr) as c:  # what a prefix alone keeps: up to its first block on the dead shard
                prefix_only = sum(len(c.lookup(keys)) * 16 for keys in chains)
            worker = Worker(loaded, lambda: Client(c_addr), retry_after_s=0.0)
            worker.cost.worth_fetching = lambda *args: True  # a tiny model recomputes faster than it fetches
            after = []
            for p in prompts:
                hit = worker.run(Request(tuple(p + toks(8, 1)), max_new_tokens=3, return_scores=5))
                assert not hit.degraded, hit.degraded
                assert_same(hit, worker.run(Request(tuple(p + toks(8, 1)), max_new_tokens=3, return_scores=5,
                                                    cache=False)))
                after.append(hit)
            worker.drain()
            worker.close()
            kept = sum(r.cached_tokens for r in after)
            print(f"cached tokens kept with 1 of 3 primaries down: {kept} of {before} ({kept / before:.0%}); "
                  f"a prefix alone: {prefix_only} ({prefix_only / before:.0%})")
            assert kept >= 0.6 * before and prefix_only < kept
            assert all("remote" in r.tiers for r in after)
            with Client(c_addr) as c:  # the holes were written back: the next request is a whole hit
                assert all(len(c.lookup(keys)) == 95 for keys in chains)
            assert store_c.remote_counters()["errors"] >= 1
            census = store_c.remote_census()
            assert census is not None and census.failed == 1 and census.primaries == 2
            assert 0 < census.blocks < 4 * 95  # the dead primary's blocks are left out
            store_c.check_integrity()


def test_forged_and_damaged_values_are_misses_counted_never_served(cluster, base) -> None:
    remote = remote_for(cluster, base)
    rc = client_for(cluster)
    garbage, damaged, forged, intact = (chain(tokens(300 + i, 3)) for i in range(4))
    with running_server(box(base, "a", remote)) as (store_a, a_addr), Client(a_addr) as a:
        for blocks in (garbage, damaged, intact):
            a.put(blocks)
        store_a.flush_writes(30)
        writer = store_a.remote
        rkey = writer.redis_key(stored(garbage[0]).meta.key, LOCAL_TENANT)
        rc.set(rkey, os.urandom(len(rc.get(rkey))))  # overwritten with garbage
        # Damaged under a valid MAC (a writer holding the secret, with a bad payload): the checksum catches it.
        bad = encode_block(stored(damaged[0]))
        bad = bad[:-1] + bytes([bad[-1] ^ 1])
        rkey = writer.redis_key(stored(damaged[0]).meta.key, LOCAL_TENANT)
        rc.set(rkey, MAGIC + writer.mac(rkey, bad) + bad)
    # A process that may write to the cluster but does not hold the secret plants a well-formed record.
    intruder = RemoteTier(dataclasses.replace(remote, secret_file=write_secret(os.path.join(base, "wrong"), b"guess")),
                          max_block_bytes=1 << 20)
    intruder.put_many([stored(x) for x in forged])
    intruder.flush(30)
    intruder.close()
    for rkey in (writer.redis_key(stored(x).meta.key, LOCAL_TENANT) for x in (garbage[0], damaged[0], forged[0])):
        assert len(rc.get(rkey)) > len(MAGIC) + MAC_BYTES
    from tests.test_metrics import free_port, scrape

    port = free_port()
    with running_server(box(base, "b", remote, metrics_port=port)) as (store_b, b_addr), Client(b_addr) as b:
        for blocks in (garbage, damaged, forged):
            keys = [x.meta.key for x in blocks]
            assert b.lookup(keys) == []
            assert b.fetch(keys) == []
        counters = store_b.remote_counters()
        assert counters["verification_failures"] == 3 and counters["hits"] == 0  # a chain's first bad block ends it
        keys = [x.meta.key for x in intact]
        assert b.lookup(keys) == ["remote"] * 3
        assert_intact(b.fetch(keys))
        assert store_b.remote_counters()["hits"] == 3
        m = scrape(port)  # the operator sees the same on the metrics endpoint
    assert m[("tiercache_remote_verification_failures_total", frozenset())] == 3
    assert m[("tiercache_remote_hits_total", frozenset())] == 3
    assert all((f"tiercache_remote_cluster_{what}", frozenset()) in m for what in ("blocks", "bytes"))
    assert m[("tiercache_remote_read_bytes_total", frozenset())] > 0
    rc.close()


def test_two_tenants_through_the_cluster_see_only_their_own_blocks(cluster, base) -> None:
    remote = remote_for(cluster, base)
    tokens_ = {"tok-alice": "alice", "tok-bob": "bob"}
    blocks = chain(tokens(400, 4))
    keys = [x.meta.key for x in blocks]
    with running_server(box(base, "a", remote, listen="127.0.0.1:0", tokens=tokens_)) as (store_a, a_addr), \
            running_server(box(base, "b", remote, listen="127.0.0.1:0", tokens=tokens_)) as (_, b_addr):
        with Client(a_addr, token="tok-alice") as alice_a:
            alice_a.put(blocks)
        store_a.flush_writes(30)
        with Client(b_addr, token="tok-bob") as bob_b:
            assert bob_b.lookup(keys) == []
            assert bob_b.fetch(keys) == []
        with Client(b_addr, token="tok-alice") as alice_b:
            assert alice_b.lookup(keys) == ["remote"] * 4
            fetched = alice_b.fetch(keys)
        assert_intact(fetched)
        with Client(b_addr, token="tok-bob") as bob_b:  # nor once alice's blocks are in B's own tiers
            assert bob_b.lookup(keys) == []


def test_flush_of_the_remote_tier_deletes_the_daemons_prefix_only(cluster, base) -> None:
    remote = remote_for(cluster, base)
    other = dataclasses.replace(remote, key_prefix=remote.key_prefix + "-other")
    blocks = chain(tokens(500, 3))
    keys = [x.meta.key for x in blocks]
    with running_server(box(base, "a", remote)) as (store_a, a_addr), \
            running_server(box(base, "o", other)) as (store_o, o_addr):
        with Client(a_addr) as a, Client(o_addr) as o:
            a.put(blocks)
            o.put(blocks)
        store_a.flush_writes(30)
        store_o.flush_writes(30)
        assert store_a.flush(tier="remote") == 3
        keys = [stored(x).meta.key for x in blocks]
        assert not any(store_a.remote.contains(k, LOCAL_TENANT) for k in keys)
        assert all(store_o.remote.contains(k, LOCAL_TENANT) for k in keys)
        assert store_a.lookup(keys) == ["host"] * 3  # its own tiers keep theirs


def test_a_daemon_whose_cluster_is_unreachable_serves_from_its_own_tiers(base) -> None:
    remote = RemoteConfig(enabled=True, urls="redis://127.0.0.1:1", secret_file=write_secret(
        os.path.join(base, "s"), SECRET), timeout_ms=200)
    blocks = chain(tokens(600, 3))
    keys = [x.meta.key for x in blocks]
    with running_server(box(base, "a", remote)) as (store, addr), Client(addr) as a:
        assert a.lookup(keys) == []
        a.put(blocks)
        assert a.lookup(keys) == ["host"] * 3
        assert_intact(a.fetch(keys))
        store.flush_writes(10)
        counters = store.remote_counters()
    assert counters["errors"] >= 1 and counters["write_errors"] == 3


def test_remote_config_is_checked_field_by_field(base) -> None:
    with pytest.raises(ValueError, match="remote.secret_file"):
        RemoteConfig(enabled=True, urls="redis://h:1") and Config(remote=RemoteConfig(enabled=True, urls="redis://h:1"))
    with pytest.raises(ValueError, match="remote.urls"):
        Config(remote=RemoteConfig(enabled=True, urls="http://h:1", secret_file="/s"))
    with pytest.raises(ValueError, match="remote.write_policy"):
        Config(remote=RemoteConfig(write_policy="sometimes"))
    cfg = load_config(env={"TIERCACHE_REMOTE__ENABLED": "1", "TIERCACHE_REMOTE__URLS": "rediss://a:1,rediss://b:2",
                           "TIERCACHE_REMOTE__SECRET_FILE": "~/s", "TIERCACHE_DATA_DIR": base})
    assert cfg.remote.enabled and cfg.remote.secret_file == os.path.expanduser("~/s")


def test_write_policy_hits_sends_a_block_once_it_was_hit_that_often(cluster, base) -> None:
    remote = remote_for(cluster, base, write_policy="hits", write_after_hits=2)
    blocks = chain(tokens(700, 2))
    keys = [x.meta.key for x in blocks]
    with running_server(box(base, "a", remote)) as (store, _):
        store.put_many(blocks)
        store.flush_writes(30)
        assert store.remote.present_prefix(keys) == 0
        for _ in range(2):
            assert len(list(store.fetch(keys[:1]))) == 1
        store.flush_writes(30)
        assert store.remote.present_prefix(keys) == 1  # the first block, hit twice; not the second


def test_every_queued_write_is_sent_failed_or_dropped_and_counted(cluster, base) -> None:
    tier = RemoteTier(remote_for(cluster, base, queue_blocks=1), max_block_bytes=1 << 20)
    try:
        blocks = chain(tokens(800, 40))
        queued = tier.put_many(blocks)
        assert tier.flush(30)
        c = tier.remote_counters()
    finally:
        tier.close()
    assert c["puts"] + c["write_errors"] == queued and c["writes_dropped"] == len(blocks) - queued
    assert c["queue_blocks"] == 0


def test_an_acl_user_confined_to_its_key_prefix_works_there_and_nowhere_else(cluster, base) -> None:
    """The ACL of docs/scale-out.md: the commands the remote tier sends, on its own prefix only."""
    user, prefix = f"u{os.path.basename(base)}", f"p{os.path.basename(base)}"
    for port in cluster.procs:
        assert cluster.cli(port, "ACL", "SETUSER", user, "on", ">pw", "resetkeys", f"~{prefix}:*", "resetchannels",
                           "-@all", "+get", "+set", "+exists", "+unlink", "+scan", "+ping", "+info", "+command",
                           "+cluster|slots", "+cluster|shards", "+cluster|nodes", "+readonly", "+hello",
                           "+auth", "+dbsize", "+randomkey", "+strlen") == "OK"
    with open(os.path.join(base, "pw"), "w") as f:
        f.write("pw\n")
    blocks = chain(tokens(900, 3))
    keys = [x.meta.key for x in blocks]
    for key_prefix, allowed in ((prefix, True), (prefix + "-not-mine", False)):
        tier = RemoteTier(remote_for(cluster, base, key_prefix=key_prefix, username=user,
                                     password_file=os.path.join(base, "pw")), max_block_bytes=1 << 20)
        try:
            tier.put_many(blocks)
            assert tier.flush(30)
            assert tier.present_prefix(keys) == (3 if allowed else 0)
            assert len(tier.get_many(keys)) == (3 if allowed else 0)
            assert tier.remote_counters()["write_errors"] == (0 if allowed else 3)
            census = tier.census()  # admin stats' estimate: its commands are allowed too
            assert (census.primaries, census.failed) == (3, 0) and census.sampled > 0
            assert tier.clear() == (3 if allowed else 0)
        finally:
            tier.close()


def test_bench_cluster_runs_at_tiny_sizes() -> None:
    """scripts/bench_cluster.py end to end (its own cluster, two daemons, a worker on each): every row printed,
    and B's prefix came from the cluster with the scores of a recompute."""
    import sys

    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_cluster.py"), "--fetch-blocks", "4",
                           "--block-mib", "1", "--lookup-blocks", "16", "--ttft-tokens", "256", "--ttft-repeat", "1",
                           "--repeat", "1"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for row in ("fetch MiB/s, 1 MiB blocks", "lookup ms, 16-block chain", "TTFT ms at 256 tokens on B, from A"):
        assert row in proc.stdout, proc.stdout
    assert "240 of 256 tokens came from the cluster" in proc.stdout
    worst = re.search(r"differ from a recompute by at most (\S+);", proc.stdout)
    assert worst and float(worst.group(1)) < 1e-4, proc.stdout


def test_blocks_stay_readable_while_their_slots_move_to_another_shard(base) -> None:
    """Resharding: ASK while a slot migrates, MOVED once it has moved; the reader follows both."""
    with RedisCluster(3) as own:
        remote = remote_for(own, base)
        writer = RemoteTier(remote, max_block_bytes=1 << 20)
        reader = RemoteTier(remote, max_block_bytes=1 << 20)
        rc = client_for(own)
        try:
            blocks = [b for i in range(12) for b in chain(tokens(1000 + i, 1))]
            keys = [b.meta.key for b in blocks]
            writer.put_many(blocks)
            assert writer.flush(30)
            assert len(reader.get_many(keys)) == len(keys)  # the reader now holds the slot map
            src, dst = own.ports[0], own.ports[1]
            slots = sorted({rc.keyslot(reader.redis_key(k)) for k in keys
                            if rc.nodes_manager.get_node_from_slot(rc.keyslot(reader.redis_key(k))).port == src})
            assert slots
            for slot in slots:
                own.start_migration(slot, src, dst)
            assert reader.present_prefix(keys) == len(keys)  # ASK
            assert len(reader.get_many(keys)) == len(keys)
            for slot in slots:
                own.finish_migration(slot, dst)
            fetched = reader.get_many(keys)  # MOVED
            assert [f.meta.key for f in fetched] == keys
            assert_intact([Block(f.meta, f.payload.clone()) for f in fetched])
            assert reader.remote_counters()["verification_failures"] == 0
        finally:
            rc.close()
            writer.close()
            reader.close()


def test_a_tls_cluster_serves_the_remote_tier_to_a_daemon_that_trusts_its_ca(base) -> None:
    cert, key = f"{base}/cert.pem", f"{base}/key.pem"
    try:
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                        "-nodes", "-keyout", key, "-out", cert, "-days", "1", "-subj", "/CN=localhost",
                        "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"], check=True, capture_output=True,
                       timeout=30)
    except (FileNotFoundError, subprocess.CalledProcessError) as e:
        pytest.skip(f"openssl cannot make a test certificate: {e}")
    os.chmod(key, 0o644)  # redis-server reads it as this user
    with RedisCluster(3, tls_cert=cert, tls_key=key) as tls:
        blocks = chain(tokens(1100, 4))
        keys = [b.meta.key for b in blocks]
        trusting = RemoteTier(remote_for(tls, base, tls_ca_file=cert), max_block_bytes=1 << 20)
        try:
            assert tls.urls.startswith("rediss://")
            trusting.put_many(blocks)
            assert trusting.flush(30)
            assert_intact([Block(b.meta, b.payload.clone()) for b in trusting.get_many(keys)])
            assert trusting.remote_counters()["hits"] == 4
        finally:
            trusting.close()
        plain = RemoteTier(remote_for(tls, base, urls=tls.urls.replace("rediss://", "redis://"), timeout_ms=500),
                           max_block_bytes=1 << 20)  # a daemon that speaks plaintext to TLS nodes: misses
        try:
            assert plain.present_prefix(keys) == 0
            assert plain.remote_counters()["errors"] >= 1
        finally:
            plain.close()


def test_a_replica_that_takes_over_a_dead_primary_serves_its_blocks_within_two_seconds_of_failover(base) -> None:
    """Failover through a daemon with the default retry_after_s (2 s): misses while the primary is
    gone, and hits from the promoted replica within 2 s of the moment the cluster's own map names
    it (the daemon asks for the slot map again every 0.5 s while a shard is left alone)."""
    with RedisCluster(3, replicas=1) as own:
        remote = remote_for(own, base, retry_after_s=2.0)
        with running_server(box(base, "a", remote)) as (store_a, a_addr), \
                running_server(box(base, "b", remote)) as (store_b, b_addr), Client(a_addr) as a, Client(b_addr) as b:
            rc = client_for(own)
            singles, slot_of = put_singles(a, store_a, rc, 1200, 12)
            owner = [rc.nodes_manager.get_node_from_slot(slot).port for slot in slot_of]
            rc.close()
            victim = owner[0]
            on_victim = [c[0].meta.key for c, port in zip(singles, owner) if port == victim]
            deadline = time.monotonic() + 60
            while sum(int(own.cli(p, "dbsize") or 0) for p in own.procs) < 2 * len(singles):  # replicated
                assert time.monotonic() < deadline, "replicas did not catch up"
                time.sleep(0.05)
            own.kill_node(victim)
            killed = time.monotonic()
            failover = hits = None  # when a fresh client sees a replica own the slots; when B serves them
            while failover is None or hits is None:
                assert time.monotonic() < deadline, f"no failover ({failover}) or no hits ({hits}) in 60 s"
                if hits is None and b.lookup(on_victim[:1]) == ["remote"]:
                    hits = time.monotonic()
                if failover is None:
                    fresh = client_for(own)
                    try:
                        if fresh.nodes_manager.get_node_from_slot(slot_of[owner.index(victim)]).port != victim:
                            failover = time.monotonic()
                    except Exception:  # noqa: BLE001 - the cluster is electing
                        pass
                    fresh.close()
                time.sleep(0.05)
            print(f"failover {failover - killed:.2f} s after the kill; hits {hits - killed:.2f} s after it")
            assert hits - failover <= 2.0, (failover - killed, hits - killed)
            assert all(b.lookup([k]) in (["host"], ["remote"]) for k in on_victim)  # every block again
            store_b.check_integrity()


def test_a_single_node_serves_as_the_remote_tier(base) -> None:
    """remote.cluster = false: one plain Redis/Valkey node, no cluster."""
    from benchmarks.redis_cluster import free_ports

    server_bin, cli_bin = find_binaries() or ("redis-server", "redis-cli")
    port = free_ports(1)[0]
    node = subprocess.Popen([server_bin, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                             "no", "--dir", base], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while subprocess.run([cli_bin, "-p", str(port), "ping"], capture_output=True, text=True).stdout.strip() \
                != "PONG":
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)
        tier = RemoteTier(RemoteConfig(enabled=True, cluster=False, urls=f"redis://127.0.0.1:{port}", retry_after_s=600,
                                       secret_file=write_secret(os.path.join(base, "s"), SECRET)),
                          max_block_bytes=1 << 20)
        try:
            blocks = chain(tokens(1300, 5))
            keys = [b.meta.key for b in blocks]
            tier.put_many(blocks[:3])
            assert tier.flush(30)
            assert tier.present_prefix(keys) == 3
            assert_intact([Block(b.meta, b.payload.clone()) for b in tier.get_many(keys)])
            assert tier.clear() == 3 and tier.present_prefix(keys) == 0
            node.kill()
            node.wait(10)
            assert tier.present_prefix(keys) == 0 and tier.get_many(keys) == []  # misses, not errors
            assert tier.remote_counters()["errors"] == 1  # then left alone for retry_after_s
        finally:
            tier.close()
    finally:
        node.kill()
        node.wait(10)
