"""`tiercache admin` against a real daemon populated by a real worker: every subcommand, human and --json."""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from benchmarks.daemons import REPO, chain, cleanup, running_server, short_dir, small_config, tokens
from tiercache import admin
from tiercache.cli import build_parser
from tiercache.client import Client
from tiercache.errors import PermissionDenied
from tiercache.tenancy import scope_key
from tiercache.worker import Request, Worker
from tiercache.worker.model import load_default_model

SYSTEM = "[2024-05-01 10:00:00] You are a helpful home assistant. Answer briefly and politely. "
PROMPTS = [SYSTEM + "Turn on the lights.", SYSTEM + "What is the weather?"]  # 105 and 106 tokens


class Terminal(io.StringIO):
    """A stream that says it is a terminal (confirmation prompts, progress bars)."""

    def isatty(self) -> bool:
        return True


def run_admin(address: str, *argv: str, answer: str | None = None, tty_err: bool = False) -> tuple[int, str, str]:
    """`tiercache admin ARGV --socket/--target ADDRESS` in process: (exit code, stdout, stderr)."""
    where = ["--socket", address[len("unix:"):]] if address.startswith("unix:") else ["--target", address]
    out, err = io.StringIO(), Terminal() if tty_err else io.StringIO()
    inp = Terminal(answer) if answer is not None else io.StringIO()
    code = admin.main([*argv, *where], out, err, inp)
    return code, out.getvalue(), err.getvalue()


def run_json(address: str, *argv: str) -> tuple[int, dict]:
    code, out, err = run_admin(address, *argv, "--json")
    return code, json.loads(out)


def populate(address: str, loaded, prompts: list[str] = PROMPTS) -> list:
    """Run each prompt through a real worker (which puts its blocks, preview and namespace)."""
    worker = Worker(loaded, lambda: Client(address))
    results = []
    try:
        for prompt in prompts:
            results.append(worker.run(Request(tuple(loaded.tokenizer.encode(prompt)), max_new_tokens=1,
                                              preview=prompt[:64])))
            worker.drain()  # the next prompt sees this one's blocks
    finally:
        worker.close()
    return results


@pytest.fixture(scope="module")
def loaded():
    return load_default_model()


@pytest.fixture(scope="module")
def daemon(loaded):
    """A daemon holding the blocks of PROMPTS, put by a worker on the embedded model. Read-only tests."""
    base = short_dir()
    try:
        with running_server(small_config(base, host_pages=256, disk_bytes=64 << 20)) as (store, address):
            populate(address, loaded)
            yield address
    finally:
        cleanup(base)



def test_stats_human_and_json(daemon):
    code, out, _ = run_admin(daemon, "stats")
    assert code == 0
    assert "tenant local" in out and "tiercache/default-llama-v1-seed0" in out
    assert "lookups: 12 keys, 5 hits (41.7%), 7 misses" in out  # 6 + 6 usable keys; the second shares 5
    code, s = run_json(daemon, "stats")
    assert code == 0 and s["tenant"] == "local"
    assert s["lookups"] == sum(t["lookup_hits"] for t in s["tiers"]) + s["lookup_misses"] == 12
    assert s["tokens_reused"] == 80 and s["tokens_computed"] == 105 + 106 - 80 and s["requests_reported"] == 2
    (ns,) = s["namespaces"]
    assert ns["model"] == "tiercache/default-llama-v1-seed0" and ns["num_blocks"] == 7 and ns["block_tokens"] == 16
    assert {t["tier"]: t["num_blocks"] for t in s["tiers"]} == {"host": 7, "disk": 7}
    assert s["tenants"] == [{"tenant": "local", "num_blocks": 7, "bytes": ns["bytes"]}]


def test_ls_shows_model_chains_and_preview(daemon):
    code, out, _ = run_admin(daemon, "ls")
    assert code == 0
    assert "model tiercache/default-llama-v1-seed0  float32  16 tokens/block" in out
    assert '"[2024-05-01 10:00:00] You are a helpful…"' in out
    code, listing = run_json(daemon, "ls", "--blocks")
    (ns,) = listing["namespaces"]
    (c,) = ns["chains"]
    assert (c["blocks"], c["tokens"], c["branches"], c["pinned"], c["reachable"]) == (7, 96, 2, "no", True)
    assert c["preview"] == PROMPTS[0][:64] and c["tiers"] == ["host", "disk"] and c["hits"] == 1
    assert len(ns["blocks"]) == 7 and ns["blocks"][0]["store_key"].startswith(c["id"])
    code, out, _ = run_admin(daemon, "ls", "--blocks", "--namespace", ns["digest"][:8])
    assert code == 0 and out.count("\n  ") == 8  # the block table: header + 7 rows
    code, out, err = run_admin(daemon, "ls", "--namespace", "no-such-model")
    assert code == 1 and "no cached namespace" in err


