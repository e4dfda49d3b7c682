"""The example notebooks run in the monarch kernel under nbval, outputs compared with
what is stored in them (notebooks/sanitize.cfg masks only pids, times, hosts, addresses).
One test per notebook, so a failure names its notebook."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from kernel_harness import ensure_kernelspec

ROOT = Path(__file__).resolve().parents[1]
# slurm.ipynb needs the Slurm test cluster: tests/test_jobs_notebook.py runs it against one.
NOTEBOOKS = sorted(p for p in (ROOT / "notebooks").glob("*.ipynb") if p.stem != "slurm")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_and_its_outputs_match(notebook, tmp_path):
    ensure_kernelspec()
    env = {**os.environ, "MONARCH_KERNEL_PREWARM": "0"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval", str(notebook),
           "--nbval-kernel-name", "monarch", "--nbval-sanitize-with", str(ROOT / "notebooks" / "sanitize.cfg"),
           "--nbval-cell-timeout", "120", "--rootdir", str(tmp_path), "-o", "addopts="]
    proc = subprocess.run(cmd, cwd=ROOT / "notebooks", env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, f"nbval failed on {notebook.name}:\n{proc.stdout[-6000:]}\n{proc.stderr[-2000:]}"
