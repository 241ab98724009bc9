"""Hostile-input scenario: hypothesis drives every rpc with structured, mutated and random messages."""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, field
from functools import cache

import grpc
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks.daemons import NS, chain, running_server, small_config, tokens
from benchmarks.reliability import intact
from tiercache.client import CHANNEL_OPTIONS, Client
from tiercache.codec import FORMAT, encode_block
from tiercache.layout import CHECKSUM_ALG
from tiercache.v1 import tiercache_pb2 as pb

C = grpc.StatusCode
SERVICE = "/tiercache.v1.TierCache/"
TOKENS = {"tok-fuzz-a": "alice"}
DEADLINE_S = 5.0


# What a hostile call may get back: documented refusals, never INTERNAL/UNKNOWN/UNAVAILABLE or a timeout.
ALLOWED = {C.OK, C.INVALID_ARGUMENT, C.DATA_LOSS, C.NOT_FOUND, C.PERMISSION_DENIED, C.UNAUTHENTICATED,
           C.RESOURCE_EXHAUSTED}


UNARY = {"Lookup": pb.LookupRequest, "Prefetch": pb.PrefetchRequest, "Stats": pb.StatsRequest,
         "List": pb.ListRequest, "Flush": pb.FlushRequest, "Evict": pb.EvictRequest, "Pin": pb.PinRequest,
         "Unpin": pb.UnpinRequest, "Verify": pb.VerifyRequest, "Report": pb.ReportRequest,
         "FetchShared": pb.FetchRequest, "Touch": pb.TouchRequest}


def _record(meta: dict, compression: str, frame: bytes, raw_size: int = 0, *, shape: list[int] | None = None) -> bytes:
    """A record with a hand-written safetensors header (what a hostile client can send)."""
    metadata = {"format": FORMAT, "checksum_alg": CHECKSUM_ALG, "compression": compression,
                "meta": json.dumps(meta)}
    if compression == "zstd":
        metadata |= {"shuffle": "0", "raw_size": str(raw_size)}
        entry = {"dtype": "U8", "shape": shape or [len(frame)], "data_offsets": [0, len(frame)]}
    else:
        entry = {"dtype": "F16", "shape": shape or meta["shape"], "data_offsets": [0, len(frame)]}
    text = json.dumps({"__metadata__": metadata, "kv.zst" if compression == "zstd" else "kv": entry}).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + frame


def _lying_frame(real_size: int, claimed: int) -> bytes:
    """A zstd frame of `real_size` zero bytes whose header claims `claimed` bytes (no header checksum
    in zstd: only a decoder that bounds its output notices)."""
    frame = bytearray(zstandard.ZstdCompressor(level=1, write_content_size=True).compress(b"\0" * real_size))
    descriptor = frame[4]
    fcs_bytes = {0: 1 if descriptor & 0x20 else 0, 1: 2, 2: 4, 3: 8}[descriptor >> 6]
    at = 5 + (0 if descriptor & 0x20 else 1) + {0: 0, 1: 1, 2: 2, 3: 4}[descriptor & 3]
    assert fcs_bytes == 4, "expected a 4-byte content size field for a 64 MiB frame"
    frame[at : at + 4] = claimed.to_bytes(4, "little")
    assert zstandard.frame_content_size(bytes(frame)) == claimed
    return bytes(frame)


@cache
def hostile_records() -> list[bytes]:
    """Decompression bombs and size lies, each built around an otherwise valid block meta."""
    block = chain(tokens(900, 1))[0]
    meta = block.meta.to_dict()
    zeros = {**meta, "checksum": 0}
    bomb = _lying_frame(64 << 20, 4096)  # claims 4 KiB, expands to 64 MiB
    return [
        _record(zeros, "zstd", bomb, 4096),
        _record(zeros, "zstd", zstandard.ZstdCompressor(write_content_size=False).compress(b"\0" * (64 << 20)), 4096),
        _record(zeros, "zstd", zstandard.ZstdCompressor().compress(b"\0" * 4096) * 2, 4096),  # two frames
        _record({**zeros, "nbytes": 1 << 40}, "zstd", bomb, 1 << 40),
        _record({**meta, "shape": [2, 2, 2, 16, 1 << 40], "nbytes": 4096}, "none", block.payload.numpy().tobytes()),
        _record(meta, "none", block.payload.numpy().tobytes()[:100]),  # truncated payload
        (1 << 62).to_bytes(8, "little") + b"{}",  # header length far past the end
        encode_block(block)[:-1],
    ]


