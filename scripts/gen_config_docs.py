"""Write docs/configuration.md from the config dataclasses (tiercache/config.py): every field, its
type, default and meaning (the comment beside or above it). --check: exit 1 if the file is stale."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from tiercache import config  # noqa: E402

OUT = REPO / "docs" / "configuration.md"
SOURCE = REPO / "tiercache" / "config.py"

INTRO = """# Configuration reference

Written by `python3 scripts/gen_config_docs.py` from `tiercache/config.py`; a test fails when it is
stale. One TOML file (`tiercache serve --config FILE`, `tiercache worker --config FILE`), then
`TIERCACHE_SECTION__FIELD` environment variables (`TIERCACHE_HOST__CAPACITY_BYTES=1073741824`;
`TIERCACHE_DATA_DIR` for a top-level field), then command-line flags. Unknown keys and bad values
are errors that name the field. Sizes are bytes (`_bytes`), durations seconds (`_s`).

```toml
data_dir = "/srv/tiercache"
[host]
capacity_bytes = 8589934592   # 8 GiB of shared memory
[disk]
capacity_bytes = 274877906944 # 256 GiB on the NVMe
```

Page size: a block takes whole pages of `host.page_bytes`. `tiercache worker` logs at load how its
model's blocks fit (for example `KV block of 16 tokens = 1179648 bytes ...; on pages of 65536 bytes
it takes 18: fits exactly`) and, when they waste room, the page size that wastes least.
"""


def _comments(tree: ast.Module, lines: list[str]) -> dict[tuple[str, str], str]:
    """(class, field) -> the comment on the field's line, or the comment lines just above it."""
    out: dict[tuple[str, str], str] = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        for item in node.body:
            if not isinstance(item, ast.AnnAssign) or not isinstance(item.target, ast.Name):
                continue
            line = lines[item.lineno - 1]
            text = line.split("  # ", 1)[1].strip() if "  # " in line else ""
            above, k = [], item.lineno - 2
            while k >= 0 and lines[k].strip().startswith("#"):
                above.insert(0, lines[k].strip().lstrip("#").strip())
                k -= 1
            out[(node.name, item.target.id)] = " ".join(filter(None, [" ".join(above), text]))
    return out


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = f.default_factory()  # type: ignore[misc]
        if dataclasses.is_dataclass(value):
            return "(section)"
        if callable(getattr(config, f"default_{f.name}", None)) or f.name in ("socket", "data_dir"):
            return "(see meaning)"
    else:
        return "(required)"
    return f"`{value!r}`" if not isinstance(value, dict) else "`{}`"


def render() -> str:
    source = SOURCE.read_text()
    notes = _comments(ast.parse(source), source.splitlines())
    parts = [INTRO]
    sections = [("", config.Config)] + [(f.name, f.default_factory().__class__)  # type: ignore[misc]
                                        for f in dataclasses.fields(config.Config)
                                        if f.default_factory is not dataclasses.MISSING  # type: ignore[misc]
                                        and dataclasses.is_dataclass(f.default_factory())]  # type: ignore[misc]
    for name, cls in sections:
        parts.append(f"\n## {'[' + name + ']' if name else 'Top level'}\n\n{(cls.__doc__ or '').strip()}\n")
        parts.append("| field | type | default | meaning |\n|---|---|---|---|")
        for f in dataclasses.fields(cls):
            if not name and dataclasses.is_dataclass(f.default_factory() if f.default_factory  # type: ignore[misc]
                                                     is not dataclasses.MISSING else None):
                continue
            meaning = notes.get((cls.__name__, f.name), "").replace("|", "\\|")
            parts.append(f"| `{f.name}` | `{f.type}` | {_default(f)} | {meaning} |")
    return "\n".join(parts) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/configuration.md is stale")
    args = parser.parse_args()
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT.relative_to(REPO)} is stale: run python3 scripts/gen_config_docs.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
