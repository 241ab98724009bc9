"""Service round trips through the real client against an in-process daemon: every tier, every rpc."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import threading
import time

import grpc
import pytest

from benchmarks.daemons import NS, assert_intact, chain, open_store, running_server, small_config, tokens
from tiercache.client import Client
from tiercache.errors import DeadlineExceeded, InvalidArgument, NotFound, QuotaExceeded, Unauthenticated, Unavailable
from tiercache.keys import Namespace
from tiercache.store import PutResult, TieredStore
from tiercache.tenancy import LOCAL_TENANT, scope_keys
from tiercache.v1 import tiercache_pb2 as pb


def test_round_trip_host_then_disk_both_paths(base):
    config = small_config(base)
    with running_server(config) as (store, address), Client(address) as client:
        blocks = chain(tokens(1, 8))
        keys = [b.meta.key for b in blocks]
        assert client.put(blocks) == [PutResult.STORED] * 8
        assert client.put(blocks[:3]) == [PutResult.ALREADY_PRESENT] * 3
        assert client.lookup(keys) == ["host"] * 8
        for shared_memory in (True, False):
            got = client.fetch(keys, shared_memory=shared_memory)
            assert [b.meta.key for b in got] == keys
            assert_intact(got)
            assert got[3].meta.parent == keys[2] and got[0].meta.parent == b""
            assert got[0].meta.tenant == "" and got[0].meta.checksum == blocks[0].meta.checksum
        # A miss in the middle ends the prefix on both paths.
        assert client.evict(keys[5:6]) == 1
        assert client.lookup(keys) == ["host"] * 5
        assert len(client.fetch(keys)) == 5 and len(client.fetch(keys, shared_memory=False)) == 5
        # Disk tier: drop the host copies; both paths read disk (the slab path promotes first).
        assert client.flush(tier="host") == 7
        assert client.lookup(keys[:5]) == ["disk"] * 5
        assert_intact(client.fetch(keys[:5], shared_memory=False))
        got = client.fetch(keys[:5], shared_memory=True)
        assert len(got) == 5
        assert_intact(got)
        assert client.lookup(keys[:5]) == ["host"] * 5
        store.check_integrity()


def test_a_lookup_asked_again_answers_for_the_store_as_it_is_now(base):
    # The daemon remembers a Lookup's store keys by the request's bytes; never its answer.
    config = small_config(base)
    with running_server(config) as (store, address), Client(address, shared_memory=False) as rpc:
        blocks = chain(tokens(2, 8))
        keys = [b.meta.key for b in blocks]
        assert rpc.lookup(keys) == []
        assert rpc.put(blocks) == [PutResult.STORED] * 8
        assert rpc.lookup(keys) == rpc.lookup(keys) == ["host"] * 8
        assert rpc.evict(keys[5:6]) == 1
        assert rpc.lookup(keys) == ["host"] * 5
        assert rpc.flush(tier="host") == 7
        assert rpc.lookup(keys) == ["disk"] * 5
        for _ in range(2):  # a bad request is refused every time, not remembered
            with pytest.raises(InvalidArgument, match="keys\\[1\\] is 5 bytes"):
                rpc.lookup([keys[0], b"short"])
        store.check_integrity()


def test_a_probe_is_answered_like_a_lookup_but_left_out_of_the_lookup_statistics(base):
    # A writer checking whether a block is stored already is not a request's lookup: counted, it
    # would move the hit rate the operator reads. Both paths: the Lookup rpc and the shared index.
    config = small_config(base)
    with running_server(config) as (store, address):
        blocks = chain(tokens(3, 4))
        keys = [b.meta.key for b in blocks]
        with Client(address, shared_memory=False) as rpc:
            rpc.put(blocks)
            before = store.snapshot_counters()
            assert rpc.lookup(keys, probe=True) == ["host"] * 4 and rpc.lookup([b"\1" * 32], probe=True) == []
            assert store.snapshot_counters().get("lookups", 0) == before.get("lookups", 0)
            assert rpc.lookup(keys) == ["host"] * 4
            assert store.snapshot_counters().get("lookups", 0) == before.get("lookups", 0) + 1
        with Client(address) as local:  # tokenless, same host: answered from the shared index
            assert local.lookup(keys, probe=True) == ["host"] * 4 and local.lookup([b"\1" * 32], probe=True) == []
        after = store.snapshot_counters()  # the client's close sent whatever it had to count
        assert after.get("lookups", 0) == before.get("lookups", 0) + 1
        assert after.get("lookup_blocks_hit", 0) == before.get("lookup_blocks_hit", 0) + 4
        with Client(address) as local:
            assert local.lookup(keys) == ["host"] * 4
        assert store.snapshot_counters().get("lookups", 0) == before.get("lookups", 0) + 2  # the control: counted
        store.check_integrity()


def test_round_trip_gpu_tier_on_a_cpu_pool(base):
    config = small_config(base, gpu_pages=16)
    with running_server(config, open_store(config)) as (store, address), Client(address) as client:
        blocks = chain(tokens(2, 4))
        keys = [b.meta.key for b in blocks]
        client.put(blocks)
        for _ in range(config.gpu.promote_after_hits):
            assert_intact(client.fetch(keys, shared_memory=False))
        # Asked of the daemon: the client's shared index (mapped by its staged put) knows only host.
        with Client(address, shared_memory=False) as remote:
            assert remote.lookup(keys) == ["gpu"] * 4
        got = client.fetch(keys, shared_memory=False)  # served from the gpu pool
        assert len(got) == 4
        assert_intact(got)
        assert_intact(client.fetch(keys, shared_memory=True))
        usage = {t.tier: t for t in client.stats().tiers}
        assert usage["gpu"].tenant_blocks == 4 and usage["gpu"].hits >= 4
        store.check_integrity()


def test_admin_rpcs_list_stats_pin_flush_verify(base):
    config = small_config(base)
    other = Namespace(**{**NS.to_dict(), "salt": "other"})
    with running_server(config) as (store, address), Client(address) as client:
        a, b = chain(tokens(3, 4)), chain(tokens(3, 2), ns=other)
        client.put(a, ttl_s=600)
        client.put(b, pin=True)
        listed = client.list()
        assert len(listed) == 6
        by_ns = {e.namespace for e in listed}
        assert by_ns == {NS.digest(), other.digest()}
        assert all(e.pinned for e in listed if e.namespace == other.digest())
        assert all(e.expires_at > time.time() for e in listed if e.namespace == NS.digest())
        assert len(client.list(namespace=other.digest())) == 2 and len(client.list(limit=3)) == 3
        # List shows store keys (tenant-scoped) with the chain's parent links, and Pin accepts them.
        spec = lambda key: hashlib.blake2b(b"tiercache.tenant.v1\0local\0" + key, digest_size=32).digest()  # noqa: E731
        assert {e.store_key for e in listed} == {spec(x.meta.key) for x in a + b}  # the proto's formula
        heads = [e for e in listed if e.parent_store_key == b""]
        assert len(heads) == 2
        assert client.pin(store_keys=[heads[0].store_key]) == 1
        assert client.unpin([x.meta.key for x in b]) == 2
        assert client.unpin([x.meta.key for x in b]) == 0  # only a pin that was there counts
        stats = client.stats()
        assert stats.tenant == "local" and stats.tenant_bytes == 6 * 4096
        host = next(t for t in stats.tiers if t.tier == "host")
        assert host.tenant_blocks == 6 and host.used_bytes == 6 * 4096 and host.puts == 6
        assert client.prefetch([x.meta.key for x in a]) == 0  # already in host
        client.flush(tier="host")
        assert client.prefetch([x.meta.key for x in a]) == 4
        assert client.lookup([x.meta.key for x in a]) == ["host"] * 4
        assert client.flush(namespace=other.digest()) == 2
        with pytest.raises(NotFound, match="namespace"):
            client.flush(namespace=other.digest())
        report = client.verify()
        assert report.integrity_ok and report.num_failed == 0 and report.num_checked >= 4
        assert client.health() == "SERVING"
        store.check_integrity()


def test_concurrent_puts_never_take_a_tenant_over_its_quota(base):
    """Eight callers at once, each putting 2 new blocks, against a quota of 5 blocks: the check and
    the store are one step per tenant, so at most 2 callers get in (before: each could pass the check)."""
    config = small_config(base, host_pages=64, tenant_quota_bytes=5 * 4096)
    with running_server(config) as (store, address):
        clients = [Client(address) for _ in range(8)]
        stored, refused = [], []
        barrier = threading.Barrier(len(clients))

        def put(i: int) -> None:
            blocks = chain(tokens(100 + i, 2))
            barrier.wait()
            try:
                stored.append(clients[i].put(blocks))
            except QuotaExceeded:
                refused.append(i)

        threads = [threading.Thread(target=put, args=(i,)) for i in range(len(clients))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(stored) == 2 and len(refused) == 6, (stored, refused)
        assert store.tenant_bytes("local") == 4 * 4096
        for client in clients:
            client.close()
        store.check_integrity()


def test_quota_and_deadline_change_nothing(base):
    config = small_config(base, tenant_quota_bytes=3 * 4096)
    with running_server(config) as (store, address), Client(address) as client:
        blocks = chain(tokens(4, 4))
        assert client.put(blocks[:3]) == [PutResult.STORED] * 3
        with pytest.raises(QuotaExceeded, match="quota"):
            client.put(blocks)
        assert client.put(blocks[:3]) == [PutResult.ALREADY_PRESENT] * 3  # re-puts cost no quota
        assert len(client.lookup([b.meta.key for b in blocks])) == 3
        # A Put that outlives its deadline stores none of its records.
        client.flush()
        slow_blocks = chain(tokens(5, 3))

        def slow():
            for i, block in enumerate(slow_blocks):
                if i == 2:
                    time.sleep(0.6)
                from tiercache.codec import encode_block
                yield pb.PutRequest(record=encode_block(block), last=i == len(slow_blocks) - 1)

        with pytest.raises(grpc.RpcError) as failed:
            client._stub.Put(slow(), timeout=0.3)  # the raw stub: the client would batch eagerly
        assert failed.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        # A call that cannot finish within its deadline (the store is held here) raises DeadlineExceeded.
        # (A 100 us deadline is not enough: gRPC lets a fast enough call complete about half the time.)
        with store._lock, Client(address, timeout_s=0.05) as hurried:
            with pytest.raises(DeadlineExceeded):
                hurried.fetch([b.meta.key for b in blocks])
        time.sleep(0.5)  # room for the Put past its deadline to store something, if it wrongly would
        assert client.lookup([b.meta.key for b in slow_blocks]) == []
        store.check_integrity()


def test_tenants_are_isolated_over_tcp_with_tokens(base):
    config = small_config(base, listen="127.0.0.1:0", tokens={"tok-alice": "alice", "tok-bob": "bob"})
    with running_server(config) as (store, address):
        assert not address.startswith("unix:")
        alice, bob = Client(address, token="tok-alice"), Client(address, token="tok-bob")
        local = Client(f"unix:{config.server.socket}")
        blocks = chain(tokens(6, 4))
        keys = [b.meta.key for b in blocks]
        assert alice.put(blocks) == [PutResult.STORED] * 4
        # Caching is on for alice (same-tenant hit) while bob and the local tenant miss.
        assert alice.lookup(keys) == ["host"] * 4
        assert_intact(alice.fetch(keys))  # TCP: bytes, whatever the flag says
        assert alice.fetch(keys, shared_memory=True)[0].meta.key == keys[0]
        assert bob.lookup(keys) == [] and bob.fetch(keys) == [] and local.lookup(keys) == []
        assert bob.list() == [] and bob.stats().tenant_bytes == 0
        assert bob.put(blocks) == [PutResult.STORED] * 4  # same client keys, separate store keys
        assert len({e.store_key for e in alice.list()} & {e.store_key for e in bob.list()}) == 0
        # Bob can neither pin, evict nor flush alice's blocks, even naming her store keys.
        alice_store_keys = [e.store_key for e in alice.list()]
        with pytest.raises(NotFound):
            bob.pin(store_keys=alice_store_keys)
        assert bob.evict(store_keys=alice_store_keys) == 0
        assert bob.flush() == 4
        assert alice.lookup(keys) == ["host"] * 4
        stats = alice.stats()
        assert stats.tenant == "alice" and stats.tiers[0].used_bytes == 0  # aggregates are local-only
        for client in (Client(address), Client(address, token="nope")):
            with pytest.raises(Unauthenticated):
                client.lookup(keys)
        assert Client(address).health() == "SERVING"  # probes need no token
        store.check_integrity()


def test_tls_listener_requires_trusted_certificate(base):
    cert, key = f"{base}/cert.pem", f"{base}/key.pem"
    try:
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                        "-nodes", "-keyout", key, "-out", cert, "-days", "1", "-subj", "/CN=localhost",
                        "-addext", "subjectAltName=DNS:localhost"], check=True, capture_output=True, timeout=30)
    except (FileNotFoundError, subprocess.CalledProcessError) as e:
        pytest.skip(f"openssl cannot make a test certificate: {e}")
    config = small_config(base, listen="localhost:0", tokens={"t": "tls-tenant"}, tls_cert=cert, tls_key=key)
    with running_server(config) as (_, address):
        port = address.rpartition(":")[2]
        secure = Client(f"localhost:{port}", token="t", tls_root_cert=cert)
        blocks = chain(tokens(7, 2))
        assert secure.put(blocks) == [PutResult.STORED] * 2
        assert_intact(secure.fetch([b.meta.key for b in blocks]))
        with pytest.raises(Unavailable, match="if the daemon listens with TLS, give its CA certificate"):
            Client(f"localhost:{port}", token="t", timeout_s=2).lookup([blocks[0].meta.key])


def test_torn_slab_read_is_refetched_never_returned(base):
    """Pages recycled between the daemon's descriptor and the client's copy: the client must notice."""

    class RacingStore(TieredStore):
        victims: list = []

        def locate_host(self, keys):
            located = super().locate_host(keys)
            # Another worker's traffic lands right after the descriptors are made: the located
            # blocks leave host and their pages are rewritten with other blocks' bytes.
            self.flush(tier="host")
            self.put_many(self.victims)
            return located

    config = small_config(base)
    with running_server(config, RacingStore.open(config)) as (store, address), Client(address) as client:
        blocks = chain(tokens(8, 4))
        keys = [b.meta.key for b in blocks]
        # With a TTL the blocks stay out of the shared index: the fetch takes the daemon's descriptors.
        client.put(blocks, ttl_s=600)
        RacingStore.victims = [b for b in chain(tokens(9, 4))]
        got = client.fetch(keys)  # every descriptor is stale: all four come again as bytes from disk
        assert client.num_refetched == 4
        assert [b.meta.key for b in got] == keys
        assert_intact(got)
        client.evict(keys[2:])  # now the refetch misses from block 2 on: a shorter prefix, not bad bytes
        RacingStore.victims = chain(tokens(10, 4))
        got = client.fetch(keys)
        assert [b.meta.key for b in got] == keys[:2]
        assert_intact(got)
        store.check_integrity()


def test_fetch_views_are_slab_views_until_the_daemon_recycles_their_pages(base):
    config = small_config(base, listen="127.0.0.1:0", tokens={"tok-a": "alice"})
    with running_server(config) as (store, tcp_address), Client(f"unix:{config.server.socket}") as client:
        blocks = chain(tokens(11, 4))
        keys = [b.meta.key for b in blocks]
        client.put(blocks)
        views = client.fetch_views(keys)
        assert_intact(views)
        slab = client._slab.reader(pb.SlabInfo(path=store.host.slab_path))
        first_page = slab._pool.flat.data_ptr()
        inside = [first_page <= b.payload.data_ptr() < first_page + slab._pool.flat.numel() for b in views]
        assert inside == [True] * 4, "fetch_views copied blocks instead of viewing the slab"
        assert views.still_valid()
        copies = client.fetch(keys)
        assert not any(first_page <= b.payload.data_ptr() < first_page + slab._pool.flat.numel() for b in copies)
        client.evict(keys[1:2])
        client.put(chain(tokens(12, 4)))  # other blocks take the freed pages
        assert not views.still_valid()  # what was read from the views must be discarded now
        with Client(f"unix:{config.server.socket}", shared_memory=False) as like_remote:
            copies = like_remote.fetch_views(keys)  # bytes over the stream, as across a network
            assert_intact(copies)
            assert copies.still_valid()
            assert like_remote.lookup(keys) == client.lookup(keys) == ["host"]  # block 1 left above
            assert like_remote._slab.index is None and like_remote.num_local == 0
        with Client(tcp_address, token="tok-a") as remote:
            remote.put(blocks[:1])
            over_tcp = remote.fetch_views(keys[:1])
            assert len(over_tcp) == 1 and over_tcp.still_valid()  # TCP: copies, always valid
            assert_intact(over_tcp)
        store.check_integrity()


def test_local_reads_through_the_shared_index_and_touch_keeps_them_hot(base):
    """A tokenless Unix client finds host blocks in the daemon's index without a call; its Touch
    calls then keep them in the daemon's LRU order, so new blocks evict the chain nobody read."""
    config = small_config(base, host_pages=24)  # room for three chains of 8 pages in host
    with running_server(config) as (store, address), Client(address) as client:
        hot, cold = chain(tokens(21, 8)), chain(tokens(22, 8))
        hot_keys, cold_keys = [b.meta.key for b in hot], [b.meta.key for b in cold]
        client.put(hot)  # a staged put: maps the slab and the index
        client.put(cold)  # cold is now the most recently used
        hits_before = store.counters["hits_host"]
        for _ in range(3):
            got = client.fetch_views(hot_keys)
            assert [b.meta for b in got] == [b.meta for b in hot]
            assert_intact(got)
            assert got.still_valid()
        assert client.num_local == 3
        absent = chain(tokens(29, 1))[0].meta.key
        calls = client._stub.Lookup
        client._stub.Lookup = None  # answered from the index and presence filter: no call at all
        assert client.lookup(hot_keys) == ["host"] * 8
        assert client.lookup(hot_keys + [absent]) == ["host"] * 8
        assert client.lookup([absent]) == []
        client._stub.Lookup = calls
        assert client.lookup(cold_keys) == ["host"] * 8
        client.send_touches()  # they go out on the client's own thread, a moment later: now
        assert store.counters["hits_host"] >= hits_before + 8
        client.put(chain(tokens(23, 8)))  # needs room in host: the LRU chain leaves it
        in_host = lambda keys: sum("host" in e.tiers for e in store.entries() if e.meta.key in set(keys))  # noqa: E731
        scoped = lambda keys: [scope_keys(LOCAL_TENANT, [k])[0] for k in keys]  # noqa: E731
        assert in_host(scoped(hot_keys)) == 8, "the chain read through the index was evicted"
        assert in_host(scoped(cold_keys)) < 8
        assert client.fetch_views(cold_keys).still_valid()  # partly on disk now: served by the daemon
        store.check_integrity()


