"""A same-host client's staging file: Put payloads written into shared memory once, read by the daemon."""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import secrets
import stat
import threading
import time
import weakref
from collections.abc import Callable, Sequence

import grpc
import numpy as np
import torch

from tiercache import wire
from tiercache.block import Block
from tiercache.codec import plain_record_parts
from tiercache.v1 import tiercache_pb2 as pb
from tiercache.wire import STAGING_PREFIX

logger = logging.getLogger(__name__)

ALIGN_BYTES = 64  # each payload starts on a cache line
MIN_BYTES = 1 << 20


class StagingArea:
    """One file in the daemon's staging directory (SlabInfo.staging_dir) that only this client
    writes, mapped read-write and grown to the largest Put it carried; the daemon only reads it.
    Removed by close(), or when the area is collected. Not thread-safe: the caller holds one lock
    from write() until the daemon has answered the Put that names the offsets."""

    def __init__(self, directory: str, daemon_file: str | None = None) -> None:
        self.name = f"{STAGING_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
        self.path = os.path.join(directory, self.name)
        # 0o600, as the slab: it holds this caller's blocks. A caller of another user than the
        # daemon's (a member of server.local_group) gives it to the group of `daemon_file`, so the
        # daemon can read it (see share_with_daemon).
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        if daemon_file:
            share_with_daemon(self._fd, daemon_file)
        self._map: mmap.mmap | None = None
        self._array: np.ndarray | None = None
        self.size = 0
        self._finalizer = weakref.finalize(self, _remove, self.path, self._fd)

    def write(self, payloads: Sequence[torch.Tensor]) -> list[int]:
        """Copy each payload (1-D uint8, contiguous) into the file; returns where each starts."""
        offsets, total = [], 0
        for payload in payloads:
            offsets.append(total)
            total += -(-payload.numel() // ALIGN_BYTES) * ALIGN_BYTES
        self._reserve(total)
        array = self._array
        assert array is not None
        for start, payload in zip(offsets, payloads):
            source = payload if payload.device.type == "cpu" else payload.cpu()
            array[start : start + source.numel()] = source.numpy()
        return offsets

    def _reserve(self, nbytes: int) -> None:
        if nbytes <= self.size:
            return
        size = max(nbytes, 2 * self.size, MIN_BYTES)
        size += -size % mmap.PAGESIZE
        self._array = None
        if self._map is not None:
            self._map.close()
        os.ftruncate(self._fd, size)
        self._map = mmap.mmap(self._fd, size)
        self._array = np.frombuffer(self._map, dtype=np.uint8)
        self.size = size

    def close(self) -> None:
        """Unmap and remove the file. Idempotent."""
        self._array = None
        if self._map is not None:
            with contextlib.suppress(BufferError):
                self._map.close()
            self._map = None
        self._finalizer()


def share_with_daemon(fd: int, daemon_file: str) -> None:
    """Make the file `fd` readable by the group of a file the daemon shares with server.local_group
    (its index), when this process is not that file's owner: chgrp, then mode 0640 (the order leaves
    the file readable by no other group meanwhile). Nothing changes for the daemon's own user, or
    when the daemon shares nothing with a group; a failure is logged (the daemon then refuses the
    staged Put, and the caller puts bytes)."""
    try:
        st = os.stat(daemon_file)
        if st.st_uid == os.geteuid() or not st.st_mode & stat.S_IRGRP:
            return
        os.fchown(fd, -1, st.st_gid)
        os.fchmod(fd, 0o640)
    except OSError as e:
        logger.info("cannot give a staging file to the group of %s: %s", daemon_file, e)


def _remove(path: str, fd: int) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)
    with contextlib.suppress(OSError):
        os.close(fd)


class StagedPuts:
    """A client's staged Puts: payloads into its StagingArea, only headers and offsets over gRPC.

    `send(message)` makes the PutBatch call (raising grpc.RpcError). A daemon that refuses a staged
    Put as such (an older daemon without staging, a staging directory this process cannot write, a
    file the daemon cannot read) is logged once with its reason and counted in num_fallbacks; the
    caller then puts over the byte path, and staging is tried again after RETRY_S.
    """

    RETRY_S = 300.0

    def __init__(self, daemon_file: Callable[[], str | None] = lambda: None) -> None:
        self._daemon_file = daemon_file  # see StagingArea
        self._area: StagingArea | None = None
        self._lock = threading.Lock()
        self._retry_at = 0.0
        self.num_staged = 0  # blocks whose payload went through the staging file
        self.num_fallbacks = 0  # staged Puts refused (or staging not possible), sent as bytes instead

    def put(self, directory: str, blocks: Sequence[Block], requests: Sequence[pb.PutRequest],
            send: Callable[[bytes], pb.PutResponse]) -> pb.PutResponse | None:
        """The daemon's reply to the staged Put of `blocks` (each with its PutRequest but the record
        and `staged`), or None when it must go as bytes (see the class docstring)."""
        if time.monotonic() < self._retry_at:
            return None
        with self._lock:
            area = self._open(directory)
            if area is None:
                return None
            parts = [plain_record_parts(b)[0] for b in blocks]  # validates each block first
            for request, start in zip(requests, area.write([b.payload for b in blocks])):
                request.staged.file, request.staged.offset = area.name, start
            message = wire.put_batch([((head,), r.SerializeToString()) for head, r in zip(parts, requests)])
            for request in requests:
                request.ClearField("staged")  # the requests may go again, as bytes
            try:
                reply = send(message)
            except grpc.RpcError as e:
                # The daemon names `records[n].staged` in what it refuses about staging itself; one
                # without PutBatch (older) has no staging either.
                staging_refused = e.code() == grpc.StatusCode.INVALID_ARGUMENT and ".staged" in (e.details() or "")
                if not staging_refused and e.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise
                self._give_up(f"the daemon refused a staged Put: {e.details()}")
                if self._area is not None:  # perhaps removed from outside: the next try makes a new one
                    self._area.close()
                    self._area = None
                return None
        self.num_staged += len(blocks)
        return reply

    def _open(self, directory: str) -> StagingArea | None:
        if self._area is not None and os.path.dirname(self._area.path) == directory:
            return self._area
        if self._area is not None:
            self._area.close()
            self._area = None
        if not directory:
            self._give_up("the daemon announced no staging directory")
            return None
        try:
            self._area = StagingArea(directory, self._daemon_file())
        except OSError as e:
            self._give_up(f"cannot create a staging file in {directory}: {e}")
        return self._area

    def _give_up(self, why: str) -> None:
        self.num_fallbacks += 1
        self._retry_at = time.monotonic() + self.RETRY_S
        logger.warning("%s; putting payloads over gRPC for the next %.0f s", why, self.RETRY_S)

    def close(self) -> None:
        with self._lock:
            if self._area is not None:
                self._area.close()
                self._area = None
