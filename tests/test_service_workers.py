"""Several worker processes share one daemon whose small host tier evicts constantly: every byte checked."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter

from benchmarks.daemons import REPO, assert_intact, chain, cleanup, running_server, short_dir, small_config, tokens
from tiercache.client import Client

NUM_WORKERS = 3
DURATION_S = 4.0


def spawn(address: str, seed: int, go_file: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-m", "benchmarks.daemons", address, str(seed),
                             str(DURATION_S), go_file], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def test_concurrent_workers_under_eviction_get_intact_blocks():
    base = short_dir()
    try:
        # 24 host pages for ~250 distinct 4 KiB blocks: the host tier evicts on nearly every put.
        config = small_config(base, host_pages=24)
        with running_server(config) as (store, address):
            go = os.path.join(base, "go")
            workers = [spawn(address, seed, go) for seed in range(NUM_WORKERS)]
            doomed = spawn(address, 99, go)  # killed mid-run: a dying reader must leave nothing behind
            for proc in workers + [doomed]:
                assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
            open(go, "w").close()
            time.sleep(1.0)
            doomed.send_signal(signal.SIGKILL)
            doomed.wait(10)
            summaries = []
            for proc in workers:
                out, err = proc.communicate(timeout=120)
                assert proc.returncode == 0, err
                summaries.append(json.loads(out.strip().splitlines()[-1]))
            stored = Counter()
            for summary in summaries:
                stored.update(summary["stored"])
            # Concurrent puts of one key store it exactly once (the disk tier holds them all).
            assert stored and all(count == 1 for count in stored.values()), stored.most_common(3)
            assert sum(s["fetched"] for s in summaries) > 100
            # Reads raced with eviction: some slab copies were torn and fetched again as bytes.
            print("refetched after a torn slab read:", [s["refetched"] for s in summaries])
            local = Client(address)
            host = next(t for t in local.stats().tiers if t.tier == "host")
            assert host.evictions > 50, host
            store.check_integrity()
            report = local.verify()
            assert report.integrity_ok and report.num_failed == 0
            blocks = chain(tokens(1000, 6, tokens(100, 4)))
            local.put(blocks)
            got = local.fetch([b.meta.key for b in blocks])
            assert len(got) == len(blocks)
            assert_intact(got)
    finally:
        cleanup(base)
