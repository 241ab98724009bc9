#!/usr/bin/env bash
# Every check that needs a GPU, in one command of at most 8 minutes: the CUDA-only tests (pytest -m cuda)
# and the GPU rows of the benchmarks. Without a GPU it prints "no GPU" and exits 0, so it is safe to run
# anywhere; with one it exits non-zero if any step fails or runs past its time.
#
#     bash scripts/gpu_check.sh            (PYTHON=... to use another interpreter than .venv/bin/python)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3

# A broken torch is a failure, not "no GPU": ask for a yes or a no and check that one came back.
if ! has_cuda=$("$PY" -c 'import torch; print("yes" if torch.cuda.is_available() else "no")'); then
    echo "gpu_check: cannot import torch with $PY" >&2
    exit 2
fi
if [ "$has_cuda" != "yes" ]; then
    echo "no GPU"
    exit 0
fi

failed=()
step() {  # step NAME SECONDS COMMAND...: run it under a time limit, note a failure, go on
    local name=$1 limit=$2
    shift 2
    echo "== $name (at most ${limit} s)"
    local start=$SECONDS
    timeout --kill-after=10 "$limit" "$@"
    local rc=$?
    echo "== $name: exit $rc after $((SECONDS - start)) s"
    [ "$rc" -eq 0 ] || failed+=("$name (exit $rc)")
}

"$PY" -c 'import torch; print("gpu_check on", torch.cuda.get_device_name(0), "torch", torch.__version__)'
# Only the files that mark a test cuda are collected: the rest of the suite has nothing to run here.
mapfile -t cuda_files < <(grep -l 'mark\.cuda' tests/test_*.py)
step "pytest -m cuda (${#cuda_files[@]} files)" 300 "$PY" -m pytest -q -m cuda -p no:cacheprovider "${cuda_files[@]}"
step "bench_device_checksum on cuda" 60 "$PY" scripts/bench_device_checksum.py --device cuda --repeat 25
# bench_store puts its gpu row on the device when CUDA is present (vs plain H2D/D2H copies).
step "bench_store (gpu row on cuda)" 100 "$PY" scripts/bench_store.py --blocks 32 --repeat 3

if [ ${#failed[@]} -gt 0 ]; then
    printf 'gpu_check: FAILED: %s\n' "${failed[@]}"
    exit 1
fi
echo "gpu_check: all passed"
