"""Isolation scenario: tokens on every rpc, tenants on every path, salted users; one check per function."""

from __future__ import annotations

import grpc
import pytest

from benchmarks.daemons import NS, chain, running_server, small_config, tokens
from benchmarks.reliability import intact
from tiercache.block import BlockMeta
from tiercache.client import CHANNEL_OPTIONS, Client
from tiercache.codec import encode_block
from tiercache.errors import NotFound, PermissionDenied, Unauthenticated
from tiercache.keys import Namespace
from tiercache.store import PutResult
from tiercache.tenancy import scope_keys
from tiercache.v1 import tiercache_pb2 as pb

TOKENS = {"tok-alice-0123456789": "alice", "tok-bob-0123456789": "bob"}
ALICE, BOB = "tok-alice-0123456789", "tok-bob-0123456789"
EMPTY = {"Lookup": pb.LookupRequest, "Prefetch": pb.PrefetchRequest, "Stats": pb.StatsRequest,
         "List": pb.ListRequest, "Flush": pb.FlushRequest, "Evict": pb.EvictRequest, "Pin": pb.PinRequest,
         "Unpin": pb.UnpinRequest, "Verify": pb.VerifyRequest, "Report": pb.ReportRequest,
         "Touch": pb.TouchRequest, "Commit": pb.CommitRequest, "Release": pb.ReleaseRequest}


def snapshot(store: object) -> list:
    return sorted((e.meta.key, e.tiers, e.pinned, e.hits) for e in store.entries())  # type: ignore[attr-defined]


def every_rpc(channel: grpc.Channel, metadata: tuple, keys: list[bytes], record: bytes,
              fresh: BlockMeta) -> dict[str, grpc.StatusCode]:
    """Status of each TierCache rpc called with `metadata`, each with a request that would do something."""
    out = {}
    for name, cls in EMPTY.items():
        request = cls(keys=keys) if "keys" in cls.DESCRIPTOR.fields_by_name else cls()
        if "reservation" in cls.DESCRIPTOR.fields_by_name:
            request = cls(reservation=1)
        try:
            channel.unary_unary(f"/tiercache.v1.TierCache/{name}", request_serializer=cls.SerializeToString)(
                request, timeout=10, metadata=metadata)
            out[name] = grpc.StatusCode.OK
        except grpc.RpcError as e:
            out[name] = e.code()
    for name, call in (("FetchShared", lambda: channel.unary_unary(
            "/tiercache.v1.TierCache/FetchShared", request_serializer=pb.FetchRequest.SerializeToString)(
            pb.FetchRequest(keys=keys), timeout=10, metadata=metadata)),
                       ("Fetch", lambda: list(channel.unary_stream(
            "/tiercache.v1.TierCache/Fetch", request_serializer=pb.FetchRequest.SerializeToString)(
            pb.FetchRequest(keys=keys), timeout=10, metadata=metadata))),
                       ("Put", lambda: channel.stream_unary(
            "/tiercache.v1.TierCache/Put", request_serializer=pb.PutRequest.SerializeToString)(
            iter([pb.PutRequest(record=record, last=True)]), timeout=10, metadata=metadata)),
                       ("PutBatch", lambda: channel.unary_unary(
            "/tiercache.v1.TierCache/PutBatch", request_serializer=pb.PutBatchRequest.SerializeToString)(
            pb.PutBatchRequest(requests=[pb.PutRequest(record=record, last=True)]), timeout=10, metadata=metadata)),
                       ("Reserve", lambda: channel.unary_unary(
            "/tiercache.v1.TierCache/Reserve", request_serializer=pb.ReserveRequest.SerializeToString)(
            pb.ReserveRequest(blocks=[fresh.to_wire(pb.BlockMeta)]), timeout=10, metadata=metadata))):
        try:
            call()
            out[name] = grpc.StatusCode.OK
        except grpc.RpcError as e:
            out[name] = e.code()
    return out


def check_every_rpc_refuses_a_missing_or_wrong_token_and_changes_nothing(base):
    config = small_config(base, listen="127.0.0.1:0", tokens=TOKENS)
    with running_server(config) as (store, address):
        blocks = chain(tokens(1, 4))
        keys = [b.meta.key for b in blocks]
        Client(address, token=ALICE).put(blocks)
        before = snapshot(store)
        channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        fresh_block = chain(tokens(2, 1))[0]
        fresh = encode_block(fresh_block)
        bad = [(), (("authorization", "Bearer"),), (("authorization", "Bearer "),),
               (("authorization", f"Bearer {ALICE.upper()}"),), (("authorization", f"Bearer {ALICE} "),),
               (("authorization", f"Bearer {ALICE[:-1]}"),), (("authorization", f"bearer{ALICE}"),),
               (("authorization", ALICE),), (("x-token", ALICE),)]
        for metadata in bad:
            codes = every_rpc(channel, metadata, keys, fresh, fresh_block.meta)
            assert set(codes.values()) == {grpc.StatusCode.UNAUTHENTICATED}, (metadata, codes)
        assert snapshot(store) == before, "an unauthenticated call changed the store"
        assert len(EMPTY) + 5 == len(pb.DESCRIPTOR.services_by_name["TierCache"].methods), "a new rpc is untested"
        channel.close()


