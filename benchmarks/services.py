"""The cache processes the benchmark starts and restarts (redis-server, the tiercache daemon) and their memory."""

from __future__ import annotations

import importlib.util
import logging
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time

logger = logging.getLogger(__name__)

REDIS_INSTALL = "apt-get install redis-server"
REDIS_PY_INSTALL = "pip install redis"


def redis_unavailable_reason() -> str | None:
    """Why the Redis row cannot run here (with the command that fixes it), or None when it can."""
    missing = []
    if shutil.which("redis-server") is None:
        missing.append(f"redis-server is not installed (`{REDIS_INSTALL}`)")
    if importlib.util.find_spec("redis") is None:
        missing.append(f"the redis Python client is not installed (`{REDIS_PY_INSTALL}`)")
    return "; ".join(missing) or None


def proc_status_bytes(pid: int, field: str) -> int | None:
    """A `kB` field of /proc/<pid>/status (VmHWM: peak resident set, VmRSS: now) in bytes; None if unreadable."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of process `pid` so far, all its threads (/proc/<pid>/stat); None if unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def reset_peak_rss(pid: int) -> bool:
    """Restart VmHWM from the current RSS (Linux clear_refs "5"), so a peak belongs to one phase."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class _Process:
    """A child process whose stdout lines are queued and stderr kept for error messages."""

    def __init__(self, cmd: list[str], env: dict[str, str] | None = None, cwd: str | None = None) -> None:
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                     text=True, env=env, cwd=cwd)
        self.lines: queue.Queue[str] = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self._pump, args=(self.proc.stdout, self.lines.put), daemon=True).start()
        threading.Thread(target=self._pump, args=(self.proc.stderr, self.stderr.append), daemon=True).start()

    @staticmethod
    def _pump(stream, sink) -> None:
        for line in stream:
            sink(line)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, timeout_s: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    def failure(self, what: str) -> RuntimeError:
        return RuntimeError(f"{what} (rc={self.proc.poll()}):\n{''.join(self.stderr[-30:])}")


class RedisServer:
    """redis-server on a Unix socket in `workdir`, persistence off (no RDB snapshots, no AOF)."""

    def __init__(self, workdir: str) -> None:
        self.workdir = workdir
        self.socket = os.path.join(workdir, "redis.sock")
        self._proc: _Process | None = None
        self.idle_rss_bytes: int | None = None

    def start(self, timeout_s: float = 30.0) -> None:
        import redis

        os.makedirs(self.workdir, exist_ok=True)
        cmd = ["redis-server", "--port", "0", "--unixsocket", self.socket, "--unixsocketperm", "700",
               "--save", "", "--appendonly", "no", "--dir", self.workdir, "--daemonize", "no",
               "--loglevel", "warning"]
        self._proc = _Process(cmd)
        deadline = time.monotonic() + timeout_s
        while True:
            if self._proc.proc.poll() is not None or time.monotonic() > deadline:
                raise self._proc.failure("redis-server did not start")
            try:
                with redis.Redis(unix_socket_path=self.socket, socket_timeout=1) as r:
                    r.ping()
                break
            except (redis.ConnectionError, redis.TimeoutError, FileNotFoundError):
                time.sleep(0.05)
        self.idle_rss_bytes = proc_status_bytes(self.pid, "VmRSS")
        logger.info("redis-server pid=%d socket=%s", self.pid, self.socket)

    @property
    def pid(self) -> int:
        assert self._proc is not None, "redis-server is not running"
        return self._proc.pid

    def peak_rss_bytes(self) -> int | None:
        return proc_status_bytes(self.pid, "VmHWM")

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.stop()
            self._proc = None


class TierCacheDaemon:
    """`python3 -m tiercache.cli serve --config ...` with a config sized for the run; restartable on the same data."""

    def __init__(self, workdir: str, repo: str, *, host_bytes: int, disk_bytes: int) -> None:
        self.workdir = workdir
        self.repo = repo
        self.socket = os.path.join(workdir, "tc.sock")
        self.config_path = os.path.join(workdir, "tiercache.toml")
        os.makedirs(workdir, exist_ok=True)
        with open(self.config_path, "w") as f:
            f.write(f'data_dir = "{os.path.join(workdir, "data")}"\n'
                    f"[host]\ncapacity_bytes = {host_bytes}\n"
                    f"[disk]\ncapacity_bytes = {max(disk_bytes, host_bytes)}\n"
                    f'[server]\nsocket = "{self.socket}"\nidle_check_s = 30.0\n')
        self._proc: _Process | None = None
        self._ready = False
        self.idle_rss_bytes: int | None = None

    @property
    def address(self) -> str:
        return f"unix:{self.socket}"

    def launch(self) -> None:
        """Start the process without waiting (its imports take seconds: overlap them with other work)."""
        env = {**os.environ, "PYTHONPATH": self.repo + os.pathsep + os.environ.get("PYTHONPATH", "")}
        cmd = [sys.executable, "-m", "tiercache.cli", "serve", "--config", self.config_path, "--log-level", "WARNING"]
        self._proc = _Process(cmd, env=env, cwd=self.repo)
        self._ready = False

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        """Block until the daemon prints its "listening on" line; RuntimeError with its stderr if it does not."""
        assert self._proc is not None, "launch the daemon first"
        if self._ready:
            return
        deadline = time.monotonic() + timeout_s
        line = ""
        while time.monotonic() < deadline:
            try:
                line = self._proc.lines.get(timeout=0.2)
                break
            except queue.Empty:
                if self._proc.proc.poll() is not None:  # died before printing: no point waiting
                    break
        if not line.startswith("tiercache listening on "):
            self._proc.stop()
            raise self._proc.failure(f"the tiercache daemon did not start ({line.strip()!r})")
        self._ready = True
        self.idle_rss_bytes = proc_status_bytes(self.pid, "VmRSS")
        logger.info("tiercache daemon pid=%d socket=%s", self.pid, self.socket)

    def start(self) -> None:
        self.launch()
        self.wait_ready()

    @property
    def pid(self) -> int:
        assert self._proc is not None, "the daemon is not running"
        return self._proc.pid

    def peak_rss_bytes(self) -> int | None:
        return proc_status_bytes(self.pid, "VmHWM")

    def stop(self) -> None:
        if self._proc is not None:
            rc = self._proc.stop()
            if rc != 0:
                logger.warning("daemon exited rc=%s: %s", rc, "".join(self._proc.stderr[-10:]))
            self._proc = None

    def restart(self) -> None:
        self.stop()
        self.start()
