"""The documentation stays true: the configuration reference matches the code, every field says
what it means, and no page narrates how the code was developed."""

from __future__ import annotations

import dataclasses
import pathlib
import re
import subprocess
import sys

from tiercache import config

REPO = pathlib.Path(__file__).resolve().parent.parent
# Words that narrate development rather than document the product.
NARRATIVE = re.compile(r"\b(this|last|earlier|previous|next) session\b|\bsession \d+\b|\bthrowaway\b|\bsitting\b"
                       r"|\brun \d+ of\b|\bwe tried\b", re.IGNORECASE)


def test_the_configuration_reference_is_fresh() -> None:
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "gen_config_docs.py"), "--check"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_every_config_field_is_documented() -> None:
    text = (REPO / "docs" / "configuration.md").read_text()
    sections = [config.Config] + [type(f.default_factory()) for f in dataclasses.fields(config.Config)  # type: ignore[misc]
                                  if f.default_factory is not dataclasses.MISSING  # type: ignore[misc]
                                  and dataclasses.is_dataclass(f.default_factory())]  # type: ignore[misc]
    for cls in sections:
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(cls) and cls is config.Config and f.name != "data_dir":
                continue
            row = next((line for line in text.splitlines() if line.startswith(f"| `{f.name}` |")), None)
            assert row is not None, f"{cls.__name__}.{f.name} is not in docs/configuration.md"
            assert not row.rstrip().endswith("|  |"), f"{cls.__name__}.{f.name} has no meaning in config.py"


def test_readme_and_docs_do_not_narrate_development() -> None:
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    found = [f"{page.relative_to(REPO)}:{n}: {line.strip()}" for page in pages
             for n, line in enumerate(page.read_text().splitlines(), 1) if NARRATIVE.search(line)]
    assert not found, "development narrative in the docs:\n" + "\n".join(found)


def test_the_example_service_config_loads() -> None:
    loaded = config.load_config(REPO / "deploy" / "tiercache.toml", env={})
    assert loaded.server.socket == "/run/tiercache/tiercache.sock" and loaded.data_dir == "/var/lib/tiercache"
    unit = (REPO / "deploy" / "tiercache.service").read_text()
    assert "tiercache serve --config /etc/tiercache/tiercache.toml" in unit
