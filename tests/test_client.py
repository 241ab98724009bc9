"""The status table both ways, the client's error mapping and wire parsing, and the serve command's refusals."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import pytest

from server.records import lookup_reply, record_frame
from tiercache import errors, status
from tiercache.cli import EXIT_USAGE, main
from tiercache.client import Client, parse_fetch_response
from tiercache.config import load_config
from tiercache.v1 import tiercache_pb2 as pb


def test_status_table_round_trips_every_class():
    for cls, code in status.ERROR_CODES:
        assert status.to_code(cls("x")) == code
        assert status.from_code(code, cls.__name__) is cls
    # The general class when the server names none, or names one the code does not allow.
    assert status.from_code("RESOURCE_EXHAUSTED") is errors.CapacityExceeded
    assert status.from_code("NOT_FOUND", "QuotaExceeded") is errors.NotFound
    assert status.from_code("UNAVAILABLE") is errors.Unavailable
    assert status.from_code("DEADLINE_EXCEEDED") is errors.DeadlineExceeded
    assert status.from_code("SOMETHING_NEW") is errors.TierCacheError
    assert status.to_code(ValueError("not ours")) == "INTERNAL"
    assert status.to_code(errors.QuotaExceeded("q")) == "RESOURCE_EXHAUSTED"


def test_every_status_code_name_exists_in_grpc():
    import grpc

    for _, code in status.ERROR_CODES:
        assert grpc.StatusCode[code]


def test_unreachable_daemon_is_unavailable(tmp_path):
    client = Client(f"unix:{tmp_path}/nobody.sock", timeout_s=2)
    with pytest.raises(errors.Unavailable):
        client.lookup([b"k" * 32])
    with pytest.raises(errors.Unavailable):
        client.fetch([b"k" * 32])
    client.close()


def test_hand_framed_fetch_response_matches_protobuf():
    record = bytes(range(256)) * 700  # multi-byte varint lengths
    for index in (0, 1, 300):
        header, payload = record[:77], record[77:]
        frame = record_frame(index, header, payload)
        assert (len(frame) - len(payload)) % 16 == 0, "the payload must sit 16-byte aligned in the message"
        parsed = pb.FetchResponse.FromString(frame)
        assert parsed.blocks[0].index == index and parsed.blocks[0].record == record
        assert not any(parsed.blocks[0].pad)  # zero bytes, only there to align the payload
        unpadded = pb.FetchResponse(blocks=[pb.FetchedBlock(index=index, record=record)])
        parsed.blocks[0].ClearField("pad")
        assert parsed == unpadded
        slab, items = parse_fetch_response(frame)
        assert slab is None and items[0][0] == index and bytes(items[0][1]) == record


def test_hand_framed_lookup_response_matches_protobuf():
    for tiers in ([], [pb.TIER_HOST], [pb.TIER_GPU, pb.TIER_HOST, pb.TIER_DISK] * 50):
        frame = lookup_reply(bytes(tiers))
        assert frame == pb.LookupResponse(tiers=tiers).SerializeToString()
        assert list(pb.LookupResponse.FromString(frame).tiers) == tiers


def test_fetch_response_parser_reads_descriptors_and_rejects_garbage():
    message = pb.FetchResponse(slab=pb.SlabInfo(path="/dev/shm/x", page_bytes=4096, header_bytes=8192, num_pages=3))
    message.blocks.add(index=0, slab_block=pb.SlabBlock(pages=[2, 0], generations=[4, 6]))
    message.blocks.add(index=1, record=b"rec")
    slab, items = parse_fetch_response(message.SerializeToString())
    assert slab.path == "/dev/shm/x" and slab.num_pages == 3
    assert list(items[0][1].pages) == [2, 0] and bytes(items[1][1]) == b"rec"
    for garbage in (b"\x12\xff\xff\xff\xff\x0f", b"\x12\x05ab", b"\x17", b"\x12\x02\x08\x01"):
        with pytest.raises(ValueError):
            parse_fetch_response(garbage)


def test_a_callers_mistakes_are_named_before_any_call(tmp_path):
    with pytest.raises(errors.InvalidArgument, match=f"write 'unix:{tmp_path}/d.sock'"):
        Client(f"{tmp_path}/d.sock")
    with Client(f"unix:{tmp_path}/nobody.sock", timeout_s=2) as client:
        for call in (client.lookup, client.fetch, client.fetch_views):
            with pytest.raises(errors.InvalidArgument, match="not one bytes object"):
                call(b"k" * 32)
        with pytest.raises(errors.InvalidArgument, match="put takes Blocks .* got bytes"):
            client.put([b"k" * 32])


def test_paths_in_the_config_may_start_with_a_tilde(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    path = tmp_path / "tiercache.toml"
    path.write_text('data_dir = "~/cache"\n[server]\nsocket = "~/tc.sock"\n[host]\nshm_dir = "~/shm"\n')
    config = load_config(path, env={})
    assert (config.data_dir, config.server.socket, config.host.shm_dir) == \
        (f"{tmp_path}/cache", f"{tmp_path}/tc.sock", f"{tmp_path}/shm")


@pytest.mark.parametrize("overrides, field", [
    ({"server.listen": "127.0.0.1:0", "server.tokens": {"t": "local"}}, "server.tokens"),  # the operator
    ({"server.listen": "127.0.0.1:0", "server.tokens": {"t": ""}}, "server.tokens"),
    ({"server.socket": "/tmp/" + "s" * 110}, "server.socket"),
    ({"server.drain_timeout_s": float("nan")}, "server.drain_timeout_s"),
    ({"server.tenant_quota_bytes": -1}, "server.tenant_quota_bytes"),
    ({"server.tls_cert": "c.pem", "server.tls_key": "k.pem"}, "server.tls_cert"),  # without a listener
    ({"host.page_bytes": 4096.9}, "host.page_bytes"),
    ({"gpu.promote_after_hits": 0}, "gpu.promote_after_hits"),
    ({"disk.min_compress_ratio": -1.0}, "disk.min_compress_ratio"),
    ({"disk.reader_check_interval_s": float("nan")}, "disk.reader_check_interval_s"),
    ({"store.default_ttl_s": float("inf")}, "store.default_ttl_s"),
    ({"disk.capacity_bytes": 1 << 30, "disk.map_size_bytes": 1 << 30}, "disk.map_size_bytes"),  # no room for LMDB's own
])
def test_config_refuses_values_that_cannot_mean_anything(overrides, field):
    with pytest.raises(ValueError, match=f"config field {field}="):
        load_config(env={}, overrides=list(overrides.items()))


def test_serve_names_what_keeps_it_from_starting(tmp_path, capsys):
    """A missing shm_dir, a data_dir that is a file, a TCP port in use: one line, exit 2, no traceback."""
    (tmp_path / "file").write_text("")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cases = [(["--data-dir", str(tmp_path / "file")], "data_dir"),
                 (["--data-dir", str(tmp_path / "d1"), "--socket", str(tmp_path / "s1")], "host.shm_dir"),
                 (["--data-dir", str(tmp_path / "d2"), "--socket", str(tmp_path / "s2"),
                   "--listen", f"127.0.0.1:{port}", "--token", "t=alice"], "server.listen")]
        for flags, field in cases:
            env = {"TIERCACHE_HOST__SHM_DIR": str(tmp_path / "missing")} if field == "host.shm_dir" else {}
            proc = subprocess.run([sys.executable, "-m", "tiercache.cli", "serve", *flags],
                                  env={**os.environ, **env}, capture_output=True, text=True, timeout=120,
                                  cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            assert proc.returncode == 2 and field in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_a_failed_start_gives_the_caller_its_signal_handlers_back(tmp_path):
    from server.main import serve

    (tmp_path / "file").write_text("")
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    fds = len(os.listdir("/proc/self/fd"))
    config = load_config(env={}, overrides=[("data_dir", str(tmp_path / "file" / "d")),
                                            ("server.socket", str(tmp_path / "s.sock"))])
    with pytest.raises(errors.InvalidArgument, match="data_dir"):
        serve(config)
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
    assert len(os.listdir("/proc/self/fd")) == fds  # and its wake-up pipe is closed


def test_serve_refuses_bad_flags_with_a_message(tmp_path, capsys):
    assert main(["serve", "--data-dir", str(tmp_path), "--listen", "127.0.0.1:0"]) == EXIT_USAGE
    assert "server.tokens" in capsys.readouterr().err
    assert main(["serve", "--data-dir", str(tmp_path), "--listen", "nonsense"]) == EXIT_USAGE
    assert "server.listen" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--token", "no-tenant"])


def test_hand_framed_put_batch_matches_protobuf():
    from benchmarks.daemons import chain, tokens
    from tiercache import wire
    from tiercache.codec import encode_block, plain_record_parts

    blocks = chain(tokens(7, 3))
    requests = [pb.PutRequest(ttl_s=2.5, pin=i == 1, last=i == 2, preview="p" * 200 if i == 0 else "")
                for i in range(3)]
    framed = wire.put_batch([(plain_record_parts(b), r.SerializeToString()) for b, r in zip(blocks, requests)])
    parsed = pb.PutBatchRequest.FromString(framed)
    for b, r, got in zip(blocks, requests, parsed.requests):
        r.record = encode_block(b)
        assert got == r
    assert pb.PutBatchRequest.FromString(wire.put_batch([])) == pb.PutBatchRequest()


def test_field_count_guard_walks_without_parsing():
    from tiercache.wire import has_more_fields

    lookup = pb.LookupRequest(keys=[bytes([i]) * 32 for i in range(200)]).SerializeToString()
    assert not has_more_fields(lookup, 200) and has_more_fields(lookup, 199)
    put = pb.PutBatchRequest(requests=[pb.PutRequest(record=b"r" * 100_000, last=True)]).SerializeToString()
    assert not has_more_fields(put, 1)  # one field, however long
    empties = b"\x0a\x00" * 10**7  # 20 MB that parse into ten million messages
    assert has_more_fields(empties, 131_088)
    assert not has_more_fields(b"\x0a\xff" * 1000, 10)  # a length past the end: malformed, the parser's to refuse
    assert not has_more_fields(b"\x0f" * 1000, 10)  # wire type 7 does not exist: likewise


MALLOC_PROBE = r"""
import ctypes, json, os, sys

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
env = {k: v for k, v in os.environ.items() if k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}

