#!/usr/bin/env bash
# Set up .venv, then lint and run the whole test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
# (--durations: the slowest tests in every CI log, to keep the suite under 20 minutes)
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=25 "$@"
