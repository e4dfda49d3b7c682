#!/usr/bin/env bash
# Build the JupyterLab extension (extension/) with npm and make .venv's JupyterLab load it,
# with its server part. Needs only the npm registry. Never fails set-up: without npm (or
# when the registry cannot be reached) it says so, and the browser tests of the Mesh panel
# skip with that reason.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
[ -x "$PY" ] || PY=python3
PREFIX=${PREFIX:-$("$PY" -c 'import sys; print(sys.prefix)')}
if ! command -v npm >/dev/null 2>&1; then
  echo "setup: npm not found; the JupyterLab Mesh panel is not built (its browser tests will skip)" >&2
  exit 0
fi
if ! (cd extension && npm install --no-audit --no-fund --loglevel=error >/dev/null && npm run -s build:prod >/dev/null 2>&1); then
  echo "setup: building the JupyterLab extension failed (is the npm registry reachable?); the Mesh panel's" \
       "browser tests will skip" >&2
  exit 0
fi
mkdir -p "$PREFIX/share/jupyter/labextensions" "$PREFIX/etc/jupyter/jupyter_server_config.d"
rm -rf "$PREFIX/share/jupyter/labextensions/monarch-kernel"
ln -s "$PWD/extension/build/monarch-kernel" "$PREFIX/share/jupyter/labextensions/monarch-kernel"
cp extension/jupyter-config/monarch_kernel.json "$PREFIX/etc/jupyter/jupyter_server_config.d/monarch_kernel.json"
echo "setup: JupyterLab extension built and enabled in $PREFIX"
