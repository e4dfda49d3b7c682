#!/usr/bin/env bash
# Set up .venv, then run the quickstart on a local mesh of this machine.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python examples/quickstart.py