def test_explain_names_the_divergent_token_of_a_changed_timestamp(daemon):
    prompt = PROMPTS[0].replace("2024-05-01", "2024-05-02")
    code, out, _ = run_admin(daemon, "explain", "--prompt", prompt)
    assert code == 1  # nothing of it is cached
    assert "first divergent token: 11 (confirmed" in out  # bos, then "[2024-05-0" is tokens 1-10
    code, r = run_json(daemon, "inspect", "--prompt", prompt)
    miss = r["miss"]
    assert (miss["reason"], miss["block"], miss["divergent_token"], miss["verified"]) == ("differs", 0, 11, True)
    assert "2024-05-01" in miss["cached_text"] and "2024-05-02" in miss["your_text"]
    assert r["cached_blocks"] == 0 and [b["tier"] for b in r["blocks"]] == [None] * 6


def test_explain_hit_tail_and_a_divergence_past_the_preview(daemon, loaded):
    lookups = run_json(daemon, "stats")[1]["lookups"]
    code, r = run_json(daemon, "explain", "--prompt", PROMPTS[0])
    assert code == 0 and r["cached_blocks"] == 6 and r["cached_tokens"] == 96
    assert [b["tier"] for b in r["blocks"]] == ["host"] * 6 and r["miss"]["reason"] == "partial_tail"
    # The key each block is kept under (a remote tier's is <key_prefix>:<tenant>:<store_key>, docs/scale-out.md).
    assert [b["store_key"] for b in r["blocks"]] == [scope_key("local", bytes.fromhex(b["key"])).hex()
                                                     for b in r["blocks"]]
    # Differs at token 93 (block 5), beyond the 64-character preview: the range is all that is known.
    code, r = run_json(daemon, "explain", "--tokens", json.dumps(loaded.tokenizer.encode(SYSTEM + "Turn off it.")))
    miss = r["miss"]
    assert code == 0 and r["cached_blocks"] == 5
    assert (miss["block"], miss["divergent_token"], miss["lower_bound"]) == (5, None, 80)
    code, out, _ = run_admin(daemon, "explain", "--prompt", SYSTEM + "Turn off it.")
    assert "diverges within tokens 80-95" in out
    # Longer than anything cached: the cache ends, nothing differs.
    code, r = run_json(daemon, "explain", "--prompt", PROMPTS[0] + " And the heater in the kitchen, please.")
    assert r["miss"]["reason"] == "cache_ends" and r["miss"]["block"] == 6
    assert run_json(daemon, "stats")[1]["lookups"] == lookups  # inspecting is not a lookup: hit rate unmoved


@pytest.mark.parametrize("flags, field, shown", [
    (["--salt", "alice-secret"], "salt_digest", "salt differs"),
    (["--block-tokens", "32"], "block_tokens", "block_tokens differs (cache 16, yours 32)"),
    (["--adapter", "lora-kitchen"], "adapter", "adapter differs (cache '', yours 'lora-kitchen')"),
])
def test_explain_names_the_namespace_field_that_differs(daemon, flags, field, shown):
    code, out, _ = run_admin(daemon, "explain", "--prompt", PROMPTS[0], *flags)
    assert code == 1 and shown in out
    assert "alice-secret" not in out
    code, r = run_json(daemon, "explain", "--prompt", PROMPTS[0], *flags)
    assert r["miss"]["reason"] == "namespace" and r["miss"]["fields"] == [field]
    assert r["miss"]["model"] == "tiercache/default-llama-v1-seed0"