@dataclass
class FuzzReport:
    inputs: int = 0
    codes: Counter = field(default_factory=Counter)
    slowest_s: float = 0.0
    problems: list[str] = field(default_factory=list)


def fingerprint(store: object) -> tuple:
    """Everything a refused call must not change: every entry's tiers, pin, TTL, hits, LRU stamp."""
    with store._lock:  # type: ignore[attr-defined]
        entries = sorted((e.meta.key, tuple(sorted(e.tiers)), e.pinned_until, e.expires_at, e.hits, e.last_access)
                         for e in store.index.values())  # type: ignore[attr-defined]
    return tuple(entries), tuple((t.name, t.used_bytes, t.num_blocks) for t in store.tier_stats())  # type: ignore[attr-defined]


def strategies(keys: list[bytes], records: list[bytes]) -> st.SearchStrategy:
    """(method, request bytes or list of request bytes for Put, channel name) triples."""
    # Mostly well-formed values, so that calls get past the first check and reach the store.
    key = st.one_of(st.sampled_from(keys), st.binary(min_size=32, max_size=32), st.binary(max_size=40))
    key_list = st.lists(key, max_size=6)
    text = st.text(max_size=300)
    number = st.one_of(st.just(0.0), st.floats(0, 1e9), st.floats(allow_nan=True, allow_infinity=True))
    u32 = st.integers(0, 2**32 - 1)
    record = st.one_of(st.sampled_from(records), st.sampled_from(records), st.binary(max_size=300),
                       st.tuples(st.sampled_from(records), st.integers(0, 5000), st.integers(1, 255)).map(
                           lambda t: t[0][: t[1]] + bytes([t[0][t[1] % len(t[0])] ^ t[2]]) + t[0][t[1] + 1 :]))
    info = st.builds(pb.NamespaceInfo, digest=st.binary(max_size=40), model=text, dtype=text, num_layers=u32,
                     num_kv_heads=u32, head_dim=u32, block_tokens=u32, salt_digest=text)
    put_request = st.builds(lambda r, ttl, pin, preview, imp, ns, with_ns, durable: pb.PutRequest(
        record=r, ttl_s=ttl, pin=pin, preview=preview, import_tenant=imp, durable=durable,
        **({"namespace": ns} if with_ns else {})),
        record, number, st.booleans(), st.one_of(st.just(""), text),
        st.sampled_from(["", "", "", "alice", "local", "x" * 300]), info, st.sampled_from([False, False, True]),
        st.sampled_from([False, False, True]))
    put = st.tuples(st.lists(put_request, min_size=0, max_size=4),
                    st.sampled_from(["last", "last", "last", "none", "all", "first"])).map(
        lambda t: ("Put", [r.SerializeToString() for r in _mark(*t)]))
    put_batch = st.tuples(st.lists(put_request, min_size=0, max_size=4),
                          st.sampled_from(["last", "last", "last", "none", "all", "first"])).map(
        lambda t: ("PutBatch", pb.PutBatchRequest(requests=_mark(*t)).SerializeToString()))
    fetch = st.builds(
        lambda k, s, sk: ("Fetch", pb.FetchRequest(keys=k, shared_memory=s, store_keys=sk).SerializeToString()),
        key_list, st.booleans(), key_list)
    unary = st.one_of(
        st.builds(lambda k: ("Lookup", pb.LookupRequest(keys=k).SerializeToString()), key_list),
        st.builds(lambda k: ("Prefetch", pb.PrefetchRequest(keys=k).SerializeToString()), key_list),
        st.just(("Stats", b"")),
        st.builds(lambda n, lim: ("List", pb.ListRequest(namespace=n, limit=lim).SerializeToString()),
                  st.one_of(st.just(NS.digest()), st.binary(max_size=40)), u32),
        st.builds(lambda t, n, ten: ("Flush", pb.FlushRequest(tier=t, namespace=n, tenant=ten).SerializeToString()),
                  st.integers(-3, 9), st.one_of(st.just(NS.digest()), st.binary(max_size=40)), text),
        *[st.builds(lambda k, sk, m=m: (m, UNARY[m](keys=k, store_keys=sk).SerializeToString()), key_list, key_list)
          for m in ("Evict", "Unpin")],
        st.builds(lambda k, sk, ttl: ("Pin", pb.PinRequest(keys=k, store_keys=sk, ttl_s=ttl).SerializeToString()),
                  key_list, key_list, number),
        st.builds(lambda sk: ("Verify", pb.VerifyRequest(store_keys=sk).SerializeToString()), key_list),
        st.builds(lambda k, s, sk: ("FetchShared", pb.FetchRequest(keys=k, shared_memory=s, store_keys=sk)
                                    .SerializeToString()), key_list, st.booleans(), key_list),
        st.builds(lambda k, c, b, m: ("Touch", pb.TouchRequest(keys=k, lookup_calls=c, lookup_blocks=b, lookup_misses=m)
                                      .SerializeToString()), key_list, u32, u32, u32),
        st.builds(lambda a, b, c, t, p: ("Report", pb.ReportRequest(prompt_tokens=a, cached_tokens=b, computed_tokens=c,
                                                                   ttft_s=t, prefill_s=p).SerializeToString()),
                  u32, u32, u32, number, number),
    )
    structured = st.one_of(unary, fetch, put, put_batch)
    raw = st.tuples(st.sampled_from(sorted([*UNARY, "Fetch", "Put", "PutBatch"])), st.binary(max_size=200)).map(
        lambda t: (t[0], [t[1]] if t[0] == "Put" else t[1]))
    return st.tuples(st.one_of(structured, structured, raw), st.sampled_from(["unix", "unix", "tcp", "tcp-bad"]))


