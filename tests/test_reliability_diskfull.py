"""Disk full: the data directory on an 8 MiB tmpfs under a 64 MiB disk tier; Puts never hang and fall back
to the host tier, reads keep working, and disk writes resume after a flush, without a restart."""

from __future__ import annotations

import dataclasses
import logging
import os

import pytest

from benchmarks.daemons import chain, cleanup, running_server, short_dir, small_config, tokens
from benchmarks.reliability import NS_BIG
from benchmarks.scenarios.diskfull import run_disk_full, small_filesystem
from tiercache.client import Client
from tiercache.config import DiskConfig
from tiercache.tiers.disk import DiskTier


@pytest.mark.slow
def test_full_disk_falls_back_to_host_and_keeps_reading():
    base = short_dir()
    try:
        report = run_disk_full(base, os.path.join(base, "mnt"))
        print(report)
        assert not report.problems, "\n".join(report.problems)
        assert set(report.refused) <= {"CapacityExceeded"}, report.refused
        assert report.slowest_put_s < 5.0, "a Put hung on the full disk"
    finally:
        cleanup(base)


@pytest.mark.slow
def test_disk_writes_resume_after_a_flush_without_a_restart():
    """Regression (bug 4): writes resumed after a Flush in only 3 of 7 runs; the others stayed stuck."""
    base = short_dir()
    try:
        report = run_disk_full(base, os.path.join(base, "mnt"), resume_wait_s=8.0)
        print(report)
        assert not report.problems, "\n".join(report.problems)
        assert 0 <= report.resumed_after_s < 8, "disk writes did not resume after the flush"
    finally:
        cleanup(base)


def test_failed_disk_write_leaves_the_index_consistent_and_close_clean():
    """Regression (bug 3, fixed in store.py): blocks whose disk write failed were still indexed as on disk."""
    base = short_dir()
    try:
        with small_filesystem(os.path.join(base, "mnt"), "2m") as mount_point:
            config = dataclasses.replace(small_config(base, host_pages=512, disk_bytes=64 << 20),
                                         data_dir=os.path.join(mount_point, "data"))
            with running_server(config) as (store, address), Client(address) as client:
                for i in range(100):
                    blocks = chain(tokens(i, 8))
                    client.put(blocks)
                    client.fetch([b.meta.key for b in blocks])  # hits: close() then writes their attrs
                    store.flush_writes()
                    if store.disk.write_failures:
                        break
                assert store.disk.write_failures, "the filesystem never filled up"
                store.check_integrity()  # was: "disk: 0 stored but not indexed, 8 indexed but not stored"
                assert store.snapshot_counters()["disk_writes_lost"] == store.disk.write_failures
                client.flush(tier="host")
                keys = [b.meta.key for b in blocks]
                assert len(client.lookup(keys)) == len(client.fetch(keys)), "Lookup promised blocks Fetch lacks"
                assert client.verify().num_failed == 0, "lost writes must not surface as damaged blocks"
            # running_server's exit closed the store: it used to raise NotFound from disk.set_attrs here.
    finally:
        cleanup(base)


def test_deletes_commit_on_a_full_filesystem_and_writes_resume(caplog: pytest.LogCaptureFixture):
    """Regression (bug 4): with no byte left on the filesystem, LMDB could not commit a Flush's deletes
    (copy-on-write: deleting needs fresh pages too), so disk writes never resumed. The disk tier's
    RESERVE file is released for the deletes, which commit in small transactions, and filled again."""
    base = short_dir()
    try:
        with small_filesystem(os.path.join(base, "mnt"), "4m") as mount_point, \
                caplog.at_level(logging.WARNING, logger="tiercache.tiers"):
            path = os.path.join(mount_point, "disk")
            tier = DiskTier(path, DiskConfig(capacity_bytes=64 << 20), max_block_bytes=1 << 20)
            reserve = os.path.join(path, "RESERVE")
            try:
                assert "exceeds the room on its filesystem" in caplog.text  # a 160 MiB map on 4 MiB
                assert os.stat(reserve).st_blocks * 512 == 256 << 10  # 1/16 of the filesystem
                stored = []
                for i in range(400):  # 32 KiB blocks, one transaction each, until a write fails
                    block = chain(tokens(i, 1), NS_BIG)[0]
                    tier.put(block)
                    tier.flush()
                    if tier.write_failures:
                        break
                    stored.append(block.meta.key)
                assert tier.write_failures == 1 and len(stored) > 20, "the filesystem never filled up"
                filler = os.path.join(mount_point, "filler")  # take every byte LMDB left
                vfs = os.statvfs(mount_point)
                if vfs.f_bavail:
                    with open(filler, "wb") as f:
                        os.posix_fallocate(f.fileno(), 0, vfs.f_bavail * vfs.f_frsize)
                assert os.statvfs(mount_point).f_bavail == 0
                for key in stored:  # a Flush of the tier: one batch of deletes
                    tier.remove(key)
                tier.flush()
                assert "released reserve" in caplog.text
                fresh = chain(tokens(10_000, 2), NS_BIG)
                for block in fresh:
                    assert tier.put(block), "puts were refused after the deletes committed"
                tier.flush()
                assert tier.write_failures == 1, "writes did not resume after the deletes"
                assert os.path.exists(reserve), "the reserve was not filled again"
                tier.check_integrity()
            finally:
                tier.close()
            tier = DiskTier(path, DiskConfig(capacity_bytes=64 << 20), max_block_bytes=1 << 20)
            try:
                assert sorted(tier.lru_keys()) == sorted(b.meta.key for b in fresh), "the deletes did not commit"
            finally:
                tier.close()
    finally:
        cleanup(base)
