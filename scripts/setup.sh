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
# The browser test (tests/test_debug_browser.py) drives JupyterLab in the system Chromium;
# install it only when missing, and never fail set-up over it (that test then skips).
if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null 2>&1; then
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } >/dev/null 2>&1 \
    || echo "setup: could not install chromium; the browser test will skip" >&2
fi
# Jobs on a real cluster (tests/test_jobs_slurm.py, tests/test_jobs_ssh.py) start a Slurm
# cluster and sshd in network namespaces; install the daemons only when missing, and never
# fail set-up over them (those tests then skip with the reason).
if command -v apt-get >/dev/null 2>&1; then
  want=""
  command -v slurmctld >/dev/null 2>&1 || want="$want slurm-wlm"
  command -v munged >/dev/null 2>&1 || want="$want munge"
  command -v sshd >/dev/null 2>&1 || [ -x /usr/sbin/sshd ] || want="$want openssh-server"
  if [ -n "$want" ]; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $want; } >/dev/null 2>&1 \
      || echo "setup: could not install$want; the Slurm/SSH job tests will skip" >&2
  fi
fi
# The JupyterLab extension (Mesh panel, status bar, "on mesh" cell button): npm only, never fatal.
bash scripts/build_extension.sh || true
