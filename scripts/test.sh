#!/usr/bin/env bash
# Set up (scripts/setup.sh), check the code (ruff, then mypy on tiercache/ and server/, as pyproject.toml
# configures them), then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check
.venv/bin/python -m mypy
exec .venv/bin/python -m pytest -q "$@"
