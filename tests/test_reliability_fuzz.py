"""Hostile input, beyond test_service_bad_input.py: hypothesis drives every rpc with structured, mutated and
random messages, zstd bombs and size lies, over the Unix socket and TCP (good and bad tokens). Each call must
end within its deadline with a documented status, a refused call must leave the store exactly as it was,
and the daemon must keep serving with its invariants intact."""

from __future__ import annotations

import time

import grpc

from benchmarks.daemons import cleanup, running_server, short_dir, small_config
from benchmarks.scenarios.fuzz import DEADLINE_S, C, fingerprint, hostile_records, invoke, run_fuzz
from tiercache.client import CHANNEL_OPTIONS
from tiercache.v1 import tiercache_pb2 as pb


def test_fuzzed_calls_never_crash_hang_or_change_the_store_when_refused():
    base = short_dir()
    try:
        report = run_fuzz(base, examples=400)
        print(report)
        assert not report.problems, report.problems
        assert report.inputs >= 400 and report.slowest_s < DEADLINE_S
        assert {"OK", "INVALID_ARGUMENT", "UNAUTHENTICATED"} <= set(report.codes), report.codes
    finally:
        cleanup(base)


def test_zstd_bombs_and_size_lies_are_refused_without_expanding():
    base = short_dir()
    try:
        config = small_config(base)
        with running_server(config) as (store, address):
            channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
            before = fingerprint(store)
            for i, record in enumerate(hostile_records()):
                started = time.monotonic()
                request = pb.PutRequest(record=record, last=True)
                for method, payload in (("Put", [request.SerializeToString()]),
                                        ("PutBatch", pb.PutBatchRequest(requests=[request]).SerializeToString())):
                    code, details = invoke(channel, method, payload, ())
                    assert code in (C.INVALID_ARGUMENT, C.DATA_LOSS), f"record {i} ({method}): {code} {details}"
                assert time.monotonic() - started < 2.0, f"record {i} took long: decompressed?"
            assert fingerprint(store) == before
            channel.close()
    finally:
        cleanup(base)
