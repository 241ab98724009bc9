"""Shared fixtures: paths to the shared spec, small layouts, temp data directories."""

from __future__ import annotations

import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"


@pytest.fixture
def shm_dir(tmp_path: pathlib.Path) -> pathlib.Path:
    """A private directory for shared-memory slabs (under /dev/shm when it exists)."""
    import os
    import shutil
    import tempfile

    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    path = pathlib.Path(tempfile.mkdtemp(prefix="tiercache-test-", dir=base))
    yield path
    shutil.rmtree(path, ignore_errors=True)
