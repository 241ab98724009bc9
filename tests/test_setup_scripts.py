"""What the setup scripts install: the main job (scripts/run.sh) only tiercache with its api extra and the client
its benchmark sends with; the test suite (scripts/test.sh, CI) everything, Chromium and vLLM included. Their
plans are printed by the scripts themselves (TIERCACHE_SETUP_PLAN=1), so nothing is installed here."""

from __future__ import annotations

import os
import pathlib
import subprocess

REPO = pathlib.Path(__file__).resolve().parent.parent


def plan(*args: str) -> list[str]:
    done = subprocess.run(["bash", "scripts/setup.sh", *args], cwd=REPO, capture_output=True, text=True, check=False,
                          timeout=60,
                          env={**os.environ, "TIERCACHE_SETUP_PLAN": "1"})
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_the_main_job_sets_up_the_core_and_the_api_extra_only() -> None:
    main = plan("main")
    assert main[-1].endswith('-m pip install --quiet -e .[api,bench]'), main
    assert not any(word in line for line in main for word in ("setup_vllm", "setup_redis", "setup_chromium", "dev"))
    assert "bash scripts/setup.sh main" in (REPO / "scripts" / "run.sh").read_text()


def test_the_test_suite_sets_up_every_test_need() -> None:
    everything = plan()
    assert any(line.endswith("-e .[api,remote,dev]") for line in everything), everything
    assert everything[-3:] == ["bash scripts/setup_redis.sh", "bash scripts/setup_chromium.sh",
                               "bash scripts/setup_vllm.sh"]
    test_sh = (REPO / "scripts" / "test.sh").read_text()
    assert "bash scripts/setup.sh\n" in test_sh  # no argument: everything, as CI needs on a fresh clone
    bad = subprocess.run(["bash", "scripts/setup.sh", "mian"], cwd=REPO, capture_output=True, text=True, check=False,
                         timeout=60)
    assert bad.returncode == 2 and "usage: bash scripts/setup.sh [main]" in bad.stderr
