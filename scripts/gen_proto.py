"""Regenerate tiercache/v1/ (messages, stubs, type hints) from proto/tiercache/v1/*.proto with grpc_tools."""

from __future__ import annotations

import argparse
import pathlib
import re
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO / "proto"
PACKAGE = "tiercache/v1"
INIT = '"""Generated gRPC code for the tiercache.v1 wire contract (scripts/gen_proto.py); do not edit."""\n'
# protoc writes "from tiercache.v1 import x_pb2 as ..."; a relative import keeps the package
# importable however the repository is put on sys.path (installed, or run from a checkout).
_ABSOLUTE_IMPORT = re.compile(r"^from tiercache\.v1 import (\w+_pb2) as (\w+)$", re.MULTILINE)


def generate(out_root: pathlib.Path) -> list[pathlib.Path]:
    """Write the generated package under out_root/tiercache/v1 and return the files written."""
    from grpc_tools import protoc  # dev dependency: only code generation needs it

    protos = sorted((PROTO_ROOT / PACKAGE).glob("*.proto"))
    if not protos:
        raise SystemExit(f"no .proto files under {PROTO_ROOT / PACKAGE}")
    out_dir = out_root / PACKAGE
    out_dir.mkdir(parents=True, exist_ok=True)
    include = pathlib.Path(protoc.__file__).parent / "_proto"
    args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={out_root}",
            f"--pyi_out={out_root}", f"--grpc_python_out={out_root}"]
    args += [str(p.relative_to(PROTO_ROOT)) for p in protos]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed: {' '.join(args)}")
    (out_dir / "__init__.py").write_text(INIT)
    for path in out_dir.glob("*_pb2_grpc.py"):
        path.write_text(_ABSOLUTE_IMPORT.sub(r"from . import \1 as \2", path.read_text()))
    return sorted(p for p in out_dir.iterdir() if p.suffix in (".py", ".pyi"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=pathlib.Path, default=REPO, help="root to write tiercache/v1 under")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        # Generate aside, then replace, so a failed run never leaves a half-written package.
        files = generate(pathlib.Path(tmp))
        target = args.out / PACKAGE
        target.mkdir(parents=True, exist_ok=True)
        for path in files:
            (target / path.name).write_bytes(path.read_bytes())
    for path in files:
        print(target / path.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