def _mark(requests: list[pb.PutRequest], how: str) -> list[pb.PutRequest]:
    """Set `last` properly, on none, on all, or on the first only (a stream cut short or overrun)."""
    for i, r in enumerate(requests):
        r.last = {"last": i == len(requests) - 1, "none": False, "all": True, "first": i == 0}[how]
    return requests


def invoke(channel: grpc.Channel, method: str, payload: bytes | list[bytes], metadata: tuple) -> tuple[C, str]:
    path = SERVICE + method
    try:
        if method == "Put":
            channel.stream_unary(path)(iter(payload), timeout=DEADLINE_S, metadata=metadata)
        elif method == "Fetch":
            list(channel.unary_stream(path)(payload, timeout=DEADLINE_S, metadata=metadata))
        else:
            channel.unary_unary(path)(payload, timeout=DEADLINE_S, metadata=metadata)
    except grpc.RpcError as e:
        return e.code(), e.details() or ""
    return C.OK, ""


def run_fuzz(base: str, *, examples: int, derandomize: bool = True) -> FuzzReport:
    report = FuzzReport()
    config = small_config(base, listen="127.0.0.1:0", tokens=TOKENS, max_message_bytes=8 << 20,
                          max_keys_per_call=64)
    with running_server(config) as (store, tcp_address):
        unix_address = f"unix:{config.server.socket}"
        seed_blocks = chain(tokens(901, 6))
        keys = [b.meta.key for b in seed_blocks]
        Client(unix_address).put(seed_blocks)
        Client(tcp_address, token="tok-fuzz-a").put(seed_blocks)
        records = [encode_block(b) for b in chain(tokens(902, 3))] + hostile_records()
        channels = {"unix": (grpc.insecure_channel(unix_address, options=CHANNEL_OPTIONS), ()),
                    "tcp": (grpc.insecure_channel(tcp_address, options=CHANNEL_OPTIONS),
                            (("authorization", "Bearer tok-fuzz-a"),)),
                    "tcp-bad": (grpc.insecure_channel(tcp_address, options=CHANNEL_OPTIONS),
                                (("authorization", "Bearer tok-fuzz-b"),))}

        @settings(max_examples=examples, deadline=None, derandomize=derandomize, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(call=strategies(keys, records))
        def one(call: tuple) -> None:
            (method, payload), via = call
            channel, metadata = channels[via]
            before = fingerprint(store)
            started = time.monotonic()
            code, details = invoke(channel, method, payload, metadata)
            took = time.monotonic() - started
            report.inputs += 1
            report.codes[code.name] += 1
            report.slowest_s = max(report.slowest_s, took)
            assert code in ALLOWED, f"{method} via {via}: {code.name} {details}"
            assert took < DEADLINE_S, f"{method} via {via} took {took:.1f} s"
            if code is not C.OK and not (code is C.RESOURCE_EXHAUSTED and "tier full" in details):
                assert fingerprint(store) == before, \
                    f"refused {method} via {via} ({code.name}: {details}) changed the store"
            store.check_integrity()

        try:
            one()
        except AssertionError as e:
            report.problems.append(str(e).splitlines()[0])
        local = Client(unix_address)
        result = local.verify()
        if result.num_failed or not result.integrity_ok or local.health() != "SERVING":
            report.problems.append(f"after fuzzing: {result}")
        fresh = chain(tokens(903, 3))
        local.put(fresh)
        if not intact(local.fetch([b.meta.key for b in fresh])):
            report.problems.append("the daemon no longer stores and serves blocks correctly")
        for channel, _ in channels.values():
            channel.close()
    return report
