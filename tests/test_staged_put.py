"""Staged Puts: a same-host client writes payloads into its staging file once and sends only headers
and offsets; the daemon reads each payload into its own memory, verifies it there, and refuses every
malformed, foreign or damaged staged Put with a precise error, storing nothing and serving on."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time

import grpc
import pytest
import torch

from benchmarks.daemons import assert_intact, chain, running_server, small_config, tokens
from tiercache.block import Block
from tiercache.client import CHANNEL_OPTIONS, Client
from tiercache.client.stage import StagingArea
from tiercache.codec import encode_block, plain_record_parts
from tiercache.layout import checksum
from tiercache.store import PutResult
from tiercache.v1 import tiercache_pb2 as pb
from tiercache.v1 import tiercache_pb2_grpc as pb_grpc


def test_a_same_host_put_sends_no_payload_bytes_and_round_trips(base):
    with running_server(small_config(base)) as (store, address), Client(address, put_in_place=False) as client:
        blocks = chain(tokens(91, 6))
        keys = [b.meta.key for b in blocks]
        assert client.put(blocks) == [PutResult.STORED] * 6
        assert (client.num_staged_puts, client.num_put_fallbacks) == (6, 0)
        assert_intact(client.fetch(keys, shared_memory=False))
        assert client.put(blocks) == [PutResult.ALREADY_PRESENT] * 6
        staging = client._staged._area.path
        assert os.path.dirname(staging) == os.path.dirname(store.host.slab_path) and str(os.getpid()) in staging
        store.check_integrity()
    assert not os.path.exists(staging), "close() must remove the staging file"


def staged_put(address: str, area: StagingArea, blocks, **change) -> pb.PutResponse:  # type: ignore[no-untyped-def]
    """A raw staged PutBatch of `blocks` through `area`, with `change` applied to every request."""
    offsets = area.write([b.payload for b in blocks])
    requests = []
    for i, (block, offset) in enumerate(zip(blocks, offsets)):
        request = pb.PutRequest(record=plain_record_parts(block)[0], last=i == len(blocks) - 1,
                                staged=pb.StagedPayload(file=area.name, offset=offset))
        for name, value in change.items():
            if name == "record":
                request.record = value
            else:
                setattr(request.staged, name, value)
        requests.append(request)
    channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    try:
        return pb_grpc.TierCacheStub(channel).PutBatch(pb.PutBatchRequest(requests=requests), timeout=10)
    finally:
        channel.close()


def refused(address: str, area: StagingArea, blocks, code: grpc.StatusCode, match: str, **change) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as info:
        staged_put(address, area, blocks, **change)
    assert info.value.code() == code and match in info.value.details(), info.value.details()


def test_bad_staged_puts_get_precise_errors_and_store_nothing(base):
    config = small_config(base)
    with running_server(config) as (store, address), Client(address, put_in_place=False) as client:
        directory = os.path.dirname(store.host.slab_path)
        area = StagingArea(directory)
        blocks = chain(tokens(92, 3))
        try:
            invalid = grpc.StatusCode.INVALID_ARGUMENT
            refused(address, area, blocks, invalid, "is not a staging file name", file="../../etc/passwd")
            refused(address, area, blocks, invalid, "cannot be read", file="tiercache-stage-nobody")
            refused(address, area, blocks, invalid, "holds 0 of the", offset=1 << 40)
            link = f"tiercache-stage-link-{os.getpid()}"
            os.symlink(area.path, os.path.join(directory, link))
            try:
                refused(address, area, blocks, invalid, "is not a regular file", file=link)
            finally:
                os.unlink(os.path.join(directory, link))
            refused(address, area, blocks, invalid, "does not hold its own length",
                    record=plain_record_parts(blocks[0])[0][:-8])
            zeros = torch.zeros(blocks[0].meta.nbytes, dtype=torch.uint8)
            compressed = encode_block(Block(dataclasses.replace(blocks[0].meta, checksum=checksum(zeros)), zeros),
                                      compression="zstd")
            assert json.loads(compressed[8 : 8 + int.from_bytes(compressed[:8], "little")])["__metadata__"][
                "compression"] == "zstd"
            refused(address, area, blocks, invalid, "not the header of an uncompressed record",
                    record=compressed[: 8 + int.from_bytes(compressed[:8], "little")])
            # The bytes in the file are not the record's: DATA_LOSS, and none of the call is kept.
            # Block 1's payload where block 0's should be.
            requests_offsets = area.write([blocks[1].payload, blocks[1].payload, blocks[2].payload])
            with pytest.raises(grpc.RpcError) as info:
                staged = [pb.PutRequest(record=plain_record_parts(b)[0], last=i == 2,
                                        staged=pb.StagedPayload(file=area.name, offset=o))
                          for i, (b, o) in enumerate(zip(blocks, requests_offsets))]
                channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
                pb_grpc.TierCacheStub(channel).PutBatch(pb.PutBatchRequest(requests=staged), timeout=10)
            assert info.value.code() == grpc.StatusCode.DATA_LOSS and "staged payload bytes are damaged" in \
                info.value.details()
            assert store.entries() == [], "a refused staged Put stored something"
            assert client.health() == "SERVING"
            assert staged_put(address, area, blocks).results == [pb.PUT_RESULT_STORED] * 3  # then a good one
            assert_intact(client.fetch([b.meta.key for b in blocks], shared_memory=False))
        finally:
            area.close()
        store.check_integrity()


def test_a_tcp_caller_cannot_stage(base):
    config = small_config(base, listen="127.0.0.1:0", tokens={"tok-alice": "alice"})
    with running_server(config) as (store, address):
        area = StagingArea(os.path.dirname(store.host.slab_path))
        try:
            channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
            request = pb.PutRequest(record=plain_record_parts(chain(tokens(93, 1))[0])[0], last=True,
                                    staged=pb.StagedPayload(file=area.name, offset=0))
            with pytest.raises(grpc.RpcError) as info:
                pb_grpc.TierCacheStub(channel).PutBatch(pb.PutBatchRequest(requests=[request]), timeout=10,
                                                        metadata=(("authorization", "Bearer tok-alice"),))
            channel.close()
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "needs a caller on the daemon's Unix socket" in info.value.details()
            # Alice's own client puts over the byte path, as any client on another machine.
            with Client(address, token="tok-alice") as alice:
                assert alice.put(chain(tokens(93, 2))) == [PutResult.STORED] * 2
                assert alice.num_staged_puts == 0
        finally:
            area.close()
        assert len(store.entries()) == 2


def test_a_client_that_cannot_stage_says_so_and_puts_bytes(base, caplog):
    with running_server(small_config(base)) as (store, address), Client(address, put_in_place=False) as client:
        client.fetch_views([chain(tokens(94, 1))[0].meta.key])  # learns the slab
        client._slab.staging_dir = os.path.join(base, "no-such-dir")
        blocks = chain(tokens(94, 3))
        assert client.put(blocks) == [PutResult.STORED] * 3
        assert (client.num_staged_puts, client.num_put_fallbacks) == (0, 1)
        assert "cannot create a staging file" in caplog.text
        assert_intact(client.fetch([b.meta.key for b in blocks], shared_memory=False))
        store.check_integrity()


def test_staging_files_of_dead_clients_are_removed_and_live_ones_kept(tmp_path):
    from server.staging import remove_orphans

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    gone = f"tiercache-stage-{int(dead.stdout)}-abc"
    live = f"tiercache-stage-{os.getpid()}-def"
    for name in (gone, live, "other-file"):
        (tmp_path / name).write_bytes(b"x")
    old = time.time() - 3600
    for name in (gone, live, "other-file"):
        os.utime(tmp_path / name, (old, old))
    assert remove_orphans(str(tmp_path), min_age_s=0.0) == [gone]
    assert sorted(os.listdir(tmp_path)) == sorted([live, "other-file"])


def test_the_daemon_lets_go_of_a_closed_clients_staging_file(base):
    with running_server(small_config(base)) as (store, address):
        with Client(address, put_in_place=False) as client:
            client.put(chain(tokens(95, 2)))
            path = client._staged._area.path
        assert not os.path.exists(path)
        # A new client's first staged put: the daemon sweeps what is gone.
        with Client(address, put_in_place=False) as other:
            other.put(chain(tokens(96, 2)))
        held = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
                if os.path.exists(f"/proc/self/fd/{fd}")]
        assert not any(os.path.basename(path) in target for target in held), "the daemon still holds it"
