"""Staged Puts: payloads a same-host caller left in its staging file, read once into the daemon's memory."""

from __future__ import annotations

import logging
import os
import re
import stat
import threading
import time
from collections import OrderedDict

import numpy as np
import torch

from tiercache.errors import InvalidArgument
from tiercache.wire import STAGING_PREFIX

logger = logging.getLogger(__name__)

_NAME = re.compile(re.escape(STAGING_PREFIX) + r"[A-Za-z0-9_-]{1,64}")
_CLIENT_PID = re.compile(re.escape(STAGING_PREFIX) + r"([0-9]+)-")
ORPHAN_AGE_S = 600.0  # a dead client's staging file is removed once it is this old
OPEN_FILES = 64  # staging files kept open (one per live client, usually)


class StagedPayloads:
    """Reads staged payloads from files in one directory (the host tier's shm_dir).

    Each payload is read with pread into a buffer the daemon owns; a file is never mapped, so a
    caller that truncates or rewrites its file meanwhile yields a short read (an error) or bytes
    that fail their checksum (which the caller of `read` checks on the copy), never a SIGBUS.
    Descriptors are kept per file name, the least recently used closed past OPEN_FILES; a file
    replaced under the same name (another inode) is opened again. Only files of the daemon's own
    user or of one of its groups (server.local_group: the staging files of its members) are read: the
    directory is /dev/shm, where any local user may leave a file of that name.
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._uid = os.geteuid()
        self._gids = {os.getegid(), *os.getgroups()}
        self._lock = threading.Lock()
        self._fds: OrderedDict[str, tuple[int, int]] = OrderedDict()  # name -> (fd, inode)
        remove_orphans(directory)

    def read(self, name: str, offset: int, nbytes: int, where: str) -> torch.Tensor:
        """The nbytes at `offset` of staging file `name`, copied into a new uint8 tensor;
        InvalidArgument naming `where` for a bad name, an unreadable file or a range past its end."""
        if not _NAME.fullmatch(name):
            raise InvalidArgument(f"{where}.file {name[:80]!r} is not a staging file name ({STAGING_PREFIX} and "
                                  "1-64 letters, digits, '-' or '_')")
        if offset + nbytes > (1 << 63) - 1:
            raise InvalidArgument(f"{where}: offset {offset} + {nbytes} bytes is past any file")
        out = np.empty(nbytes, dtype=np.uint8)
        fd = self._fd(name, where)
        try:
            got = os.preadv(fd, [out.data], offset) if nbytes else 0
        except OSError as e:
            raise InvalidArgument(f"{where}: reading staging file {name} failed: {e}") from None
        finally:
            os.close(fd)
        if got != nbytes:
            raise InvalidArgument(f"{where}: staging file {name} holds {got} of the {nbytes} bytes at offset {offset}")
        return torch.from_numpy(out)

    def _fd(self, name: str, where: str) -> int:
        """A descriptor of the file for this read alone (a dup of the kept one: closing the kept one
        meanwhile can then never make a read land in another file that reused its number)."""
        path = os.path.join(self.directory, name)
        try:
            st = os.stat(path, follow_symlinks=False)
        except OSError as e:
            self._forget(name)  # its client removed it: the kept descriptor would hold its memory
            raise InvalidArgument(f"{where}: staging file {name} cannot be read in {self.directory}: {e}") from None
        if not stat.S_ISREG(st.st_mode):
            raise InvalidArgument(f"{where}: staging file {name} is not a regular file")
        with self._lock:
            kept = self._fds.get(name)
            if kept is not None and kept[1] == st.st_ino:
                self._fds.move_to_end(name)
                return os.dup(kept[0])
        self._close_removed()
        try:
            # O_NONBLOCK: a FIFO swapped in after the stat must not block this thread in open().
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as e:
            raise InvalidArgument(f"{where}: staging file {name} cannot be opened: {e}") from None
        opened = os.fstat(fd)
        if not stat.S_ISREG(opened.st_mode):  # replaced between the stat and the open
            os.close(fd)
            raise InvalidArgument(f"{where}: staging file {name} is not a regular file")
        if self._uid != 0 and opened.st_uid != self._uid and opened.st_gid not in self._gids:
            os.close(fd)
            raise InvalidArgument(f"{where}: staging file {name} belongs to uid {opened.st_uid} and group "
                                  f"{opened.st_gid}: neither the daemon's user nor one of its groups")
        with self._lock:
            old = self._fds.pop(name, None)
            self._fds[name] = (fd, opened.st_ino)
            closing = [old[0]] if old is not None else []
            while len(self._fds) > OPEN_FILES:
                closing.append(self._fds.popitem(last=False)[1][0])
            mine = os.dup(fd)
        for stale in closing:
            os.close(stale)
        return mine

    def _forget(self, name: str) -> None:
        with self._lock:
            kept = self._fds.pop(name, None)
        if kept is not None:
            os.close(kept[0])

    def _close_removed(self) -> None:
        """Close the kept descriptors of files their clients have removed (a closed client's file
        stays in shared memory while a descriptor holds it)."""
        with self._lock:
            gone = [name for name, (fd, _) in self._fds.items() if os.fstat(fd).st_nlink == 0]
        for name in gone:
            self._forget(name)

    def close(self) -> None:
        with self._lock:
            fds, self._fds = [fd for fd, _ in self._fds.values()], OrderedDict()
        for fd in fds:
            os.close(fd)


def remove_orphans(directory: str, min_age_s: float = ORPHAN_AGE_S) -> list[str]:
    """Remove the staging files of clients that died without closing (SIGKILL, a crash): named by a
    pid that no longer runs, and untouched for min_age_s (a client in another pid namespace keeps
    writing its file). Returns the names removed."""
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    now = time.time()
    for name in names:
        match = _CLIENT_PID.match(name)
        if match is None or not _NAME.fullmatch(name):
            continue
        try:
            os.kill(int(match.group(1)), 0)
            continue  # that pid runs
        except ProcessLookupError:
            pass
        except (PermissionError, OverflowError):
            continue  # runs as another user, or no such pid could exist: leave it
        path = os.path.join(directory, name)
        try:
            if now - os.stat(path, follow_symlinks=False).st_mtime >= min_age_s:
                os.unlink(path)
                removed.append(name)
        except OSError:  # e.g. a member's file in a sticky directory (/dev/shm): only its owner may remove it
            continue
    if removed:
        logger.info("removed staging files=%d of clients that are gone from %s", len(removed), directory)
    return removed
