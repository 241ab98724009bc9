#!/usr/bin/env bash
# Create .venv (once) and install tiercache with its test tools into it; redis-server for the remote
# tier's tests (scripts/setup_redis.sh); then .venv-vllm for the vLLM connector's tests (scripts/setup_vllm.sh).
# Never pulls a multi-GB CUDA build of torch onto a machine without a GPU: when the venv has no
# torch, the CPU build is installed first and the project's "torch>=2.4" requirement accepts it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
"$VPY" -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true
if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    "$VPY" -m pip install --quiet torch
  else
    "$VPY" -m pip install --quiet "torch==2.13.0"
  fi
fi
"$VPY" -m pip install --quiet -e ".[api,remote,dev]"
bash scripts/setup_redis.sh    # redis-server for the remote tier's tests (they start their own cluster)
bash scripts/setup_vllm.sh