from tiercache.client import Client


def mmapped(nbytes):
    # Whether glibc gives a buffer of nbytes its own mmap (a chunk mallinfo2 counts in hblks): it does
    # from M_MMAP_THRESHOLD up, which mallopt sets, and which glibc raises itself to the size of an
    # mmapped chunk that is freed (never past 32 MiB).
    before = libc.mallinfo2().hblks
    buffer = libc.malloc(nbytes)
    found = libc.mallinfo2().hblks - before
    libc.free(buffer)
    return found


before_client = mmapped(16 << 20)  # the control: the threshold is still below 16 MiB (now just above)
client = Client("unix:/nonexistent/tc.sock", **json.loads(sys.argv[1]))
after_client = mmapped(24 << 20)  # tune_malloc raises it to 32 MiB
client.close()
changed = {k: v for k, v in os.environ.items() if k.startswith(("MALLOC_", "GLIBC_TUNABLES"))} != env
print(json.dumps({"before": before_client, "after": after_client, "env_changed": changed}))
"""


def _malloc_after_client(**kwargs: object) -> dict:
    import json

    proc = subprocess.run([sys.executable, "-c", MALLOC_PROBE, json.dumps(kwargs)], capture_output=True, text=True,
                          timeout=120, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallinfo2")
def test_a_default_client_leaves_the_processs_malloc_settings_alone():
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").mallinfo2  # noqa: B018 - glibc >= 2.33
    except (OSError, AttributeError):
        pytest.skip("not glibc >= 2.33")
    default = _malloc_after_client()
    if not default["before"]:
        pytest.skip("this environment raised glibc's mmap threshold before any Client (MALLOC_* variables?)")
    assert default == {"before": 1, "after": 1, "env_changed": False}
    # The opt-in, measured the same way: the probe does see a tuned allocator.
    assert _malloc_after_client(tune_allocator=True) == {"before": 1, "after": 0, "env_changed": False}
