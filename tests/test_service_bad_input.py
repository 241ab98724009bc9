"""Hostile and malformed calls each get a precise status code, change nothing, and the daemon stays up."""

from __future__ import annotations

import json
import random

import grpc

from benchmarks.daemons import NS, assert_intact, chain, running_server, small_config, tokens
from tiercache.client import CHANNEL_OPTIONS, Client
from tiercache.codec import FORMAT, encode_block
from tiercache.layout import CHECKSUM_ALG
from tiercache.v1 import tiercache_pb2 as pb
from tiercache.wire import field

C = grpc.StatusCode
SERVICE = "/tiercache.v1.TierCache/"
STREAM_IN = {"Put"}
STREAM_OUT = {"Fetch"}


def call(channel: grpc.Channel, method: str, payload, metadata=()) -> tuple[grpc.StatusCode, str]:
    """Send raw request bytes (a list of messages for Put); the status code and details."""
    path = SERVICE + method
    try:
        if method in STREAM_IN:
            channel.stream_unary(path)(iter(payload), timeout=30, metadata=metadata)
        elif method in STREAM_OUT:
            list(channel.unary_stream(path)(payload, timeout=30, metadata=metadata))
        else:
            channel.unary_unary(path)(payload, timeout=30, metadata=metadata)
    except grpc.RpcError as e:
        return e.code(), e.details() or ""
    return C.OK, ""


def forged(meta: dict, data: bytes, *, offsets: list[int] | None = None) -> bytes:
    """A record with a hand-written header: what a buggy or hostile client could send."""
    metadata = {"format": FORMAT, "checksum_alg": CHECKSUM_ALG, "compression": "none",
                "meta": json.dumps(meta)}
    header = {"__metadata__": metadata, "kv": {"dtype": "F16", "shape": meta["shape"],
                                               "data_offsets": offsets or [0, len(data)]}}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + data


def put(*records: bytes, last: bool = True, **fields) -> list[bytes]:
    """Serialized PutRequests; the final one marked last unless told otherwise."""
    return [pb.PutRequest(record=r, last=last and i == len(records) - 1, **fields).SerializeToString()
            for i, r in enumerate(records)]


def batch(requests: list[bytes]) -> bytes:
    """The same PutRequests as one PutBatchRequest (the messages of a Put in one message)."""
    return b"".join(field(b"\x0a", r) for r in requests)


def snapshot(store) -> list:
    return sorted((e.meta.key, e.tiers, e.pinned) for e in store.entries())