def check_tenants_see_nothing_of_each_other_on_the_newer_paths_and_after_a_restart(base):
    config = small_config(base, listen="127.0.0.1:0", tokens=TOKENS)
    blocks = chain(tokens(3, 4))
    keys = [b.meta.key for b in blocks]
    with running_server(config) as (store, address):
        alice, bob = Client(address, token=ALICE), Client(address, token=BOB)
        alice.put(blocks, namespace=NS)
        alice_store_keys = [e.store_key for e in alice.list()]
        assert sorted(alice_store_keys) == sorted(scope_keys("alice", keys))
        before = snapshot(store)
        assert bob.fetch_store_keys(alice_store_keys) == []  # export path
        assert bob.verify(alice_store_keys).num_checked == 0
        assert bob.prefetch(keys) == 0 and bob.lookup(keys) == [] and bob.fetch(keys) == []
        with pytest.raises(PermissionDenied):
            bob.put(blocks, import_tenant="alice")
        with pytest.raises(PermissionDenied):
            bob.flush(tenant="alice")
        with pytest.raises(NotFound):
            bob.list(namespace=NS.digest())
        stats = bob.stats()
        assert stats.tenant == "bob" and stats.tenant_bytes == 0 and stats.tenants == []
        assert stats.lookups == 0 and stats.verification_failures == 0
        assert all(t.tenant_blocks == 0 and t.used_bytes == 0 and t.hits == 0 for t in stats.tiers)
        assert bob.listing().namespaces == [], "bob must not learn alice's namespace descriptions"
        assert snapshot(store) == before, "bob's calls changed alice's blocks"
        assert [b.meta.key for b in alice.fetch(keys)] == keys  # caching is on: the same tenant hits
        operator = Client(f"unix:{config.server.socket}")
        assert {t.tenant: t.num_blocks for t in operator.stats().tenants} == {"alice": 4}
    with running_server(config) as (store, address):  # a restart: the same answers, now from disk
        alice, bob = Client(address, token=ALICE), Client(address, token=BOB)
        assert alice.lookup(keys) == ["disk"] * 4 and intact(alice.fetch(keys))
        assert bob.lookup(keys) == [] and bob.list() == [] and bob.fetch_store_keys(alice_store_keys) == []


def check_salted_users_of_one_tenant_never_share_a_block(base):
    config = small_config(base, listen="127.0.0.1:0", tokens=TOKENS)
    with running_server(config) as (store, address):
        alice = Client(address, token=ALICE)
        prompt = tokens(4, 4)  # the same prompt, two users of the same application tenant
        user_a = chain(prompt, Namespace(**{**NS.to_dict(), "salt": "secret-of-user-a"}))
        user_b = chain(prompt, Namespace(**{**NS.to_dict(), "salt": "secret-of-user-b"}))
        keys_a, keys_b = [b.meta.key for b in user_a], [b.meta.key for b in user_b]
        assert not set(keys_a) & set(keys_b), "a salt must change every key, the first one included"
        assert alice.put(user_a) == [PutResult.STORED] * 4
        assert alice.lookup(keys_a) == ["host"] * 4, "the user's own prompt hits"
        assert alice.lookup(keys_b) == [] and alice.fetch(keys_b) == [], "another user's prompt misses"
        assert alice.put(user_b) == [PutResult.STORED] * 4, "no dedup across salts"
        assert len(alice.list()) == 8 and len({e.namespace for e in alice.list()}) == 2
        assert intact(alice.fetch(keys_a)) and intact(alice.fetch(keys_b))
        unsalted = chain(prompt)
        assert alice.lookup([b.meta.key for b in unsalted]) == [], "an unsalted caller cannot reach either"
        store.check_integrity()


def check_unauthenticated_and_cross_tenant_calls_give_no_error_detail_about_others(base):
    config = small_config(base, listen="127.0.0.1:0", tokens=TOKENS)
    with running_server(config) as (_, address):
        alice, bob = Client(address, token=ALICE), Client(address, token=BOB)
        alice.put(chain(tokens(5, 2)))
        alice_keys = [e.store_key for e in alice.list()]
        for call in (lambda: bob.pin(store_keys=alice_keys), lambda: bob.list(namespace=NS.digest())):
            with pytest.raises(NotFound) as refused:
                call()
            assert "alice" not in str(refused.value) and alice_keys[0].hex() not in str(refused.value)
        with pytest.raises(Unauthenticated) as refused:
            Client(address, token="tok-alice-012345678").stats()
        assert "alice" not in str(refused.value) and "tok-alice" not in str(refused.value)