def test_create_server_without_a_store_owns_it_until_termination(base):
    from server.app import create_server
    from server.instance import DataDirLock
    from tiercache.errors import AlreadyRunning

    config = small_config(base)
    server, address = create_server(config)
    server.start()
    blocks = chain(tokens(11, 3))
    assert Client(address).put(blocks) == [PutResult.STORED] * 3
    with pytest.raises(AlreadyRunning):
        DataDirLock(config.data_dir)
    with pytest.raises(AlreadyRunning):
        create_server(dataclasses.replace(config, data_dir=f"{base}/other"))  # same socket
    server.stop(2).wait()
    deadline = time.monotonic() + 10
    while True:  # the store, the lock and the socket are released right after termination
        try:
            DataDirLock(config.data_dir).release()
            break
        except AlreadyRunning:
            assert time.monotonic() < deadline, "create_server kept the data directory after stopping"
            time.sleep(0.05)
    assert not os.path.exists(config.server.socket)
    with running_server(config) as (_, address):  # everything was committed to disk before close
        assert Client(address).lookup([b.meta.key for b in blocks]) == ["disk"] * 3


def test_a_small_put_goes_as_one_put_batch_a_big_one_streams_and_an_older_daemon_gets_the_stream(base, monkeypatch):
    from concurrent import futures

    from test_metrics import free_port, scrape, value

    from server.auth import Activity, AuthInterceptor
    from server.metrics import DaemonMetrics
    from server.namespaces import NamespaceRegistry
    from server.servicer import TierCacheServicer
    from tiercache.client import put as client_module
    from tiercache.v1 import tiercache_pb2_grpc as pb_grpc

    port = free_port()
    config = small_config(base, metrics_port=port)
    small, big = chain(tokens(12, 3)), chain(tokens(13, 4))
    monkeypatch.setattr(client_module, "PUT_ONE_MESSAGE_BYTES", 3 * small[0].meta.nbytes)  # `big` is over it
    with running_server(config) as (store, address):
        client = Client(address, shared_memory=False)  # payloads in the messages (a staged put is one PutBatch)
        assert client.put(small, namespace=NS) == [PutResult.STORED] * 3
        assert client.put(big) == [PutResult.STORED] * 4
        assert client.put(small) == [PutResult.ALREADY_PRESENT] * 3
        samples = scrape(port)
        assert value(samples, "tiercache_rpc_duration_seconds_count", method="PutBatch") == 2
        assert value(samples, "tiercache_rpc_duration_seconds_count", method="Put") == 1
        assert_intact(client.fetch([b.meta.key for b in small]))
        assert_intact(client.fetch([b.meta.key for b in big]))
        assert any(e.meta.namespace == NS.digest() for e in store.entries())

    class OlderDaemon(grpc.ServerInterceptor):
        """The real servicer behind a server that does not know PutBatch, as a daemon before it, until
        `upgraded` (nor puts in place, which came later still); `served` names the Put rpcs it let through."""

        upgraded = False
        served: list[str] = []

        def intercept_service(self, continuation, details):
            name = details.method.rsplit("/", 1)[1]
            if (name == "PutBatch" and not self.upgraded) or name in ("Reserve", "Commit", "Release"):
                return None
            if name.startswith("Put"):
                self.served.append(name)
            return continuation(details)

    daemon = OlderDaemon()
    store = open_store(small_config(base))
    server = grpc.server(futures.ThreadPoolExecutor(4), interceptors=[daemon, AuthInterceptor({}, Activity())])
    pb_grpc.add_TierCacheServicer_to_server(
        TierCacheServicer(store, config, NamespaceRegistry(config.data_dir), DaemonMetrics(store).reports), server)
    server.add_insecure_port(f"unix:{config.server.socket}")
    server.start()
    try:
        client = Client(f"unix:{config.server.socket}")
        fresh = chain(tokens(14, 2))
        assert client.put(fresh) == [PutResult.STORED] * 2  # UNIMPLEMENTED, then the same blocks streamed
        assert client.put(chain(tokens(15, 1))) == [PutResult.STORED]
        assert_intact(client.fetch([b.meta.key for b in fresh]))
        assert daemon.served == ["Put", "Put"], "after UNIMPLEMENTED the client streams without asking again"
        # The daemon is upgraded under the running client: once the retry interval has passed, it
        # uses PutBatch again.
        daemon.upgraded = True
        assert client.put(chain(tokens(17, 1))) == [PutResult.STORED]
        assert daemon.served[-1] == "Put", "still within the retry interval"
        monkeypatch.setattr(client, "_put_batch_after", time.monotonic() - 1)  # the interval has passed
        assert client.put(chain(tokens(18, 1))) == [PutResult.STORED]
        assert daemon.served[-1] == "PutBatch"
    finally:
        server.stop(1).wait()
        store.close()


