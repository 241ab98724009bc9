"""Single-instance guards: one daemon per data directory and per Unix socket path."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import stat

from tiercache.errors import AlreadyRunning, InvalidArgument

logger = logging.getLogger(__name__)


def _lock_file(path: str) -> int | None:
    """An fd holding an exclusive flock on `path` (created if needed), or None if another holds it.

    flock, not a pid file: the kernel drops the lock when its holder dies, so a crash leaves
    nothing stale behind to clean up.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def _holder(path: str) -> str:
    try:
        with open(path) as f:
            pid = f.read().strip()
    except OSError:
        pid = ""
    return f"pid {pid}" if pid.isdigit() else "another process"


class DataDirLock:
    """Exclusive ownership of a data directory via flock on <data_dir>/daemon.lock.

    Taken before the daemon touches anything else in the directory; AlreadyRunning otherwise.
    """

    def __init__(self, data_dir: str) -> None:
        self.path = os.path.join(data_dir, "daemon.lock")
        try:
            os.makedirs(data_dir, exist_ok=True)
            fd = _lock_file(self.path)
        except OSError as e:
            raise InvalidArgument(f"data_dir {data_dir!r} cannot hold the daemon's files: {e.strerror}") from None
        if fd is None:
            raise AlreadyRunning(f"another tiercache daemon ({_holder(self.path)}) owns data directory {data_dir}")
        self._fd: int | None = fd

    def release(self) -> None:
        """Drop the lock. Idempotent."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class SocketClaim:
    """Exclusive use of a Unix socket path.

    A flock on "<path>.lock" serialises daemons starting at the same moment; a connect test
    refuses a path that a live server (ours or a foreign one without the lock) answers on. Only a
    socket file nobody answers on is unlinked: gRPC itself would silently unlink a live one.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: int | None = None
        self._inode: int | None = None
        directory = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(directory):
            raise InvalidArgument(f"socket directory {directory} does not exist")
        lock_path = path + ".lock"
        fd = _lock_file(lock_path)
        if fd is None:
            raise AlreadyRunning(f"another tiercache daemon ({_holder(lock_path)}) owns socket {path}")
        self._fd = fd
        try:
            self._clear_stale()
        except BaseException:
            self.release()
            raise

    def _clear_stale(self) -> None:
        try:
            mode = os.lstat(self.path).st_mode
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(mode):
            raise InvalidArgument(f"socket path {self.path} exists and is not a socket; refusing to replace it")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(1.0)
        try:
            probe.connect(self.path)
        except OSError as e:
            if e.errno not in (errno.ECONNREFUSED, errno.ENOENT):
                raise AlreadyRunning(f"socket {self.path} is in an unknown state ({e.strerror}); "
                                     "not replacing it") from None
            logger.info("removing stale socket %s", self.path)
            os.unlink(self.path)
            return
        finally:
            probe.close()
        raise AlreadyRunning(f"a server is already listening on {self.path}")

    def bound(self) -> None:
        """Record the socket file the server just created, so release removes only that one."""
        self._inode = os.lstat(self.path).st_ino

    def release(self) -> None:
        """Remove our socket file and drop the lock. Idempotent."""
        if self._inode is not None:
            try:
                if os.lstat(self.path).st_ino == self._inode:
                    os.unlink(self.path)
            except FileNotFoundError:
                pass
            self._inode = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
