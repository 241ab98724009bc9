"""Shared fixtures: paths to the shared spec, small layouts, temp data directories, a Redis Cluster."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

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


@pytest.fixture
def base() -> Iterator[str]:
    """A short temp directory for a daemon's socket and data (a Unix socket path must stay under
    108 bytes, which pytest's tmp_path can exceed); removed with what the daemon left there."""
    from benchmarks.daemons import cleanup, short_dir

    path = short_dir()
    yield path
    cleanup(path)


@pytest.fixture(scope="module")
def cluster():  # noqa: ANN201 - benchmarks.redis_cluster.RedisCluster, imported late
    """A 3-primary Redis Cluster on loopback ports for one test module (the remote tier's tests);
    on a clean machine redis-server is installed first (scripts/setup_redis.sh)."""
    import subprocess

    from benchmarks.redis_cluster import RedisCluster, find_binaries

    if find_binaries() is None:
        subprocess.run(["bash", str(REPO / "scripts" / "setup_redis.sh")], check=True)
    with RedisCluster(3) as c:
        yield c