def test_request_reports_go_with_touch_and_an_older_daemon_gets_report_calls(base, monkeypatch):
    from concurrent import futures

    from test_metrics import free_port, scrape, value

    from server.auth import Activity, AuthInterceptor
    from server.metrics import DaemonMetrics
    from server.namespaces import NamespaceRegistry
    from server.servicer import TierCacheServicer
    from tiercache.v1 import tiercache_pb2_grpc as pb_grpc

    def report(client: Client, n: int) -> None:
        for i in range(n):
            client.report(prompt_tokens=100 + i, cached_tokens=64, ttft_s=0.02, prefill_s=0.01)

    port = free_port()
    config = small_config(base, metrics_port=port)
    with running_server(config) as (_, address), Client(address) as admin:
        client = Client(address)
        with pytest.raises(InvalidArgument, match="cached_tokens 5"):
            client.report(prompt_tokens=4, cached_tokens=5, ttft_s=0.1, prefill_s=0.1)
        with pytest.raises(InvalidArgument, match="ttft_s"):
            client.report(prompt_tokens=4, cached_tokens=2, ttft_s=float("nan"), prefill_s=0.1)
        report(client, 5)
        client.close()  # sends what is pending
        assert admin.stats().requests_reported == 5
        samples = scrape(port)
        assert value(samples, "tiercache_requests_total") == 5
        assert value(samples, "tiercache_tokens_reused_total") == 5 * 64
        assert value(samples, "tiercache_rpc_duration_seconds_count", method="Report") == 0
        assert 1 <= value(samples, "tiercache_rpc_duration_seconds_count", method="Touch") <= 2  # a round or two
        # One bad report refuses the whole Touch: nothing of it counted.
        good = pb.ReportRequest(prompt_tokens=4, cached_tokens=2, computed_tokens=2)
        with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as refused:
            channel.unary_unary("/tiercache.v1.TierCache/Touch")(pb.TouchRequest(
                reports=[good, pb.ReportRequest(prompt_tokens=4, cached_tokens=2, computed_tokens=1)],
                lookup_calls=1, lookup_blocks=1).SerializeToString())
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "reports[1].cached_tokens" in refused.value.details()
        after = admin.stats()
        assert after.requests_reported == 5 and after.lookups == 0

    class OlderServicer(TierCacheServicer):
        """A daemon from before TouchRequest.reports: it never reads the field (num_reported stays 0)."""

        def Touch(self, request, context):
            request.ClearField("reports")
            return super().Touch(request, context)

    class NoTouch(grpc.ServerInterceptor):
        """While `on`: a daemon from before Touch itself (UNIMPLEMENTED)."""

        on = False

        def intercept_service(self, continuation, details):
            return None if self.on and details.method.endswith("/Touch") else continuation(details)

    older = NoTouch()
    store = open_store(small_config(base))
    server = grpc.server(futures.ThreadPoolExecutor(4), interceptors=[older, AuthInterceptor({}, Activity())])
    metrics = DaemonMetrics(store)
    pb_grpc.add_TierCacheServicer_to_server(
        OlderServicer(store, config, NamespaceRegistry(config.data_dir), metrics.reports), server)
    server.add_insecure_port(f"unix:{config.server.socket}")
    server.start()
    try:
        client = Client(f"unix:{config.server.socket}")
        report(client, 3)
        deadline = time.monotonic() + 5
        while metrics.reports.total("requests") < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert metrics.reports.total("requests") == 3, "the reports the older daemon ignored went again with Report"
        report(client, 1)  # within REPORT_RETRY_S: a Report call at once
        assert metrics.reports.total("requests") == 4
        monkeypatch.setattr(client._toucher, "_reports_after", time.monotonic() - 1)  # the interval has passed
        report(client, 1)
        assert metrics.reports.total("requests") == 4, "queued for the next Touch again"
        client.close()
        assert metrics.reports.total("requests") == 5
        older.on = True  # older still: no Touch at all
        client = Client(f"unix:{config.server.socket}")
        report(client, 2)
        client.close()
        assert metrics.reports.total("requests") == 7, "UNIMPLEMENTED Touch: the reports went with Report"
    finally:
        server.stop(1).wait()
        store.close()


def test_a_put_whose_one_message_is_over_the_daemons_limit_goes_over_the_stream(base):
    from tiercache import wire
    from tiercache.codec import plain_record_parts

    blocks = chain(tokens(16, 40))
    payload = sum(b.meta.nbytes for b in blocks)
    framed = len(wire.put_batch([(plain_record_parts(b), pb.PutRequest(last=True).SerializeToString())
                                 for b in blocks]))
    budget = (payload + framed) // 2  # the payloads fit the daemon's budget, the one message does not
    assert payload <= budget < framed
    with running_server(small_config(base, max_message_bytes=budget)) as (store, address):
        client = Client(address)
        assert client.put(blocks) == [PutResult.STORED] * len(blocks)
        assert_intact(client.fetch([b.meta.key for b in blocks]))
        assert client._put_batch_after == 0.0, "a message over the limit is no reason to stop using PutBatch"
