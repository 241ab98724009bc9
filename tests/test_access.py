"""Local users other than the daemon's: server.local_group's members get the same-host paths, everyone
else the public socket as the tenant the kernel's account of their uid names (server/access.py,
server/peers.py, tiercache/client/peer.py). The tests at the end run the daemon and its callers as
separate uids (root drops to them in each child process; no accounts are created)."""

from __future__ import annotations

import grp
import json
import os
import pathlib
import pwd
import queue
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import IO, Any

import grpc
import pytest

from benchmarks.daemons import assert_intact, chain, running_server, small_config, tokens
from server import peers
from server.app import create_server
from server.instance import DataDirLock
from tiercache.block import Block, PutResult
from tiercache.client import CHANNEL_OPTIONS, Client, local_client
from tiercache.client.stage import StagingArea
from tiercache.codec import plain_record_parts
from tiercache.config import Config, load_config
from tiercache.errors import InvalidArgument, PermissionDenied, Unauthenticated
from tiercache.store import TieredStore
from tiercache.tenancy import scope_keys
from tiercache.v1 import tiercache_pb2 as pb
from tiercache.v1 import tiercache_pb2_grpc as pb_grpc

REPO = pathlib.Path(__file__).resolve().parent.parent


def mode(path: str | pathlib.Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def public_config(base: str, **server: Any) -> Config:
    return small_config(base, public_socket=os.path.join(base, "public.sock"), **server)


def staged_put(target: str, area: StagingArea, block: Block) -> pb.PutResponse:
    """A PutBatch whose one record's payload is in `area` (as a same-host client stages it)."""
    offset = area.write([block.payload])[0]
    request = pb.PutRequest(record=plain_record_parts(block)[0], last=True,
                            staged=pb.StagedPayload(file=area.name, offset=offset))
    with grpc.insecure_channel(target, options=CHANNEL_OPTIONS) as channel:
        return pb_grpc.TierCacheStub(channel).PutBatch(pb.PutBatchRequest(requests=[request]), timeout=10)


# ---- one uid: modes, the public socket's tenancy, its refusals -------------------------------------------


def test_the_daemons_files_are_its_users_alone_without_a_local_group(base):
    config = small_config(base)
    with running_server(config) as (store, _):
        assert mode(store.host.slab_path) == 0o600 and mode(store.host.index_path) == 0o600
        disk = pathlib.Path(config.data_dir, "disk")
        # LMDB made data.mdb 0644: every local user could read every tenant's blocks from it.
        assert (mode(disk), mode(disk / "data.mdb"), mode(disk / "lock.mdb"), mode(disk / "LOCK")) == \
            (0o700, 0o600, 0o600, 0o600)


def test_a_local_group_gets_the_socket_slab_index_and_disk_files(base):
    gid = os.getegid()
    config = small_config(base, local_group=str(gid))
    with running_server(config) as (store, _):
        disk = pathlib.Path(config.data_dir, "disk")
        expected = {store.host.slab_path: 0o660, store.host.index_path: 0o640, config.server.socket: 0o660,
                    disk: 0o750, disk / "data.mdb": 0o640, disk / "lock.mdb": 0o660, disk / "LOCK": 0o600}
        assert {str(p): (mode(p), os.stat(p).st_gid) for p in expected} == \
            {str(p): (m, gid) for p, m in expected.items()}
    # Dropped again at the next start without the group: the config says who may read them.
    config = small_config(base)
    with running_server(config):
        assert (mode(disk), mode(disk / "data.mdb"), mode(disk / "lock.mdb")) == (0o700, 0o600, 0o600)


def test_a_public_caller_is_the_tenant_its_uid_names_and_gets_no_shared_memory(base):
    config = public_config(base, public_tenants={str(os.getuid()): "me"})
    with running_server(config) as (store, address):
        public = f"unix:{config.server.public_socket}"
        assert mode(config.server.public_socket) == 0o666
        mine, theirs = chain(tokens(1, 3)), chain(tokens(2, 2))
        with Client(address) as operator, Client(public) as me:
            assert operator.put(theirs) == [PutResult.STORED] * 2 and me.put(mine) == [PutResult.STORED] * 3
            assert me.stats().tenant == "me"
            assert_intact(me.fetch([b.meta.key for b in mine]))
            assert me.lookup([b.meta.key for b in mine]) == ["host"] * 3
            # A plain Client works as is: the daemon refuses it the slab, and it fetches bytes.
            assert not me._slab.usable and me.num_local == 0 and me.num_staged_puts == 0
            # Tenancy holds both ways, on every rpc.
            assert me.lookup([b.meta.key for b in theirs]) == [] and me.fetch([b.meta.key for b in theirs]) == []
            assert operator.lookup([b.meta.key for b in mine]) == []
            assert {e.store_key for e in me.list()} == set(scope_keys("me", [b.meta.key for b in mine]))
            their_store_keys = scope_keys("local", [b.meta.key for b in theirs])
            assert me.fetch_store_keys(their_store_keys) == [] and me.evict(store_keys=their_store_keys) == 0
            stats = me.stats()
            assert stats.tenants == [] and all(t.num_blocks == t.used_bytes == 0 for t in stats.tiers)
            with pytest.raises(PermissionDenied):
                me.flush(tenant="local")
            assert operator.lookup([b.meta.key for b in theirs]) == ["host"] * 2
            # No shared memory, asked for outright: no slab descriptors, no staged Put.
            with grpc.insecure_channel(public, options=CHANNEL_OPTIONS) as channel:
                with pytest.raises(grpc.RpcError) as info:
                    pb_grpc.TierCacheStub(channel).FetchShared(pb.FetchRequest(shared_memory=True), timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            area = StagingArea(os.path.dirname(store.host.slab_path))
            try:
                with pytest.raises(grpc.RpcError) as info:
                    staged_put(public, area, chain(tokens(3, 1))[0])
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and ".staged" in info.value.details()
            finally:
                area.close()
            assert local_client(config.server.socket, config.server.public_socket).target == address
        store.check_integrity()
        assert {e.meta.tenant for e in store.entries()} == {"me", "local"}


def test_wrong_or_missing_credentials_on_the_public_socket_are_unauthenticated(base):
    config = public_config(base, public_tenants={str(os.getuid() + 1): "someone-else"}, tokens={"tok-api": "api"})
    lock = DataDirLock(config.data_dir)
    store = TieredStore.open(config)
    server, address = create_server(config, store)
    server.start()
    try:
        public = f"unix:{config.server.public_socket}"
        with Client(public) as nobody, pytest.raises(Unauthenticated, match=f"uid {os.getuid()} has no tenant"):
            nobody.lookup([b.meta.key for b in chain(tokens(4, 1))])
        with Client(public, token="not-a-token") as wrong, pytest.raises(Unauthenticated, match="unknown token"):
            wrong.stats()
        with Client(public, token="tok-api", shared_memory=False) as api:
            assert api.stats().tenant == "api" and api.health() == "SERVING"
        # The listener behind the public socket takes only connections the public socket relayed.
        assert isinstance(server, peers.WithPublicSocket)
        internal = server.public.internal_address
        with Client(f"unix:{internal}") as direct, pytest.raises(Unauthenticated, match="public socket only"):
            direct.stats()
        with Client(address) as operator:
            assert operator.health() == "SERVING" and operator.stats().tenant == "local"
    finally:
        server.stop(1).wait()
        server.wait_for_termination()
        store.close()
        lock.release()
    assert not os.path.exists(os.path.dirname(internal))  # the public socket's own file: see the next test


def test_one_local_user_cannot_take_every_relayed_connection(base, monkeypatch):
    monkeypatch.setattr(peers, "MAX_CONNECTIONS_PER_UID", 1)
    config = public_config(base, public_tenants={str(os.getuid()): "me"})
    with running_server(config):
        public = f"unix:{config.server.public_socket}"
        with Client(public, timeout_s=3) as first, Client(public, timeout_s=3) as second:
            assert first.stats().tenant == "me"
            with pytest.raises(Exception, match="(?i)unavailable|closed|connect"):
                second.stats()
            assert first.stats().tenant == "me"
    # Stopped: the public socket's file goes with the daemon (released once the servers terminate).
    deadline = time.monotonic() + 10
    while os.path.exists(config.server.public_socket) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(config.server.public_socket)


def test_the_new_fields_are_checked():
    def fails(match: str, **server: object) -> None:
        with pytest.raises(ValueError, match=match):
            load_config(env={}, overrides=[(f"server.{k}", v) for k, v in server.items()])

    fails("server.local_group", local_group="two words")
    fails("server.public_tenants", public_tenants={"1001": "x"})
    fails("not 'local'", public_socket="/tmp/p.sock", public_tenants={"1001": "local"})
    fails("a uid or a user name", public_socket="/tmp/p.sock", public_tenants={"bad user": "x"})
    fails("must differ from server.socket", socket="/tmp/a.sock", public_socket="/tmp/a.sock")
    loaded = load_config(env={"TIERCACHE_SERVER__PUBLIC_TENANTS": "1001=vllm,api=api",
                              "TIERCACHE_SERVER__PUBLIC_SOCKET": "~/p.sock"})
    assert loaded.server.public_tenants == {"1001": "vllm", "api": "api"}
    assert loaded.server.public_socket == os.path.expanduser("~/p.sock")


def test_a_group_or_user_the_host_does_not_know_stops_the_start_with_its_field(base):
    with pytest.raises(InvalidArgument, match="server.local_group 'no-such-group-tc'"):
        create_server(small_config(base, local_group="no-such-group-tc"))
    with pytest.raises(InvalidArgument, match="server.public_tenants: no user 'no-such-user-tc'"):
        create_server(public_config(base, public_tenants={"no-such-user-tc": "x"}))


# ---- separate uids --------------------------------------------------------------------------------------

def _passable(path: str, *, list_too: bool = False) -> bool:
    """Whether a user in none of its groups may reach `path` (o+x on every directory on the way) and
    execute it, or with list_too list it (o+rx: Python's import system lists its path entries)."""
    real = pathlib.Path(os.path.realpath(path))
    try:
        if not all(os.stat(d).st_mode & stat.S_IXOTH for d in real.parents):
            return False
        need = stat.S_IROTH | stat.S_IXOTH if list_too else stat.S_IXOTH
        return os.stat(real).st_mode & need == need
    except OSError:
        return False


def python_for_other_uids() -> tuple[str, str] | None:
    """(interpreter, PYTHONPATH) that another uid can run with this environment's packages: this
    interpreter, or another of the same minor version (this one may live under root's 0700 home, as
    pyenv puts it; compiled packages keep the minor version's ABI); None when there is none."""
    import shutil
    import site

    paths = [str(REPO), *site.getsitepackages()]
    if not all(_passable(p, list_too=True) for p in paths):
        return None
    name = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for candidate in (sys.executable, shutil.which(name), f"/usr/bin/{name}", f"/usr/local/bin/{name}"):
        if candidate and os.path.exists(candidate) and _passable(candidate):
            return candidate, os.pathsep.join(paths)
    return None


PYTHON = python_for_other_uids()
_SKIP_REASON = ("needs root (CAP_SETUID, CAP_SETGID, CAP_CHOWN) to run the daemon and its callers as other uids; "
                "no accounts are created: the children drop to unused numeric uids") if os.geteuid() != 0 else \
    "no /dev/shm" if not os.path.isdir("/dev/shm") else \
    (f"no Python {sys.version_info.major}.{sys.version_info.minor} that other uids may run with this environment's "
     f"packages ({sys.executable} or its packages lie under a directory they cannot pass)") if PYTHON is None else ""
needs_root = pytest.mark.skipif(bool(_SKIP_REASON), reason=_SKIP_REASON)

CHILD = r'''
import json, os, socket, sys
sys.path.insert(0, os.environ["TC_REPO"])
import grpc
from benchmarks.daemons import assert_intact, chain, tokens
from tiercache.client import CHANNEL_OPTIONS, Client, local_client
from tiercache.client.stage import StagingArea
from tiercache.codec import plain_record_parts
from tiercache.v1 import tiercache_pb2 as pb, tiercache_pb2_grpc as pb_grpc

role, a = sys.argv[1], json.loads(sys.argv[2])
out = {"uid": os.getuid(), "groups": sorted(os.getgroups())}

def try_open(path, flags=os.O_RDONLY):
    try:
        os.close(os.open(path, flags))
        return "ok"
    except OSError as e:
        return type(e).__name__

def try_connect(path):
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(path)
        return "ok"
    except OSError as e:
        return type(e).__name__
    finally:
        s.close()

def error(call):
    try:
        call()
        return "ok"
    except grpc.RpcError as e:
        return f"{e.code().name}: {e.details()}"
    except Exception as e:
        return f"{type(e).__name__}: {e}"

for name in ("slab", "index", "data", "lock"):
    out[f"open_{name}"] = try_open(a[name], os.O_RDWR if name in ("slab", "lock") else os.O_RDONLY)
out["connect_socket"] = try_connect(a["socket"])
client = local_client(a["socket"], a["public"], timeout_s=30, token=a.get("token"))
out["target"] = client.target
blocks = chain(tokens(a["seed"], 4))
keys = [b.meta.key for b in blocks]
if role == "stranger":
    out["lookup"] = error(lambda: client.lookup(keys))
    out["health"] = client.health()
    print(json.dumps(out))
    sys.exit(0)
out["put"] = [r.value for r in client.put(blocks, durable=True)]
out["in_place"], out["staged"], out["fallbacks"] = \
    client.num_in_place_puts, client.num_staged_puts, client.num_put_fallbacks
if role == "member":  # a caller that does not write the slab stages its puts in a file for the daemon
    with local_client(a["socket"], a["public"], timeout_s=30, put_in_place=False) as stager:
        out["staged_put"] = [r.value for r in stager.put(chain(tokens(a["seed"] + 100, 2)), durable=True)]
        out["staged_counts"] = (stager.num_in_place_puts, stager.num_staged_puts, stager.num_put_fallbacks)
got = client.fetch(keys)
assert_intact(got)
out["fetched"], out["num_local"] = len(got), client.num_local
out["lookup"] = client.lookup(keys)
out["tenant"] = client.stats().tenant
if a["other_keys"]:
    other = [bytes.fromhex(k) for k in a["other_keys"]]
    other_store = [bytes.fromhex(k) for k in a["other_store_keys"]]
    out["other_lookup"], out["other_fetch"] = client.lookup(other), len(client.fetch(other))
    out["other_fetch_store_keys"] = len(client.fetch_store_keys(other_store))
    out["other_evict"] = client.evict(store_keys=other_store)
out["listed"] = sorted(e.store_key.hex() for e in client.list())
stats = client.stats()
out["stats_tenants"] = [t.tenant for t in stats.tenants]
out["stats_aggregate_blocks"] = sum(t.num_blocks for t in stats.tiers)
if role == "member":
    out["flushed_host"] = client.flush(tier="host")
    again = client.fetch(keys)  # from the daemon's disk tier, read in place
    assert_intact(again)
    out["refetched"], out["disk_blocks"] = len(again), client.num_disk_blocks
else:
    out["flush_other"] = error(lambda: client.flush(tenant="local"))
    with grpc.insecure_channel(f"unix:{a['public']}", options=CHANNEL_OPTIONS) as channel:
        stub = pb_grpc.TierCacheStub(channel)
        out["fetch_shared"] = error(lambda: stub.FetchShared(pb.FetchRequest(shared_memory=True), timeout=10))
        area = StagingArea(a["shm_dir"])
        try:
            block = chain(tokens(a["seed"] + 1, 1))[0]
            offset = area.write([block.payload])[0]
            request = pb.PutRequest(record=plain_record_parts(block)[0], last=True,
                                    staged=pb.StagedPayload(file=area.name, offset=offset))
            out["staged_put"] = error(lambda: stub.PutBatch(pb.PutBatchRequest(requests=[request]), timeout=10))
        finally:
            area.close()
    plain = Client(f"unix:{a['public']}", timeout_s=30, token=a.get("token"))  # not local_client: works too
    out["plain_fetch"] = len(plain.fetch(keys))
    plain.close()
client.close()
print(json.dumps(out))
'''


def _free_ids(count: int, start: int = 42000) -> list[int]:
    """Numeric ids that name no user and no group on this host."""
    found: list[int] = []
    n = start
    while len(found) < count:
        try:
            pwd.getpwuid(n)
        except KeyError:
            try:
                grp.getgrgid(n)
            except KeyError:
                found.append(n)
        n += 1
    return found


class Uids:
    """The daemon's uid (its own group plus the local group), a member, a mapped outsider, a stranger."""

    def __init__(self) -> None:
        self.daemon, self.group, self.member, self.outsider, self.stranger = _free_ids(5)

    def groups_of(self, uid: int) -> list[int]:
        return [self.group] if uid in (self.daemon, self.member) else []


def _drain(stream: IO[str], sink: Callable[[str], None]) -> None:
    for line in stream:
        sink(line)


class UidDaemon:
    """`tiercache serve` as another uid, its output drained; waits for its "listening on" line."""

    def __init__(self, config_path: str, uids: Uids, home: str) -> None:
        assert PYTHON is not None
        env = {**os.environ, "PYTHONPATH": PYTHON[1], "HOME": home}
        self.proc = subprocess.Popen([PYTHON[0], "-m", "tiercache.cli", "serve", "--log-level", "INFO",
                                      "--config", config_path], cwd=REPO, env=env, user=uids.daemon,
                                     group=uids.daemon, extra_groups=uids.groups_of(uids.daemon),
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.stderr_lines: list[str] = []
        lines: queue.Queue[str] = queue.Queue()
        assert self.proc.stdout is not None and self.proc.stderr is not None
        threading.Thread(target=_drain, args=(self.proc.stderr, self.stderr_lines.append), daemon=True).start()
        threading.Thread(target=_drain, args=(self.proc.stdout, lines.put), daemon=True).start()
        try:
            line = lines.get(timeout=90)
        except queue.Empty:
            line = ""
        if not line.startswith("tiercache listening on"):
            self.proc.kill()
            raise AssertionError(f"daemon did not start: {line!r}\n{''.join(self.stderr_lines)[-4000:]}")

    @property
    def stderr(self) -> str:
        return "".join(self.stderr_lines)


DaemonAndPaths = tuple[UidDaemon, Uids, dict[str, str], str]


def run_as(uid: int, uids: Uids, script: str, role: str, args: dict[str, object], home: str) -> dict:
    assert PYTHON is not None
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "TC_REPO": str(REPO), "HOME": home, "PYTHONPATH": PYTHON[1]}
    done = subprocess.run([PYTHON[0], script, role, json.dumps(args)], cwd=REPO, env=env, user=uid, group=uid,
                          extra_groups=uids.groups_of(uid), capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, f"{role} (uid {uid}) failed:\n{done.stderr[-4000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def uid_daemon() -> Iterator[DaemonAndPaths]:
    """A daemon running as its own uid, with a local group, a public socket and a layout like the
    systemd unit's: /run/tiercache 0751 (group: the local group), the data dir its own, slabs in a
    root-owned sticky directory like /dev/shm."""
    uids = Uids()
    base = tempfile.mkdtemp(prefix="tc-", dir="/tmp")
    shm = tempfile.mkdtemp(prefix="tc-access-", dir="/dev/shm")
    os.chmod(base, 0o711)
    os.chmod(shm, 0o1777)
    run, var = os.path.join(base, "run"), os.path.join(base, "var")
    for path, owner, group, dir_mode in ((run, uids.daemon, uids.group, 0o751), (var, uids.daemon, uids.daemon, 0o755)):
        os.mkdir(path)
        os.chown(path, owner, group)
        os.chmod(path, dir_mode)
    homes = {}
    for uid in (uids.daemon, uids.member, uids.outsider, uids.stranger):
        homes[uid] = os.path.join(base, f"home-{uid}")
        os.mkdir(homes[uid], 0o700)
        os.chown(homes[uid], uid, uid)
    paths = {"socket": os.path.join(run, "tiercache.sock"), "public": os.path.join(run, "public.sock"),
             "data_dir": os.path.join(var, "data"), "shm_dir": shm}
    config_path = os.path.join(base, "tiercache.toml")
    with open(config_path, "w") as f:
        f.write(f'data_dir = "{paths["data_dir"]}"\n'
                f'[host]\ncapacity_bytes = {64 * 4096}\npage_bytes = 4096\nshm_dir = "{shm}"\n'
                f"[disk]\ncapacity_bytes = {16 << 20}\n"
                f'[server]\nsocket = "{paths["socket"]}"\npublic_socket = "{paths["public"]}"\n'
                f'local_group = "{uids.group}"\nidle_check_s = 0.5\nintegrity_check_s = 0.5\n'
                f"[server.public_tenants]\n\"{uids.outsider}\" = \"outsider\"\n"
                f'[server.tokens]\n"tok-api" = "api"\n')
    os.chmod(config_path, 0o644)
    script = os.path.join(base, "child.py")
    with open(script, "w") as f:
        f.write(CHILD)
    os.chmod(script, 0o644)
    daemon = UidDaemon(config_path, uids, homes[uids.daemon])
    try:
        slabs = [n for n in os.listdir(shm) if n.endswith(".slab")]
        assert len(slabs) == 1, slabs
        slab = os.path.join(shm, slabs[0])
        disk = os.path.join(paths["data_dir"], "disk")
        paths.update(slab=slab, index=slab.removesuffix(".slab") + ".index", data=os.path.join(disk, "data.mdb"),
                     lock=os.path.join(disk, "lock.mdb"), script=script, **{f"home{u}": h for u, h in homes.items()})
        yield daemon, uids, paths, base
    finally:
        if daemon.proc.poll() is None:
            daemon.proc.send_signal(signal.SIGTERM)
            try:
                daemon.proc.wait(30)
            except subprocess.TimeoutExpired:
                daemon.proc.kill()
        subprocess.run(["rm", "-rf", base, shm], check=False)


def _child(uid_daemon: DaemonAndPaths, who: str, role: str, seed: int, **extra: object) -> dict:
    daemon, uids, paths, _ = uid_daemon
    uid = getattr(uids, who)
    args = {k: paths[k] for k in ("socket", "public", "slab", "index", "data", "lock", "shm_dir")}
    return run_as(uid, uids, paths["script"], role, {**args, "seed": seed, "other_keys": [], "other_store_keys": [],
                                                      **extra}, paths[f"home{uid}"])


@needs_root
def test_the_daemon_runs_as_its_own_uid_and_shares_with_its_group_alone(uid_daemon):
    daemon, uids, paths, _ = uid_daemon
    for name, expected in (("slab", 0o660), ("index", 0o640), ("socket", 0o660), ("data", 0o640), ("lock", 0o660)):
        st = os.stat(paths[name])
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (uids.daemon, uids.group, expected), name
    st = os.stat(paths["public"])
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (uids.daemon, 0o666)


@needs_root
def test_a_group_member_gets_the_fast_paths(uid_daemon):
    daemon, uids, paths, _ = uid_daemon
    out = _child(uid_daemon, "member", "member", 10)
    assert out["groups"] == [uids.group] and out["uid"] == uids.member
    assert (out["open_slab"], out["open_index"], out["open_data"], out["open_lock"], out["connect_socket"]) == \
        ("ok",) * 5
    assert out["target"] == f"unix:{paths['socket']}" and out["tenant"] == "local"
    assert out["put"] == ["stored"] * 4
    # Puts in place: written into the group's slab by the member, committed by the daemon.
    assert (out["in_place"], out["staged"], out["fallbacks"]) == (4, 0, 0)
    # Staged Puts: the member's staging file, given to the group, read by the daemon's uid.
    assert out["staged_put"] == ["stored"] * 2 and out["staged_counts"] == [0, 2, 0]
    # Lookup and fetch answered from the shared index and the slab, then from the disk tier in place.
    assert out["fetched"] == 4 and out["num_local"] >= 1 and out["lookup"] == ["host"] * 4
    assert out["flushed_host"] == 4 + 2 and out["refetched"] == 4 and out["disk_blocks"] == 4
    assert out["stats_aggregate_blocks"] > 0  # a member is tenant "local": the operator
    assert daemon.proc.poll() is None


@needs_root
def test_a_non_member_is_a_tenant_of_its_own_and_can_map_nothing(uid_daemon):
    daemon, uids, paths, _ = uid_daemon
    member_keys = [b.meta.key for b in chain(tokens(20, 4))]
    member = _child(uid_daemon, "member", "member", 20)
    assert member["put"] == ["stored"] * 4
    out = _child(uid_daemon, "outsider", "outsider", 30, other_keys=[k.hex() for k in member_keys],
                 other_store_keys=[k.hex() for k in scope_keys("local", member_keys)])
    assert out["groups"] == []
    # Neither the daemon's socket nor a byte of its shared memory or disk tier.
    assert (out["open_slab"], out["open_index"], out["open_data"], out["open_lock"], out["connect_socket"]) == \
        ("PermissionError",) * 5
    # The public socket: a tenant of its own, by its uid, over the byte path.
    assert out["target"] == f"unix:{paths['public']}" and out["tenant"] == "outsider"
    assert out["put"] == ["stored"] * 4 and (out["in_place"], out["staged"], out["fallbacks"]) == (0, 0, 0)
    assert out["fetched"] == 4 and out["num_local"] == 0 and out["lookup"] == ["host"] * 4
    assert out["plain_fetch"] == 4
    # Nothing of another tenant, on any rpc.
    assert out["other_lookup"] == [] and out["other_fetch"] == out["other_fetch_store_keys"] == 0
    assert out["other_evict"] == 0
    outsider_keys = [b.meta.key for b in chain(tokens(30, 4))]
    assert out["listed"] == sorted(k.hex() for k in scope_keys("outsider", outsider_keys))
    assert out["stats_tenants"] == [] and out["stats_aggregate_blocks"] == 0
    assert out["flush_other"].startswith("PermissionDenied")
    assert out["fetch_shared"].startswith("INVALID_ARGUMENT")
    assert out["staged_put"].startswith("INVALID_ARGUMENT") and ".staged" in out["staged_put"]
    # The member's blocks are all still there for it, and the outsider's are not its.
    with Client(f"unix:{paths['socket']}") as operator:
        assert operator.lookup(member_keys) == ["host"] * 4 and operator.lookup(outsider_keys) == []
        assert {t.tenant: t.num_blocks for t in operator.stats().tenants}["outsider"] == 4
    assert daemon.proc.poll() is None


@needs_root
def test_a_local_user_without_a_tenant_is_refused_and_the_daemon_stays_up(uid_daemon):
    daemon, uids, paths, _ = uid_daemon
    out = _child(uid_daemon, "stranger", "stranger", 40)
    assert out["target"] == f"unix:{paths['public']}" and out["connect_socket"] == "PermissionError"
    assert out["lookup"].startswith("Unauthenticated") and f"uid {uids.stranger} has no tenant" in out["lookup"]
    assert out["health"] == "SERVING"
    # With a token of server.tokens, the same user is that token's tenant (still without shared memory).
    with_token = _child(uid_daemon, "stranger", "outsider", 41, token="tok-api")
    assert with_token["tenant"] == "api" and with_token["num_local"] == 0 and with_token["fetched"] == 4
    assert daemon.proc.poll() is None
    with Client(f"unix:{paths['socket']}") as operator:
        assert operator.health() == "SERVING"
    assert "Traceback" not in daemon.stderr, daemon.stderr[-4000:]
