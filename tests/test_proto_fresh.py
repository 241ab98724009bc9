"""The committed tiercache/v1 generated code matches the proto, and imports with the installed protobuf."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent


def _load_gen_proto():
    spec = importlib.util.spec_from_file_location("gen_proto", REPO / "scripts" / "gen_proto.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generator_is_pinned_to_the_version_that_made_the_committed_code():
    """The freshness check below regenerates with the pinned generator, never whatever is newest."""
    import re
    import tomllib

    gen = _load_gen_proto()
    committed = (REPO / "tiercache" / "v1" / "tiercache_pb2_grpc.py").read_text()
    assert re.search(r"GRPC_GENERATED_VERSION = '([^']+)'", committed).group(1) == gen.GRPC_TOOLS_VERSION
    dev = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]
    assert f"grpcio-tools=={gen.GRPC_TOOLS_VERSION}" in dev


def test_generated_code_is_fresh(tmp_path):
    pytest.importorskip("grpc_tools", reason="grpcio-tools (a dev dependency) regenerates the code")
    fresh = {p.name: p.read_text() for p in _load_gen_proto().generate(tmp_path)}
    committed = {p.name: p.read_text() for p in (REPO / "tiercache" / "v1").iterdir() if p.suffix in (".py", ".pyi")}
    assert set(fresh) == set(committed), "tiercache/v1 has missing or extra files: run scripts/gen_proto.py"
    stale = sorted(name for name in fresh if fresh[name] != committed[name])
    assert not stale, f"stale generated code {stale}: run python3 scripts/gen_proto.py and commit the result"


def test_generated_code_imports_and_is_package_relative():
    from tiercache.v1 import tiercache_pb2, tiercache_pb2_grpc

    assert tiercache_pb2.DESCRIPTOR.package == "tiercache.v1"
    assert set(tiercache_pb2.DESCRIPTOR.services_by_name["TierCache"].methods_by_name) == {
        "Lookup", "Fetch", "FetchShared", "Touch", "Put", "PutBatch", "Prefetch", "Stats", "List", "Flush", "Evict",
        "Pin", "Unpin", "Verify", "Report", "Reserve", "Commit", "Release"}
    source = (REPO / "tiercache" / "v1" / "tiercache_pb2_grpc.py").read_text()
    assert "from . import tiercache_pb2" in source and "from tiercache.v1 import" not in source
    assert tiercache_pb2_grpc.TierCacheStub is not None


def test_every_rpc_and_field_is_commented():
    lines = (REPO / "proto" / "tiercache" / "v1" / "tiercache.proto").read_text().splitlines()
    for i, line in enumerate(lines):
        code = line.split("//")[0].strip()
        is_rpc = code.startswith("rpc ")
        is_field = code.endswith(";") and "=" in code and not code.startswith(("syntax", "package", "option"))
        if (is_rpc or is_field) and "//" not in line and not lines[i - 1].strip().startswith("//"):
            if code.split()[0].isupper():  # enum values are documented by their names and the enum's comment
                continue
            raise AssertionError(f"proto line {i + 1} has no comment: {line.strip()}")
