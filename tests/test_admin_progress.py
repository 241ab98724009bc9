"""Progress of the admin's long commands (verify, export, import, flush): drawn on a terminal's stderr, never
when stderr is not a terminal nor with --json (whose stdout stays one JSON document)."""

from __future__ import annotations

import json
import os

import pytest
from test_admin import PROMPTS, SYSTEM, populate, run_admin

from benchmarks.daemons import running_server, short_dir, small_config
from tiercache.worker.model import load_default_model


@pytest.fixture(scope="module")
def address():
    base = short_dir()
    with running_server(small_config(base, host_pages=256, disk_bytes=64 << 20)) as (_, address):
        populate(address, load_default_model(), [*PROMPTS, SYSTEM + "Lock the door."])
        yield address


def test_verify_export_and_import_draw_a_bar_on_a_terminal_only(address, tmp_path) -> None:
    code, out, err = run_admin(address, "verify", tty_err=True)
    assert code == 0 and "verifying [" in err and "8/8 " in err and "block/s" in err, err
    code, out, err = run_admin(address, "verify")  # stderr not a terminal
    assert code == 0 and err == ""
    path = str(tmp_path / "ns.safetensors")
    code, out, err = run_admin(address, "export", "--output", path, tty_err=True)
    assert code == 0 and "exporting [" in err and "8/8" in err, err
    code, out, err = run_admin(address, "import", path, "--json", tty_err=True)
    assert code == 0 and err == "" and json.loads(out)["already_present"] == 8  # --json: no bar on a terminal
    code, out, err = run_admin(address, "import", path, tty_err=True)
    assert code == 0 and "importing [" in err and "8/8" in err, err
    os.remove(path)


def test_flush_shows_its_time_while_the_daemon_flushes(address) -> None:
    code, out, err = run_admin(address, "flush", "--tier", "host", "--yes", tty_err=True)
    assert code == 0 and err.startswith("\rflushing 8 blocks") and err.endswith("s, done\n"), repr(err)
    code, out, err = run_admin(address, "flush", "--tier", "disk", "--yes", "--json", tty_err=True)
    assert code == 0 and err == "" and json.loads(out)["removed"] == 8
