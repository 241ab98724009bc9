"""`tiercache admin export` on one daemon, `import` on a fresh one: same hits, bit-identical blocks."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file
from test_admin import PROMPTS, SYSTEM, populate, run_admin, run_json

from benchmarks.daemons import cleanup, running_server, short_dir, small_config
from tiercache.client import Client
from tiercache.keys import block_keys
from tiercache.layout import checksum
from tiercache.worker.model import load_default_model, namespace_for


@pytest.fixture
def bases():
    paths = [short_dir(), short_dir()]
    yield paths
    for path in paths:
        cleanup(path)


def test_export_then_import_on_a_fresh_daemon_hits_with_identical_blocks(bases):
    loaded = load_default_model()
    ns = namespace_for(loaded, block_tokens=16)
    keys = [block_keys(ns, loaded.tokenizer.encode(p)) for p in PROMPTS]
    path = os.path.join(bases[0], "kitchen.safetensors")
    with running_server(small_config(bases[0], host_pages=256, disk_bytes=64 << 20)) as (_, a):
        populate(a, loaded)
        assert run_admin(a, "pin", "--prompt", SYSTEM)[0] == 0  # pins travel with the file
        code, out, _ = run_admin(a, "export", "-o", path)
        assert code == 0 and out.startswith("exported 7 blocks (448.0 KiB) of namespace") and "default-llama" in out
        code, _, err = run_admin(a, "export", "-o", path)  # the file exists now: overwriting asks first
        assert code == 2 and "overwrite" in err
        code, r = run_json(a, "export", "-o", path, "--yes")
        assert code == 0 and r["blocks"] == 7 and r["skipped"] == 0 and r["bytes"] == 7 * 65536
        with Client(a) as client:
            original = {k: b.payload.clone() for ks in keys for k, b in zip(ks, client.fetch(ks))}
    assert len(original) == 7  # 5 shared blocks + one of each continuation
    tensors = load_file(path)  # any safetensors reader opens it: canonical layout, the namespace's dtype
    assert len(tensors) == 7 and all(t.shape == (4, 2, 2, 16, 64) and t.dtype == torch.float32
                                     for t in tensors.values())

    with running_server(small_config(bases[1], host_pages=256, disk_bytes=64 << 20)) as (_, b):
        assert run_admin(b, "explain", "--prompt", PROMPTS[0])[0] == 1  # fresh: nothing cached
        code, out, _ = run_admin(b, "import", path)
        assert code == 0 and out.startswith("imported 7 blocks into namespace") and "tenant local" in out
        code, r = run_json(b, "import", path)  # again: nothing overwritten, nothing new
        assert code == 0 and (r["stored"], r["already_present"]) == (0, 7)
        with Client(b) as client:
            for ks in keys:
                assert client.lookup(ks) == ["host"] * 6
                for block in client.fetch(ks):
                    assert torch.equal(block.payload, original[block.meta.key]), "block changed in transit"
        # The namespace description and pins came along; a worker now reuses the prefix.
        code, listing = run_json(b, "ls")
        (chain,) = listing["namespaces"][0]["chains"]
        assert listing["namespaces"][0]["model"] == ns.model and chain["pinned"] == "part"
        assert chain["preview"] == PROMPTS[0][:64]
        (result,) = populate(b, loaded, [PROMPTS[1]])
        assert (result.cached_tokens, result.tiers) == (96, ["host"] * 6)


def test_import_refuses_bad_files_and_other_tenants(bases):
    path = os.path.join(bases[0], "not-an-export.safetensors")
    with open(path, "wb") as f:
        f.write(b"\x10\x00\x00\x00\x00\x00\x00\x00{}" + b" " * 14)
    config = small_config(bases[1], listen="127.0.0.1:0", tokens={"tok-alice": "alice"})
    with running_server(config) as (_, address):
        code, _, err = run_admin(address, "import", path, "--token", "tok-alice")
        assert code == 2 and "not a tiercache export" in err
        code, _, err = run_admin(address, "import", os.path.join(bases[0], "missing"), "--token", "tok-alice")
        assert code == 2
        # A well-formed export, but alice is not the operator: she could plant blocks under anyone's keys.
        with open(path, "wb") as f:
            blocks = [{"key": "11" * 32, "parent": "", "num_tokens": 1, "checksum": checksum(bytes(16)),
                       "preview": "", "pinned": False}]
            header = json.dumps({"__metadata__": {"format": "tiercache.export.v2", "tenant": "bob",
                                                  "namespace": "00" * 32, "description": "",
                                                  "blocks": json.dumps(blocks)},
                                 "11" * 32: {"dtype": "F16", "shape": [1, 2, 1, 1, 4], "data_offsets": [0, 16]}})
            header += " " * (-len(header) % 8)
            f.write(len(header).to_bytes(8, "little") + header.encode() + bytes(16))
        code, _, err = run_admin(address, "import", path, "--token", "tok-alice")
        assert code == 4 and "PermissionDenied" in err and "only tenant 'local'" in err
        # The operator may import, but not a block whose bytes do not match the checksum it came with.
        with open(path, "r+b") as f:
            f.seek(-1, os.SEEK_END)
            f.write(b"\x01")
        code, _, err = run_admin(f"unix:{config.server.socket}", "import", path)
        assert code == 4 and "fails its checksum" in err
        # Damaged block entries are named before anything is stored: a missing field, a block whose
        # tensor the file lacks, a key that is not a key.
        item = {"key": "11" * 32, "parent": "", "num_tokens": 1, "checksum": checksum(bytes(16)), "preview": "",
                "pinned": False}
        for damage, message in (({"pinned": None}, "blocks[0] has no bool 'pinned'"),
                                ({"key": "ab" * 32}, "whose tensor the file does not hold"),
                                ({"parent": "abc"}, "parent 'abc' is not 64 hex digits")):
            header = json.dumps({"__metadata__": {"format": "tiercache.export.v2", "tenant": "bob",
                                                  "namespace": "00" * 32, "description": "",
                                                  "blocks": json.dumps([{**item, **damage}])},
                                 "11" * 32: {"dtype": "F16", "shape": [1, 2, 1, 1, 4], "data_offsets": [0, 16]}})
            header += " " * (-len(header) % 8)
            with open(path, "wb") as f:
                f.write(len(header).to_bytes(8, "little") + header.encode() + bytes(16))
            code, _, err = run_admin(f"unix:{config.server.socket}", "import", path)
            assert code == 2 and "damaged tiercache metadata" in err and message in err, err
        # Export into a directory that does not exist, or onto a directory: a usage error, nothing written.
        code, _, err = run_admin(f"unix:{config.server.socket}", "export", "-o", os.path.join(bases[0], "no", "x"))
        assert code == 2 and "does not exist" in err, err
        code, _, err = run_admin(f"unix:{config.server.socket}", "export", "-o", bases[0], "--yes")
        assert code == 2 and "is a directory" in err, err
        with Client(f"unix:{config.server.socket}") as local:
            assert local.list() == []
