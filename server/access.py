"""Who reaches the daemon on this host: its socket and same-host files, for its user or also server.local_group."""

from __future__ import annotations

import grp
import logging
import os
import stat
from pathlib import Path

from tiercache.errors import InvalidArgument
from tiercache.store import TieredStore
from tiercache.tiers.disk import DiskTier
from tiercache.tiers.disk_env import set_file_access
from tiercache.tiers.host import HostTier

logger = logging.getLogger(__name__)

SLAB_MODE = 0o660  # members copy blocks out of it, and write the pages the daemon reserved to them
INDEX_MODE = 0o640  # only the daemon writes the index
SOCKET_MODE = 0o660  # connect() on a Unix socket needs write permission on its file
PUBLIC_SOCKET_MODE = 0o666  # anyone may connect: the kernel names the caller (server/peers.py)


def resolve_group(spec: str) -> int | None:
    """The gid server.local_group names (None when it is empty). InvalidArgument for a group this
    host does not know, or one the daemon's user may not give its files to (a non-root process
    chowns only to its own groups)."""
    if not spec:
        return None
    try:
        gid = int(spec) if spec.isdigit() else grp.getgrnam(spec).gr_gid
    except KeyError:
        raise InvalidArgument(f"server.local_group {spec!r}: no such group on this host") from None
    if os.geteuid() != 0 and gid != os.getegid() and gid not in os.getgroups():
        raise InvalidArgument(f"server.local_group {spec!r}: the daemon's user (uid {os.geteuid()}) is not in group "
                              f"{gid}; add it (usermod -aG, or SupplementaryGroups= in the systemd unit)")
    return gid


def share_store(store: TieredStore, data_dir: str, gid: int) -> None:
    """Hand the host slab, its index and the disk tier's files to group gid (see the *_MODE constants
    and disk_env.GROUP_MODES), and let the group through data_dir to the disk tier."""
    if isinstance(store.host, HostTier):
        for path, mode in ((store.host.slab_path, SLAB_MODE), (store.host.index_path, INDEX_MODE)):
            os.chown(path, -1, gid)  # before the mode: never readable by the group it had
            os.chmod(path, mode)
        warn_unless_reachable(os.path.dirname(store.host.slab_path), gid, "host.shm_dir")
    if isinstance(store.disk, DiskTier):
        parent = store.disk.path.parent
        if Path(data_dir).resolve() == parent.resolve():
            _let_group_through(parent, gid)
        set_file_access(store.disk.path, gid)
        warn_unless_reachable(str(store.disk.path), gid, "data_dir")


def share_socket(path: str, gid: int) -> None:
    """Let group gid connect to the daemon's Unix socket (just bound)."""
    os.chown(path, -1, gid)
    os.chmod(path, SOCKET_MODE)
    warn_unless_reachable(os.path.dirname(os.path.abspath(path)), gid, "server.socket")


def _let_group_through(directory: Path, gid: int) -> None:
    """Make a directory of the daemon's own (data_dir) searchable by group gid, without listing
    rights it did not have; one the group can search already, or another user's, is left alone."""
    st = directory.stat()
    if _searchable(st, gid) or st.st_uid != os.geteuid():
        return
    os.chown(directory, -1, gid)
    os.chmod(directory, stat.S_IMODE(st.st_mode) & ~stat.S_IRWXG | stat.S_IXGRP)


def _searchable(st: os.stat_result, gid: int | None) -> bool:
    """Whether a user who is not the owner, and is in group gid (None: in no group of the file's),
    may pass through a directory."""
    return bool(st.st_mode & stat.S_IXGRP) if gid is not None and st.st_gid == gid else bool(st.st_mode & stat.S_IXOTH)


def unreachable_dir(directory: str, gid: int | None) -> str:
    """The first directory on the way to `directory` (itself included) that a member of gid (None: any
    other user) may not pass through; "" when none. Judged by the modes alone (no ACLs)."""
    path = Path(os.path.abspath(directory))
    for step in (*reversed(path.parents), path):
        try:
            if not _searchable(step.stat(), gid):
                return str(step)
        except OSError:
            return str(step)
    return ""


def warn_unless_reachable(directory: str, gid: int | None, field: str) -> None:
    """Log (not fail: a container may see the path through a bind mount) when the callers meant to
    reach `directory` cannot pass through a directory on the way."""
    blocked = unreachable_dir(directory, gid)
    if blocked:
        who = f"members of group {gid}" if gid is not None else "other users"
        logger.warning("%s: %s cannot pass through %s, so not reach %s (docs/local-users.md)", field, who, blocked,
                       directory)
