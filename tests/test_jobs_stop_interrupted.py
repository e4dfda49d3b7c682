"""``%mesh stop`` of a Slurm job with the interrupt button pressed twice while it releases,
through a REAL kernel (jupyter_client) on the real two-node Slurm cluster
(tests/slurm_cluster.py). The release must finish: nothing queued, no agent, no proc,
no cache; the kernel goes on. (The Kubernetes fake's version is in
tests/test_jobs_kubernetes_fake_kernel.py.)

A kernel's interrupt goes to its whole process group: the scancel that ``kill()`` runs
gets it too unless it runs in a session of its own. ``scancel`` here answers 3 s late (a
busy slurmctld), through a wrapper first on the kernel's PATH, so that both presses land
while the release waits for it."""
from __future__ import annotations

import os
import re
import shutil
import time

import pytest
from kernel_harness import KernelHarness, home_processes
from slurm_cluster import cluster_fixture


@pytest.fixture(scope="module")
def cluster():
    yield from cluster_fixture()


def _slow_scancel(tmp_path) -> tuple[str, str]:
    """A bin folder whose scancel touches a mark, waits 3 s, then runs the real one."""
    real = shutil.which("scancel")
    bindir, mark = tmp_path / "bin", tmp_path / "scancel-called"
    bindir.mkdir()
    wrapper = bindir / "scancel"
    wrapper.write_text(f'#!/bin/sh\ntouch "{mark}"\nsleep 3\nexec {real} "$@"\n')
    wrapper.chmod(0o755)
    return str(bindir), str(mark)


@pytest.mark.timeout(300)
def test_pressing_interrupt_twice_while_mesh_stop_releases_a_slurm_job_leaves_nothing(cluster, tmp_path):
    bindir, mark = _slow_scancel(tmp_path)
    k = KernelHarness(env={"SLURM_CONF": cluster.conf, "PATH": f"{bindir}:{os.environ['PATH']}"})
    kernel_pid = k.km.provisioner.process.pid
    try:
        r = k.ok('%mesh connect pressed --slurm "-N 2 -t 30" --procs 1', timeout=120)
        m = re.search(r"on slurm job (\d+) started", r.stdout)
        assert m, r.stdout
        k.ok("%%on_mesh\nx = rank")
        assert len(home_processes(k.home) - {kernel_pid}) >= 6   # 2 starters, agents, zygotes, 2 procs
        msg_id = k.submit("%mesh stop pressed")
        deadline = time.monotonic() + 60
        while not os.path.exists(mark) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert os.path.exists(mark), "%mesh stop never ran scancel"
        k.km.interrupt_kernel()   # the stop button, while scancel waits for slurmctld ...
        time.sleep(0.5)
        k.km.interrupt_kernel()   # ... and again, impatiently
        r = k.wait(msg_id, timeout=60)
        assert r.status == "ok", f"%mesh stop was cut short: {r.error or r.stderr}"
        assert "mesh 'pressed' stopped" in r.stdout, r.stdout
        assert "the interrupt was held off until the job was released; nothing of it is left" in r.stderr, r.stderr
        assert cluster.queue() == []
        deadline = time.monotonic() + 10
        while home_processes(k.home) - {kernel_pid} and time.monotonic() < deadline:
            time.sleep(0.1)
        assert home_processes(k.home) - {kernel_pid} == set(), "an agent, zygote or proc of the job is left"
        assert not os.path.exists(os.path.join(k.home, "meshes", "pressed.json")), "the job is still cached"
        # the kernel goes on, and knows the mesh is gone
        assert k.ok("1 + 1").result == "2"
        r = k.run("%%on_mesh\nx")
        assert r.status == "error" and "%mesh connect" in r.reply["content"]["evalue"] + r.stderr + r.stdout
    finally:
        k.close(stop_meshes=("pressed",))
    assert cluster.queue() == []
