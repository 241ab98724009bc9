"""A throwaway Redis/Valkey Cluster on loopback ports (Debian's redis-server), for tests and benchmarks."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

SERVER_NAMES = ("valkey-server", "redis-server")
CLI_NAMES = ("valkey-cli", "redis-cli")


def find_binaries() -> tuple[str, str] | None:
    """(server, cli) from PATH or /usr/bin, or None when neither Redis nor Valkey is installed."""
    path = os.environ.get("PATH", "") + os.pathsep + "/usr/bin" + os.pathsep + "/usr/local/bin"
    for server_name, cli_name in zip(SERVER_NAMES, CLI_NAMES):
        server, cli = shutil.which(server_name, path=path), shutil.which(cli_name, path=path)
        if server and cli:
            return server, cli
    return None


def free_ports(count: int) -> list[int]:
    """`count` distinct ports free now, whose port + 10000 (the cluster bus) is free too."""
    ports: list[int] = []
    while len(ports) < count:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 >= 65536 or port in ports:
            continue
        with socket.socket() as bus:
            try:
                bus.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        ports.append(port)
    return ports


class RedisCluster:
    """`num_primaries` redis-server processes in cluster mode, each with `replicas` replicas, in a temp dir.

    Configured as the docs recommend for a cache tier: no persistence, allkeys-lru under
    `maxmemory_bytes`, and shards that keep serving their own slots while another is down
    (cluster-require-full-coverage no, cluster-allow-reads-when-down yes).
    """

    def __init__(self, num_primaries: int = 3, *, maxmemory_bytes: int = 256 << 20, password: str = "",
                 tls_cert: str = "", tls_key: str = "", replicas: int = 0) -> None:
        found = find_binaries()
        if found is None:
            raise RuntimeError("redis-server is not installed: run scripts/setup_redis.sh")
        self.server_bin, self.cli_bin = found
        self.password = password
        self.tls_cert, self.tls_key = tls_cert, tls_key  # a self-signed certificate: also the CA
        self.maxmemory_bytes = maxmemory_bytes
        self.dir = tempfile.mkdtemp(prefix="tc-redis-", dir="/tmp")
        self.ports = free_ports(num_primaries * (1 + replicas))
        self.procs: dict[int, subprocess.Popen] = {}
        try:
            for port in self.ports:
                self.start_node(port)
            for port in self.ports:
                self._wait_ping(port)
            subprocess.run([self.cli_bin, *self._cli_options(), "--cluster", "create",
                            *(f"127.0.0.1:{p}" for p in self.ports), "--cluster-replicas", str(replicas),
                            "--cluster-yes"],
                           check=True, capture_output=True, timeout=60)
            self.wait_ok()
        except BaseException:
            self.close()
            raise

    @property
    def urls(self) -> str:
        """Every node as redis://127.0.0.1:PORT (rediss:// with TLS), comma-separated (remote.urls)."""
        scheme = "rediss" if self.tls_cert else "redis"
        return ",".join(f"{scheme}://127.0.0.1:{p}" for p in self.ports)

    def _cli_options(self) -> list[str]:
        auth = ["-a", self.password, "--no-auth-warning"] if self.password else []
        return auth + (["--tls", "--cacert", self.tls_cert] if self.tls_cert else [])

    def start_node(self, port: int) -> None:
        """Start (or restart, with its cluster state file) the node on `port`."""
        node_dir = os.path.join(self.dir, str(port))
        os.makedirs(node_dir, exist_ok=True)
        ports = (["--port", "0", "--tls-port", str(port), "--tls-cluster", "yes", "--tls-cert-file", self.tls_cert,
                  "--tls-key-file", self.tls_key, "--tls-ca-cert-file", self.tls_cert, "--tls-auth-clients", "no"]
                 if self.tls_cert else ["--port", str(port)])
        args = [self.server_bin, *ports, "--bind", "127.0.0.1", "--dir", node_dir,
                "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "2000",
                "--cluster-require-full-coverage", "no", "--cluster-allow-reads-when-down", "yes",
                "--save", "", "--appendonly", "no", "--maxmemory", str(self.maxmemory_bytes),
                "--maxmemory-policy", "allkeys-lru", "--protected-mode", "no", "--daemonize", "no",
                "--logfile", os.path.join(node_dir, "log")]
        if self.password:
            args += ["--requirepass", self.password, "--masterauth", self.password]
        self.procs[port] = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def kill_node(self, port: int) -> None:
        """SIGKILL the node on `port`: its slots are unreachable until a replica of it, if any, takes over."""
        proc = self.procs.pop(port)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

    def restart_node(self, port: int) -> None:
        self.start_node(port)
        self._wait_ping(port)
        self.wait_ok()

    def cli(self, port: int, *args: str) -> str:
        done = subprocess.run([self.cli_bin, *self._cli_options(), "-p", str(port), *args], capture_output=True,
                              text=True, timeout=30)
        return done.stdout.strip()

    def _wait_ping(self, port: int, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.cli(port, "ping") == "PONG":
                return
            time.sleep(0.05)
        raise RuntimeError(f"redis-server on port {port} did not answer within {timeout_s} s")

    def wait_ok(self, timeout_s: float = 60.0) -> None:
        """Until every running node reports cluster_state:ok."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all("cluster_state:ok" in self.cli(p, "cluster", "info") for p in self.procs):
                return
            time.sleep(0.1)
        raise RuntimeError(f"cluster not ok within {timeout_s} s")

    def node_id(self, port: int) -> str:
        return self.cli(port, "cluster", "myid")

    def start_migration(self, slot: int, src: int, dst: int) -> None:
        """Begin moving `slot` from the node on port `src` to the one on `dst`, and move its keys:
        until finish_migration, `src` answers ASK for them (redis-cli --cluster reshard, one slot)."""
        self.cli(dst, "cluster", "setslot", str(slot), "importing", self.node_id(src))
        self.cli(src, "cluster", "setslot", str(slot), "migrating", self.node_id(dst))
        for key in self.cli(src, "cluster", "getkeysinslot", str(slot), "1000").split():
            reply = self.cli(src, "migrate", "127.0.0.1", str(dst), key, "0", "5000")
            if reply != "OK":
                raise RuntimeError(f"MIGRATE {key} from {src} to {dst}: {reply}")

    def finish_migration(self, slot: int, dst: int) -> None:
        """Hand `slot` to the node on `dst` on every node: from now on the others answer MOVED."""
        dst_id = self.node_id(dst)
        for port in [dst, *(p for p in self.procs if p != dst)]:
            self.cli(port, "cluster", "setslot", str(slot), "node", dst_id)

    def count_keys(self, prefix: str) -> int:
        """Keys under `prefix` (`prefix:*`) on every running node."""
        return sum(len(self.cli(p, "--scan", "--pattern", f"{prefix}:*").split()) for p in self.procs)

    def wait_for_keys(self, prefix: str, count: int, timeout_s: float = 60.0) -> None:
        """Until the cluster holds at least `count` keys under `prefix` (daemons write asynchronously)."""
        deadline = time.monotonic() + timeout_s
        found = 0
        while time.monotonic() < deadline:
            found = self.count_keys(prefix)
            if found >= count:
                return
            time.sleep(0.1)
        raise AssertionError(f"the cluster holds {found} keys under {prefix}, expected {count}")

    def close(self) -> None:
        for proc in self.procs.values():
            proc.kill()
            proc.wait(10)
        self.procs.clear()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def remote_toml(urls: str, secret_file: str, *, key_prefix: str = "tiercache", **fields: object) -> str:
    """A [remote] section for a daemon's TOML config, on the cluster at `urls`."""
    lines = ["[remote]", "enabled = true", f'urls = "{urls}"', f'secret_file = "{secret_file}"',
             f'key_prefix = "{key_prefix}"']
    for name, value in fields.items():
        lines.append(f"{name} = " + (f'"{value}"' if isinstance(value, str) else str(value).lower()
                                     if isinstance(value, bool) else str(value)))
    return "\n".join(lines) + "\n"


def write_secret(path: str, secret: bytes) -> str:
    """The cluster-wide secret in a file only its owner may read."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secret)
    return path
