#!/usr/bin/env bash
# Create .venv at the repo root and install monarch-kernel with what the tests need.
# torch is pinned to 2.13.0, the CPU build this kind of machine serves locally
# (any other torch pulls several GB of CUDA packages).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0" numpy
.venv/bin/python -m pip install -q -e ".[test]"
.venv/bin/python -m monarch_kernel.install --sys-prefix >/dev/null 2>&1 || true