def test_bad_input_and_unreachable_daemon_exit_codes(daemon, base, capsys):
    assert run_admin(daemon, "explain")[0] == 2  # no prompt
    assert run_admin(daemon, "explain", "--tokens", "1,x")[0] == 2
    code, _, err = run_admin(daemon, "explain", "--tokens", "[" * 30000 + "]" * 30000)  # was a RecursionError
    assert code == 2 and "expected integers" in err
    latin1 = f"{base}/latin1.txt"
    with open(latin1, "wb") as f:
        f.write("Caf\u00e9".encode("latin-1"))
    code, _, err = run_admin(daemon, "explain", "--prompt-file", latin1)
    assert code == 2 and f"--prompt-file {latin1}: not UTF-8 text (byte 0xe9 at offset 3)" in err, err
    assert run_admin(daemon, "pin", "--chain", "zz")[0] == 2
    assert run_admin(daemon, "pin", "--chain", "abcdef")[0] == 1
    code, out, err = run_admin(f"unix:{base}/none.sock", "stats", "--json")
    assert code == 3 and "cannot reach the daemon" in err and json.loads(out)["exit_code"] == 3
    with pytest.raises(SystemExit):
        build_parser().parse_args(["admin", "--help"])
    assert "exit codes:\n  0  success\n  1  not found" in capsys.readouterr().out
    # The real entry point gives the same code from a process.
    proc = subprocess.run([sys.executable, "-m", "tiercache.cli", "admin", "ls", "--socket", f"{base}/none.sock"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3, proc.stderr
    # Options that cannot mean anything are usage errors, not silently ignored or misreported.
    chain_id = run_json(daemon, "ls")[1]["namespaces"][0]["chains"][0]["id"]
    code, _, err = run_admin(daemon, "evict", "--chain", chain_id, "--key", chain_id, "--yes")
    assert code == 2 and "not with --chain and --key" in err
    code, _, err = run_admin(daemon, "pin", "--chain", chain_id, "--prompt", "hi")
    assert code == 2 and "not with --chain and a prompt" in err
    code, _, err = run_admin(daemon, "ls", "--namespace", "")
    assert code == 2 and "namespace ''" in err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["admin", "stats", "--timeout", "0"])
    assert "expected a positive number of seconds" in capsys.readouterr().err
    code, _, err = run_admin(daemon, "flush", "--tier", "gpu", "--yes")
    assert code == 1 and "tier 'gpu' is not enabled (enabled: host, disk)" in err
    code, _, err = run_admin(daemon, "flush", "--tenant", "local", "--namespace", "zz" * 32, "--yes")
    assert code == 2 and "give the full 64-hex-digit digest" in err
    assert all(c["pinned"] == "no" for n in run_json(daemon, "ls")[1]["namespaces"] for c in n["chains"])
    # A reader that goes away (`admin ls | head -1`; `true` reads nothing at all) ends the command quietly.
    command = f"set -o pipefail; {sys.executable} -m tiercache.cli admin ls --socket {daemon[len('unix:'):]} | true"
    proc = subprocess.run(["bash", "-c", command], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and proc.stderr == "", proc.stderr


def test_a_bad_config_file_or_a_taken_metrics_port_is_one_line_and_exit_2(base):
    proc = subprocess.run([sys.executable, "-m", "tiercache.cli", "serve", "--config", f"{base}/missing.toml"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.startswith("tiercache: config file") and "No such file" in proc.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "tiercache.cli", "serve", "--data-dir", f"{base}/data",
                               "--socket", f"{base}/d.sock", "--metrics-port", str(port)],
                              cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and f"cannot serve metrics on 127.0.0.1:{port}" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not os.path.exists(f"{base}/d.sock")


def test_pin_unpin_evict_flush_verify(base, loaded):
    config = small_config(base, host_pages=256, disk_bytes=64 << 20)
    with running_server(config) as (store, address):
        populate(address, loaded)
        other = chain(tokens(7, 3))  # a second, undescribed namespace put by a plain client
        with Client(address) as client:
            client.put(other)
        (code, listing) = run_json(address, "ls")
        worker_ns = next(n for n in listing["namespaces"] if n["described"])
        assert [n["model"] for n in listing["namespaces"] if not n["described"]] == ["(not described)"]
        chain_id = worker_ns["chains"][0]["id"]
        # pin / unpin: a prompt's cached prefix, then a whole chain with a TTL.
        code, out, err = run_admin(address, "pin", "--prompt", SYSTEM)
        assert code == 0 and out.startswith("pinned 5 blocks (the prompt's cached prefix) until unpinned"), err
        code, r = run_json(address, "pin", "--chain", chain_id, "--ttl", "600")
        assert code == 0 and r == {"pinned": 7, "ttl_s": 600.0}
        code, r = run_json(address, "ls", "--namespace", worker_ns["model"], "--blocks")
        assert r["namespaces"][0]["chains"][0]["pinned"] == "yes"
        assert all(590 < b["pin_expires_at"] - time.time() <= 600 for b in r["namespaces"][0]["blocks"])
        code, out, _ = run_admin(address, "ls", "--namespace", worker_ns["model"], "--blocks")
        assert out.count(" 10m left ") == 7, out  # the pin's TTL, not just "yes"
        code, r = run_json(address, "unpin", "--chain", chain_id)
        assert r["unpinned"] == 7
        code, out, _ = run_admin(address, "unpin", "--chain", chain_id)  # nothing pinned any more
        assert code == 1 and out.startswith("unpinned 0 blocks (chain ") and "7 of them were not pinned" in out
        # verify: progress on a terminal's stderr, a summary on stdout.
        code, out, err = run_admin(address, "verify", tty_err=True)
        assert code == 0 and "verified 10 blocks (20 copies): 0 damaged; store integrity ok" in out
        assert "verifying [" in err and "10/10" in err
        code, r = run_json(address, "verify")
        assert code == 0 and r["blocks"] == 10 and r["failed"] == 0 and r["integrity_ok"]
        # evict asks first; without a terminal it refuses and changes nothing.
        code, _, err = run_admin(address, "evict", "--key", worker_ns["chains"][0]["head_store_key"][:12])
        assert code == 2 and "pass --yes" in err and "7 blocks" in err
        code, _, _ = run_admin(address, "evict", "--key", chain_id, answer="n\n")
        assert code == 6 and run_json(address, "stats")[1]["tenant_bytes"] > 0
        code, out, _ = run_admin(address, "evict", "--chain", chain_id, answer="y\n")
        assert code == 0 and out == "evicted 7 blocks\n"
        # flush: a tier, then a namespace, then everything.
        code, r = run_json(address, "flush", "--tier", "host", "--yes")
        assert code == 0 and r["removed"] == 3
        undescribed = next(n for n in listing["namespaces"] if not n["described"])
        code, out, _ = run_admin(address, "flush", "--namespace", undescribed["digest"][:10], "--yes")
        assert code == 0 and out.startswith("flushed 3 blocks")
        code, _, err = run_admin(address, "flush", "--yes")
        assert code == 1 and "nothing to flush" in err
        store.check_integrity()


def test_network_tenant_sees_only_itself_and_cannot_act_as_operator(base, loaded):
    config = small_config(base, listen="127.0.0.1:0", tokens={"tok-alice": "alice"})
    with running_server(config) as (store, address), Client(address, token="tok-alice") as alice:
        alice.put(chain(tokens(8, 2)))
        code, out, _ = run_admin(address, "stats", "--token", "tok-alice")
        assert code == 0 and "aggregate counters are reported to tenant local only" in out
        assert "USED" not in out and "2 (" in out.splitlines()[2], out  # her blocks, no zeros for others'
        code, r = run_json(address, "ls", "--token", "tok-alice")
        assert r["namespaces"][0]["num_blocks"] == 2
        code, _, err = run_admin(address, "flush", "--tenant", "local", "--yes", "--token", "tok-alice")
        assert code == 1  # alice's stats list no tenants: nothing to flush as far as she can see
        assert run_admin(address, "ls", "--token", "wrong")[0] == 4
        with pytest.raises(PermissionDenied, match="only tenant 'local'"):
            alice.flush(tenant="bob")


def test_evict_json_removes_a_chain_and_reports_the_count(base):
    config = small_config(base, host_pages=64)
    with running_server(config) as (store, address):
        blocks = chain(tokens(11, 4))
        with Client(address) as client:
            client.put(blocks)
        code, listing = run_json(address, "ls")
        chain_id = listing["namespaces"][0]["chains"][0]["id"]
        code, r = run_json(address, "evict", "--chain", chain_id, "--yes")
        assert code == 0 and r == {"evicted": 4}
        with Client(address) as client:
            assert client.lookup([b.meta.key for b in blocks]) == []
        code, r = run_json(address, "evict", "--chain", chain_id, "--yes")
        assert code == 1
        store.check_integrity()
