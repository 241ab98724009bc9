"""The disk tier's reserve: a ballast file that keeps filesystem space for deletes on a full disk."""

from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)


class Reserve:
    """A ballast file in the disk tier's directory: filesystem space held back so that deletes can still
    commit when the filesystem is full. LMDB is copy-on-write, so a delete needs fresh pages too (new
    leaves, the free list recording the pages it frees); without them a full filesystem could never be
    emptied from the inside. Released when a delete cannot commit, filled again after a commit succeeds."""

    def __init__(self, path: Path, target_bytes: int) -> None:
        self.path = path
        self.target_bytes = target_bytes
        self.size = self._allocated()

    def _allocated(self) -> int:
        try:
            return os.stat(self.path).st_blocks * 512
        except FileNotFoundError:
            return 0

    def free_bytes(self) -> int:
        """Free bytes on the filesystem, for an unprivileged process."""
        vfs = os.statvfs(self.path.parent)
        return vfs.f_bavail * vfs.f_frsize

    def fill(self) -> None:
        """Grow the file toward target_bytes, as far as the filesystem's free space allows. Cheap when whole."""
        if self.size >= self.target_bytes:
            return
        try:
            want = min(self.target_bytes, self.size + self.free_bytes())
            if want > self.size:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
                try:
                    os.posix_fallocate(fd, 0, want)
                finally:
                    os.close(fd)
        except OSError as e:  # the filesystem filled meanwhile: keep what we got, try again later
            logger.debug("disk tier reserve %s: cannot grow to bytes=%d: %s", self.path, self.target_bytes, e)
        self.size = self._allocated()

    def release(self) -> int:
        """Delete the file; returns the bytes it held."""
        freed = self._allocated()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        self.size = 0
        return freed