def test_malformed_and_hostile_calls(base):
    config = small_config(base, listen="127.0.0.1:0", tokens={"tok-a": "alice", "tok-b": "bob"},
                          max_message_bytes=40 << 20)
    with running_server(config) as (store, tcp_address):
        unix = grpc.insecure_channel(f"unix:{config.server.socket}", options=CHANNEL_OPTIONS)
        tcp = grpc.insecure_channel(tcp_address, options=CHANNEL_OPTIONS)
        alice = Client(tcp_address, token="tok-a")
        good = chain(tokens(40, 6))
        keys = [b.meta.key for b in good]
        alice.put(good)
        Client(f"unix:{config.server.socket}").put(good)
        record = encode_block(good[0])
        fresh = chain(tokens(41, 3))
        fresh_records = [encode_block(b) for b in fresh]
        meta = good[0].meta.to_dict()
        flipped = bytearray(record)
        flipped[-7] ^= 0x10
        size_lie = record.replace(b'\\"nbytes\\":4096', b'\\"nbytes\\":8192')
        assert size_lie != record
        huge_shape = [4096, 2, 1024, 16, 1024]
        huge = {**meta, "shape": huge_shape, "nbytes": 4096 * 2 * 1024 * 16 * 1024 * 2}
        big = {**meta, "shape": [2, 2, 2, 16, 8192], "nbytes": 2 << 20}  # honest, but over max_block_bytes
        short_key = {**meta, "key": meta["key"][:62]}
        bearer = lambda token: (("authorization", token),)  # noqa: E731
        lookup = lambda ks: pb.LookupRequest(keys=ks).SerializeToString()  # noqa: E731
        before = snapshot(store)

        cases = [
            ("key too short", unix, "Lookup", lookup([b"k" * 31]), (), C.INVALID_ARGUMENT, "keys[0] is 31 bytes"),
            ("key too long", unix, "Fetch", pb.FetchRequest(keys=keys[:2] + [b"k" * 33]).SerializeToString(), (),
             C.INVALID_ARGUMENT, "keys[2] is 33 bytes"),
            # Over 2 x max_keys_per_call + 16 fields, a request is refused before it is parsed (a
            # message of millions of tiny entries costs 16-48x its size to parse); under, by count.
            ("10^6 keys", unix, "Fetch", pb.FetchRequest(keys=[b"\1" * 32] * 10**6).SerializeToString(), (),
             C.INVALID_ARGUMENT, "more than 131088 fields"),
            ("FetchShared 10^6 keys", unix, "FetchShared",
             pb.FetchRequest(keys=[b"\1" * 32] * 10**6).SerializeToString(), (), C.INVALID_ARGUMENT,
             "more than 131088 fields"),
            ("Touch 10^6 keys", unix, "Touch", pb.TouchRequest(keys=[b"\1" * 32] * 10**6).SerializeToString(), (),
             C.INVALID_ARGUMENT, "more than 131088 fields"),
            ("PutBatch of 10^7 empty requests", unix, "PutBatch", b"\x0a\x00" * 10**7, (), C.INVALID_ARGUMENT,
             "more than 131088 fields"),
            ("the same without a token over tcp", tcp, "PutBatch", b"\x0a\x00" * 10**7, (), C.UNAUTHENTICATED,
             "Bearer"),
            ("70,000 keys", unix, "Fetch", pb.FetchRequest(keys=[b"\1" * 32] * 70_000).SerializeToString(), (),
             C.INVALID_ARGUMENT, "70000 keys"),
            ("Touch short key", unix, "Touch", pb.TouchRequest(keys=[b"k" * 7]).SerializeToString(), (),
             C.INVALID_ARGUMENT, "keys[0] is 7 bytes"),
            ("Touch with a bad report", unix, "Touch", pb.TouchRequest(keys=keys[:2], reports=[
                pb.ReportRequest(prompt_tokens=4, cached_tokens=2, computed_tokens=2),
                pb.ReportRequest(prompt_tokens=4, cached_tokens=2, computed_tokens=1)]).SerializeToString(), (),
             C.INVALID_ARGUMENT, "reports[1].cached_tokens"),
            ("Touch with a NaN ttft", unix, "Touch", pb.TouchRequest(reports=[pb.ReportRequest(ttft_s=float("nan"))])
             .SerializeToString(), (), C.INVALID_ARGUMENT, "reports[0].ttft_s"),
            ("FetchShared store keys", unix, "FetchShared", pb.FetchRequest(store_keys=keys[:1]).SerializeToString(),
             (), C.INVALID_ARGUMENT, "store_keys"),
            ("FetchShared over tcp", tcp, "FetchShared", pb.FetchRequest(keys=keys).SerializeToString(),
             bearer("Bearer tok-a"), C.INVALID_ARGUMENT, "Unix socket"),
            ("not a message", unix, "Lookup", b"\xff\xff\xff\xff", (), C.INVALID_ARGUMENT, "does not parse"),
            ("garbage record", unix, "Put", put(b"garbage" * 10), (), C.INVALID_ARGUMENT, "records[0]"),
            ("truncated record", unix, "Put", put(fresh_records[0][:-100]), (), C.INVALID_ARGUMENT, "records[0]"),
            ("checksum lie", unix, "Put", put(fresh_records[0], bytes(flipped)), (), C.DATA_LOSS, "checksum"),
            ("size lie", unix, "Put", put(size_lie), (), C.INVALID_ARGUMENT, "4096"),
            ("extra bytes", unix, "Put", put(fresh_records[0] + b"\0" * 4096), (), C.INVALID_ARGUMENT, "data_offsets"),
            ("huge declared size", unix, "Put", put(forged(huge, b"\0" * 64, offsets=[0, huge["nbytes"]])), (),
             C.INVALID_ARGUMENT, "records[0]"),
            ("over max_block_bytes", unix, "Put", put(forged(big, b"\0" * (2 << 20))), (),
             C.INVALID_ARGUMENT, "max_block_bytes"),
            ("31-byte key in record", unix, "Put", put(forged(short_key, b"\0" * 4096)), (),
             C.INVALID_ARGUMENT, "32 bytes"),
            ("bad ttl", unix, "Put", put(fresh_records[0], ttl_s=-1.0), (), C.INVALID_ARGUMENT, "ttl_s"),
            ("nan ttl", unix, "Put", put(fresh_records[0], ttl_s=float("nan")), (), C.INVALID_ARGUMENT, "ttl_s"),
            ("long preview", unix, "Put", put(fresh_records[0], preview="p" * 1000), (), C.INVALID_ARGUMENT, "preview"),
            ("good then bad", unix, "Put", put(*fresh_records, b"bad"), (), C.INVALID_ARGUMENT, "records[3]"),
            ("cut short", unix, "Put", put(*fresh_records, last=False), (), C.INVALID_ARGUMENT, "cut short"),
            ("after last", unix, "Put", put(fresh_records[0]) + put(*fresh_records[1:]), (),
             C.INVALID_ARGUMENT, "follows the message marked last"),
            ("message too large", unix, "Put", put(b"\0" * (41 << 20)), (), C.RESOURCE_EXHAUSTED, ""),
            ("short namespace", unix, "List", pb.ListRequest(namespace=b"ns").SerializeToString(), (),
             C.INVALID_ARGUMENT, "namespace digest"),
            ("unknown namespace", unix, "List", pb.ListRequest(namespace=b"n" * 32).SerializeToString(), (),
             C.NOT_FOUND, "namespace"),
            ("flush unknown namespace", unix, "Flush", pb.FlushRequest(namespace=b"n" * 32).SerializeToString(), (),
             C.NOT_FOUND, "namespace"),
            ("flush unknown tier", unix, "Flush", pb.FlushRequest(tier=7).SerializeToString(), (),
             C.INVALID_ARGUMENT, "tier"),
            ("flush disabled tier", unix, "Flush", pb.FlushRequest(tier=pb.TIER_GPU).SerializeToString(), (),
             C.NOT_FOUND, "gpu"),
            ("pin absent", unix, "Pin", pb.PinRequest(keys=[b"a" * 32]).SerializeToString(), (),
             C.NOT_FOUND, "not cached"),
            ("pin bad ttl", unix, "Pin", pb.PinRequest(keys=keys[:1], ttl_s=-5).SerializeToString(), (),
             C.INVALID_ARGUMENT, "ttl_s"),
            ("unknown method", unix, "Explode", b"", (), C.UNIMPLEMENTED, ""),
            ("no token over tcp", tcp, "Lookup", lookup(keys), (), C.UNAUTHENTICATED, "Bearer"),
            ("wrong token", tcp, "Lookup", lookup(keys), bearer("Bearer tok-c"), C.UNAUTHENTICATED, "unknown token"),
            ("not bearer", tcp, "Lookup", lookup(keys), bearer("Basic tok-a"), C.UNAUTHENTICATED, "Bearer"),
            ("wrong tenant pin", tcp, "Pin", pb.PinRequest(keys=keys).SerializeToString(), bearer("Bearer tok-b"),
             C.NOT_FOUND, "6 of 6"),
            ("wrong tenant list", tcp, "List", pb.ListRequest(namespace=NS.digest()).SerializeToString(),
             bearer("Bearer tok-b"), C.NOT_FOUND, "namespace"),
            ("wrong tenant flush", tcp, "Flush", pb.FlushRequest(namespace=NS.digest()).SerializeToString(),
             bearer("Bearer tok-b"), C.NOT_FOUND, "namespace"),
        ]
        # PutBatch carries a Put's messages in one message: each bad Put is refused the same way.
        cases += [(f"{name} (PutBatch)", channel, "PutBatch", batch(payload), metadata, code, fragment)
                  for name, channel, method, payload, metadata, code, fragment in list(cases) if method == "Put"]
        for name, channel, method, payload, metadata, code, fragment in cases:
            got, details = call(channel, method, payload, metadata)
            assert got == code, f"{name}: expected {code}, got {got}: {details}"
            assert fragment in details, f"{name}: {details!r} does not mention {fragment!r}"
        # Wrong-tenant reads are plain misses.
        bob = Client(tcp_address, token="tok-b")
        assert bob.lookup(keys) == [] and bob.fetch(keys) == [] and bob.evict(keys) == 0
        assert snapshot(store) == before, "a refused call changed the store"

        # Randomly mutated valid messages: never INTERNAL/UNKNOWN, never a crash.
        valid = {
            "Lookup": lookup(keys),
            "Fetch": pb.FetchRequest(keys=keys, shared_memory=True).SerializeToString(),
            "FetchShared": pb.FetchRequest(keys=keys).SerializeToString(),
            "Touch": pb.TouchRequest(keys=keys, reports=[pb.ReportRequest(
                prompt_tokens=9, cached_tokens=4, computed_tokens=5, ttft_s=0.1)]).SerializeToString(),
            "Put": put(*fresh_records[:2], ttl_s=30, preview="hello"),
            "PutBatch": batch(put(*fresh_records[:2], ttl_s=30, preview="hello")),
            "Pin": pb.PinRequest(keys=keys[:2], ttl_s=5).SerializeToString(),
            "Unpin": pb.UnpinRequest(keys=keys[:2]).SerializeToString(),
            "List": pb.ListRequest(namespace=NS.digest(), limit=3).SerializeToString(),
            "Prefetch": pb.PrefetchRequest(keys=keys).SerializeToString(),
            "Evict": pb.EvictRequest(keys=[b"z" * 32]).SerializeToString(),
        }
        rng = random.Random(1234)
        seen = set()
        for i in range(400):
            method = rng.choice(sorted(valid))
            payload = valid[method]
            if method in STREAM_IN:
                payload = list(payload)
                j = rng.randrange(len(payload))
                payload[j] = mutate(rng, payload[j])
            else:
                payload = mutate(rng, payload)
            code, details = call(unix, method, payload)
            assert code in (C.OK, C.INVALID_ARGUMENT, C.DATA_LOSS, C.NOT_FOUND), \
                f"mutation {i} of {method}: {code} {details}"
            seen.add(code)
        assert {C.OK, C.INVALID_ARGUMENT} <= seen

        store.check_integrity()
        local = Client(f"unix:{config.server.socket}")
        report = local.verify()
        assert report.integrity_ok and report.num_failed == 0
        assert local.health() == "SERVING"
        got = local.fetch(keys)
        assert len(got) == 6
        assert_intact(got)
        assert local.put(fresh[2:]) is not None and len(local.fetch([b.meta.key for b in fresh[2:]])) == 1
        assert_intact(alice.fetch(keys))
        assert len(local.fetch(keys, shared_memory=False)) == 6


def mutate(rng: random.Random, data: bytes) -> bytes:
    """Flip, drop, insert or duplicate a few bytes."""
    buf = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(4)
        pos = rng.randrange(len(buf)) if buf else 0
        if op == 0 and buf:
            buf[pos] ^= 1 << rng.randrange(8)
        elif op == 1 and buf:
            del buf[pos : pos + rng.randint(1, 8)]
        elif op == 2:
            buf[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        else:
            buf[pos:pos] = buf[pos : pos + rng.randint(1, 16)]
    return bytes(buf)
