#!/usr/bin/env bash
# Set up .venv (scripts/setup.sh), then run the main job.
#   bash scripts/run.sh [demo] [--requests N --workers N --data-dir DIR --json FILE]   the household demo
#   bash scripts/run.sh bench [--lengths 512,2000,4000 --repeat N --json FILE]       scripts/bench_ttft.py
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
script=scripts/demo.py
case "${1:-}" in
  demo) shift ;;
  bench) script=scripts/bench_ttft.py; shift ;;
esac
exec .venv/bin/python "$script" "$@"
