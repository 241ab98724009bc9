#!/usr/bin/env bash
# Set up .venv with what the main job needs (scripts/setup.sh main: tiercache and its api extra, not the
# test suite's tools), then run the main job.
#   bash scripts/run.sh [api] [--requests N --workers N --markdown FILE]   six household users through the HTTP API
#                                                                         (scripts/bench_api.py)
#   bash scripts/run.sh demo [--requests N --workers N --json FILE]        the same users through JSON-lines workers
#   bash scripts/run.sh bench [--lengths 512,2000,4000 --repeat N]          scripts/bench_ttft.py
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh main
script=scripts/bench_api.py
case "${1:-}" in
  api) shift ;;
  demo) script=scripts/demo.py; shift ;;
  bench) script=scripts/bench_ttft.py; shift ;;
esac
exec .venv/bin/python "$script" "$@"
