"""Service-test helpers: small configs, deterministic block chains, in-process and subprocess daemons."""

from __future__ import annotations

import contextlib
import hashlib
import os
import pathlib
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator

import torch

from tiercache.block import Block, BlockMeta
from tiercache.config import Config, DiskConfig, GpuConfig, HostConfig, ServerConfig, StoreConfig
from tiercache.keys import Namespace, block_keys
from tiercache.layout import BlockLayout, checksum

REPO = pathlib.Path(__file__).resolve().parent.parent
NS = Namespace(model="svc-test", weights="w0", dtype="float16", num_layers=2, num_kv_heads=2, head_dim=16,
               block_tokens=16)  # 4096-byte blocks: one host page each
LAYOUT = BlockLayout.of(NS)
PAGE = 4096


def payload_for(key: bytes, nbytes: int) -> torch.Tensor:
    """Bytes that depend only on the key, so any process can check what it fetched."""
    seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def chain(tokens: list[int], ns: Namespace = NS) -> list[Block]:
    """The full blocks of `tokens` with real chained keys and key-derived payloads."""
    layout = BlockLayout.of(ns)
    keys = block_keys(ns, tokens)
    blocks = []
    for key, parent in zip(keys, [b""] + keys[:-1]):
        payload = payload_for(key, layout.nbytes())
        blocks.append(Block(BlockMeta(key=key, namespace=ns.digest(), num_tokens=layout.block_tokens,
                                      dtype=layout.dtype, shape=layout.shape(), nbytes=layout.nbytes(),
                                      checksum=checksum(payload), parent=parent), payload))
    return blocks


def tokens(seed: int, num_blocks: int, prefix: list[int] | None = None) -> list[int]:
    """`num_blocks` blocks of tokens: `prefix` then pseudo-random ones from `seed`."""
    g = torch.Generator().manual_seed(seed)
    head = list(prefix or [])
    rest = torch.randint(0, 50_000, (num_blocks * NS.block_tokens - len(head),), generator=g).tolist()
    return head + rest


def assert_intact(blocks: list[Block]) -> None:
    for block in blocks:
        assert torch.equal(block.payload, payload_for(block.meta.key, block.meta.nbytes)), \
            f"block {block.meta.key.hex()[:16]} came back with wrong bytes"


def short_dir() -> str:
    """A short temp dir: Unix socket paths must stay under 108 bytes."""
    return tempfile.mkdtemp(prefix="tc-", dir="/tmp")


def small_config(base: str, *, host_pages: int = 64, disk_bytes: int = 16 << 20, gpu_pages: int = 0,
                 **server: object) -> Config:
    """A daemon config under `base`: a small host slab (host_pages x 4 KiB) and an LMDB disk tier, not
    scrubbed in the background (a test of the scrub turns it on: the scrub would find damage that a
    test means a read to find)."""
    srv = {"socket": os.path.join(base, "d.sock"), "idle_check_s": 0.5, "integrity_check_s": 0.5,
           "drain_timeout_s": 10.0, **server}
    return Config(
        data_dir=os.path.join(base, "data"),
        host=HostConfig(capacity_bytes=host_pages * PAGE, page_bytes=PAGE, high_watermark=0.9, low_watermark=0.7),
        gpu=GpuConfig(capacity_bytes=gpu_pages * PAGE, page_bytes=PAGE, device="cpu", promote_after_hits=2),
        disk=DiskConfig(capacity_bytes=disk_bytes, scrub_bytes_per_s=0),
        store=StoreConfig(max_block_bytes=1 << 20),
        server=ServerConfig(**srv),  # type: ignore[arg-type]
    )


def open_store(config: Config, *, cls: type | None = None) -> object:
    """A TieredStore for `config`, with the gpu tier on a CPU pool when config.gpu asks for one."""
    from tiercache.store import TieredStore
    from tiercache.tiers.disk import DiskTier
    from tiercache.tiers.gpu import GpuTier
    from tiercache.tiers.host import HostTier

    cls = cls or TieredStore
    if not config.gpu.capacity_bytes:
        return cls.open(config)
    host = HostTier(config.host)
    disk = DiskTier(os.path.join(config.data_dir, "disk"), config.disk, max_block_bytes=config.store.max_block_bytes)
    return cls(config, host=host, disk=disk, gpu=GpuTier(config.gpu, device="cpu"))


@contextlib.contextmanager
def running_server(config: Config, store: object | None = None) -> Iterator[tuple[object, str]]:
    """An in-process daemon (create_server) over `store` (opened from config if None): (store, address)."""
    from server.app import create_server
    from server.instance import DataDirLock

    lock = DataDirLock(config.data_dir) if store is None else None
    store = store or open_store(config)
    server, address = create_server(config, store)
    server.start()
    try:
        yield store, address
    finally:
        server.stop(1).wait()
        store.close()  # type: ignore[attr-defined]
        if lock is not None:
            lock.release()


