#!/usr/bin/env bash
# Create .venv (once) and install tiercache into it.
#   bash scripts/setup.sh        everything the test suite needs (what scripts/test.sh and CI run): tiercache
#                                with its api, remote and dev extras; redis-server (scripts/setup_redis.sh),
#                                Chromium (scripts/setup_chromium.sh) and .venv-vllm (scripts/setup_vllm.sh)
#   bash scripts/setup.sh main   what the main job (scripts/run.sh) and a deployment need: tiercache with its
#                                api extra and the bench extra (the openai client its benchmark sends with)
# Never pulls a multi-GB CUDA build of torch onto a machine without a GPU: when the venv has no
# torch, the CPU build is installed first and the project's "torch>=2.4" requirement accepts it.
# TIERCACHE_SETUP_PLAN=1 prints the steps instead of running them.
set -euo pipefail
cd "$(dirname "$0")/.."
PROFILE=${1:-all}
case "$PROFILE" in
  all|main) ;;
  *) echo "usage: bash scripts/setup.sh [main]   (no argument: everything the tests need)" >&2; exit 2 ;;
esac
step() {
  if [ -n "${TIERCACHE_SETUP_PLAN:-}" ]; then echo "$*"; else "$@"; fi
}
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ] || [ -n "${TIERCACHE_SETUP_PLAN:-}" ]; then
  step "$PY" -m venv .venv
fi
VPY=.venv/bin/python
step "$VPY" -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true
if [ -n "${TIERCACHE_SETUP_PLAN:-}" ] || ! "$VPY" -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    step "$VPY" -m pip install --quiet torch
  else
    step "$VPY" -m pip install --quiet "torch==2.13.0"
  fi
fi
if [ "$PROFILE" = main ]; then
  step "$VPY" -m pip install --quiet -e ".[api,bench]"
  exit 0
fi
step "$VPY" -m pip install --quiet -e ".[api,remote,dev]"
step bash scripts/setup_redis.sh     # redis-server for the remote tier's tests (they start their own cluster)
step bash scripts/setup_chromium.sh  # Chromium for the status page's browser tests
step bash scripts/setup_vllm.sh