class Daemon:
    """`python3 -m tiercache.cli serve ...` in a subprocess; waits for its "listening on" line."""

    def __init__(self, *args: str, config: str | None = None, env: dict[str, str] | None = None) -> None:
        cmd = [sys.executable, "-m", "tiercache.cli", "serve", "--log-level", "INFO", *args]
        if config:
            cmd += ["--config", config]
        full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
        self.addresses: list[str] = []
        self.stderr_lines: list[str] = []
        self._stdout: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._drain, args=(self.proc.stderr, self.stderr_lines.append), daemon=True).start()
        threading.Thread(target=self._drain, args=(self.proc.stdout, self._stdout.put), daemon=True).start()

    @staticmethod
    def _drain(stream: object, sink: object) -> None:
        for line in stream:  # type: ignore[attr-defined]
            sink(line)  # type: ignore[operator]

    @property
    def stderr(self) -> str:
        return "".join(self.stderr_lines)

    def wait_ready(self, timeout_s: float = 60.0) -> list[str]:
        deadline = time.monotonic() + timeout_s
        line = ""
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                line = self._stdout.get(timeout=0.1)
                break
            except queue.Empty:
                continue
        if not line.startswith("tiercache listening on "):
            self.kill()
            raise AssertionError(f"daemon did not start (rc={self.proc.returncode}): {line!r}\n{self.stderr}")
        self.addresses = line.split()[3:]
        return self.addresses

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"daemon still running {timeout_s:.0f} s after signal {sig}; its log ends:\n"
                                 f"{self.stderr[-3000:]}") from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def write_config(path: str, config: Config) -> str:
    """A TOML file equivalent to the host/disk/store/server parts of `config` (no tokens)."""
    h, d, s, v = config.host, config.disk, config.store, config.server
    text = (f'data_dir = "{config.data_dir}"\n'
            f"[host]\ncapacity_bytes = {h.capacity_bytes}\npage_bytes = {h.page_bytes}\n"
            f"high_watermark = {h.high_watermark}\nlow_watermark = {h.low_watermark}\n"
            f"[disk]\ncapacity_bytes = {d.capacity_bytes}\nwrite_policy = \"{d.write_policy}\"\n"
            f"scrub_bytes_per_s = {d.scrub_bytes_per_s}\nscrub_idle_s = {d.scrub_idle_s}\n"
            f"[store]\nmax_block_bytes = {s.max_block_bytes}\n"
            f'[server]\nsocket = "{v.socket}"\nidle_check_s = {v.idle_check_s}\n'
            f"integrity_check_s = {v.integrity_check_s}\n"
            f"drain_timeout_s = {v.drain_timeout_s}\n")
    with open(path, "w") as f:
        f.write(text)
    return path


def cleanup(base: str) -> None:
    shutil.rmtree(base, ignore_errors=True)


def worker_main(address: str, seed: int, duration_s: float, go_file: str) -> None:
    """A worker process for the concurrency test: put and fetch overlapping chains, check every byte.

    Prints "ready", waits for `go_file`, then one JSON summary line.
    """
    import json
    import random

    from tiercache.client import Client
    from tiercache.store import PutResult

    client = Client(address, timeout_s=30)
    rng = random.Random(seed)
    prefixes = [tokens(100 + i, 4) for i in range(3)]  # shared by every worker
    print("ready", flush=True)
    while not os.path.exists(go_file):
        time.sleep(0.01)
    stored: dict[str, int] = {}
    fetched = 0
    deadline = time.monotonic() + duration_s
    while time.monotonic() < deadline:
        prefix = rng.choice(prefixes)
        blocks = chain(tokens(1000 + rng.randrange(20), 4 + rng.randint(1, 4), prefix))
        keys = [b.meta.key for b in blocks]
        for shared_memory in (None, rng.random() < 0.5):
            got = client.fetch(keys, shared_memory=shared_memory)
            assert [b.meta.key for b in got] == keys[: len(got)]
            assert_intact(got)
            fetched += len(got)
            if shared_memory is None:
                for block, result in zip(blocks, client.put(blocks)):
                    if result is PutResult.STORED:
                        stored[block.meta.key.hex()] = stored.get(block.meta.key.hex(), 0) + 1
    print(json.dumps({"fetched": fetched, "stored": stored, "refetched": client.num_refetched}), flush=True)


if __name__ == "__main__":
    worker_main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4])
