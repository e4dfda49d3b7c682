"""``%mesh connect --slurm`` end to end: a real kernel (jupyter_client) on a real two-node
Slurm cluster (tests/slurm_cluster.py). Skipped with the reason where Slurm cannot run."""
from __future__ import annotations

import os
import re
import subprocess
import time

import pytest
from kernel_harness import KernelHarness
from slurm_cluster import cluster_fixture

CONNECT = '%mesh connect train --slurm "-N 2 -t 30" --procs 2'


@pytest.fixture(scope="module")
def cluster():
    yield from cluster_fixture()


@pytest.fixture(scope="module")
def k8s():
    try:
        import kubernetes  # noqa: F401
    except ImportError:
        yield None
        return
    import shutil

    from fake_k8s import FakeKubernetes

    with FakeKubernetes(use_netns=os.geteuid() == 0 and bool(shutil.which("ip"))) as fake:
        yield fake


@pytest.fixture(scope="module")
def k(cluster, k8s):
    env = {"SLURM_CONF": cluster.conf}
    if k8s is not None:
        env["KUBECONFIG"] = k8s.kubeconfig
    h = KernelHarness(env=env)
    try:
        yield h
    finally:
        h.close(stop_meshes=("train",))
    assert cluster.queue() == []


COUNTER = """from monarch_kernel.actor import Actor, endpoint
class Counter(Actor):
    def __init__(self):
        self.n = 0
    @endpoint
    def bump(self):
        self.n += 1
        return self.n
"""


def _texts(r) -> str:
    return "\n".join(m["content"]["data"]["text/plain"] for m in r.outputs
                     if m["msg_type"] in ("display_data", "update_display_data"))


def test_connect_cell_gets_a_slurm_allocation_and_runs_cells_on_both_nodes(k, cluster):
    r = k.ok(CONNECT, timeout=120)
    m = re.search(r"mesh 'train': 4 procs \(hosts=2, gpus=2\) on slurm job (\d+) started", r.stdout)
    assert m, r.stdout
    assert "running on n[1-2]" in _texts(r)   # the progress line said what squeue said
    k.job_id = m.group(1)
    k.ok("%%on_mesh\nimport socket\nwhere = f'{socket.gethostname()} rank {rank}'")
    k.ok(COUNTER + "counters = mesh.spawn('counters', Counter)\ncounters.bump.call().get(timeout=30).values()")
    assert "n2 rank 3" in k.ok("%%on_mesh\nwhere").stdout + k.ok("%%on_mesh\nwhere").result
    status = k.ok("%mesh status")
    shown = status.stdout + _texts(status) + status.result
    assert re.search(rf"slurm job {k.job_id} \(RUNNING on n\[1-2\] time left (29|30):\d\d\)", shown), shown


def test_rerunning_the_connect_cell_after_a_restart_reattaches_to_the_same_job_and_state(k, cluster):
    k.restart()
    r = k.ok(CONNECT, timeout=60)
    assert f"on slurm job {k.job_id} re-attached" in r.stdout, r.stdout
    out = k.ok("%%on_mesh\nwhere")
    assert "n1 rank 0" in out.stdout + out.result and "n2 rank 3" in out.stdout + out.result
    # the same actors, not new ones: their counts go on from before the restart
    assert k.value("mesh.actor_mesh('counters').bump.call().get(timeout=30).values()") == [2, 2, 2, 2]


def test_disconnect_leaves_the_allocation_and_stop_releases_it(k, cluster):
    k.ok("%mesh disconnect")
    assert [line.split()[0] for line in cluster.queue()] == [k.job_id]
    r = k.ok("%mesh connect train", timeout=60)   # the name alone finds the job again
    assert f"on slurm job {k.job_id} re-attached" in r.stdout, r.stdout
    r = k.ok("%mesh stop train", timeout=60)
    assert "stopped" in r.stdout
    assert cluster.queue() == []


def test_interrupting_a_queued_connect_cancels_the_request(k, cluster):
    seen = []
    msg_id = k.submit('%mesh connect later --slurm "-N 1 --begin=now+3600"')

    def watch(msg):
        seen.append(msg)
        data = msg["content"].get("data", {}).get("text/plain", "")
        if "queued (BeginTime)" in data:
            k.km.interrupt_kernel()

    r = k.wait(msg_id, timeout=60, on_output=watch)
    assert r.status == "error" and r.reply["content"]["ename"] == "KeyboardInterrupt", r.reply["content"]
    deadline = time.monotonic() + 10
    while cluster.queue() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert cluster.queue() == []


def test_connect_salloc_survives_a_kernel_restart_and_stop_leaves_nothing(k, cluster):
    """--salloc: an interactive allocation whose step's srun runs on the kernel's machine in
    a session of its own: a kernel restart does not end it; %mesh stop ends it all."""
    cell = '%mesh connect quick --slurm "-N 2 --time 30" --salloc --procs 1'
    r = k.ok(cell, timeout=120)
    m = re.search(r"mesh 'quick': 2 procs \(hosts=2, gpus=1\) on slurm job (\d+) started", r.stdout)
    assert m, r.stdout
    job_id = m.group(1)
    assert "allocated; starting the agents" in _texts(r)
    k.ok("%%on_mesh\nimport socket\nwhere = f'{socket.gethostname()} rank {rank}'")
    k.restart()
    r = k.ok(cell, timeout=60)
    assert f"on slurm job {job_id} re-attached" in r.stdout, r.stdout
    out = k.ok("%%on_mesh\nwhere")
    assert "n1 rank 0" in out.stdout + out.result and "n2 rank 1" in out.stdout + out.result
    k.ok("%mesh stop quick", timeout=60)
    assert cluster.queue() == []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and subprocess.run(["pgrep", "-f", f"srun --jobid={job_id} "]).returncode == 0:
        time.sleep(0.1)
    assert subprocess.run(["pgrep", "-f", f"srun --jobid={job_id} "]).returncode != 0


def test_connect_k8s_runs_cells_in_pods_of_the_fake_cluster_and_stop_deletes_them(k, k8s):
    if k8s is None:
        pytest.skip("the kubernetes client is an extra: pip install 'monarch-kernel[kubernetes]'")
    r = k.ok("%mesh connect kube --k8s default --image fake/monarch:1 --replicas 2 --procs 1", timeout=120)
    assert re.search(r"mesh 'kube': 2 procs \(hosts=2, gpus=1\) on kubernetes job mk-kube-\w+ started", r.stdout), \
        r.stdout
    assert "pods: Running 2; agents up 2/2" in _texts(r)
    out = k.ok("%%on_mesh\nimport socket\nsocket.gethostname()")
    assert "mk-kube-" in out.stdout + out.result and "-hosts-1" in out.stdout + out.result
    status = k.ok("%mesh status")
    shown = status.stdout + _texts(status) + status.result
    assert re.search(r"kubernetes job mk-kube-\w+ \(pods Running 2/2 on mk-kube-\w+-hosts-0(-\w+)?,"
                     r"mk-kube-\w+-hosts-1(-\w+)?\)", shown), shown
    k.ok("%mesh stop kube", timeout=60)
    assert not k8s.pods and not k8s.secrets and not k8s.jobs


def test_a_job_cancelled_from_outside_is_reported_and_the_notebook_gets_a_new_one(k, cluster):
    """scancel from outside (an admin, the time limit): the next cell fails at once, the
    connect cell says the job is gone and what to run, and after that a new job comes."""
    cell = '%mesh connect outside --slurm "-N 2 -t 30" --procs 1'
    r = k.ok(cell, timeout=120)
    job_id = re.search(r"on slurm job (\d+) started", r.stdout).group(1)
    k.ok("%%on_mesh\nx = rank")
    assert cluster.run("scancel", job_id).returncode == 0
    deadline = time.monotonic() + 15
    while cluster.queue() and time.monotonic() < deadline:
        time.sleep(0.1)
    r = k.run("%%on_mesh\nx", timeout=60)
    said = r.reply["content"].get("evalue", "") + r.stderr
    assert r.status == "error" and ("host lost" in said or "is gone" in said), said
    r = k.run(cell, timeout=60)   # re-running the connect cell: the job is reported gone, with what to do
    said = r.reply["content"].get("evalue", "")
    assert r.status == "error" and f"slurm job 'outside' (id {job_id}) is gone" in said, said
    assert "`%mesh stop outside`" in said, said
    assert "stopped" in k.ok("%mesh stop outside", timeout=60).stdout
    r = k.ok(cell, timeout=120)   # ... and then the same cell asks for a new allocation
    new_id = re.search(r"on slurm job (\d+) started", r.stdout).group(1)
    assert new_id != job_id
    out = k.ok("%%on_mesh\nimport socket\nsocket.gethostname()")
    assert "n1" in out.stdout + out.result and "n2" in out.stdout + out.result
    k.ok("%mesh stop outside", timeout=60)
    assert cluster.queue() == []


@pytest.mark.timeout(300)
def test_the_slurm_notebook_runs_against_a_fresh_cluster_and_its_outputs_match(tmp_path):
    """notebooks/slurm.ipynb under nbval (tests/test_notebooks.py runs the others): its own
    cluster, so job ids start at 1 as when its outputs were stored."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from kernel_harness import ensure_kernelspec
    from slurm_cluster import SlurmCluster, unavailable

    why = unavailable()
    if why:
        pytest.skip(f"no Slurm test cluster: {why}")
    ensure_kernelspec()
    root = Path(__file__).resolve().parents[1]
    with SlurmCluster() as c:
        env = {**os.environ, "MONARCH_KERNEL_PREWARM": "0", "SLURM_CONF": c.conf,
               "MONARCH_KERNEL_HOME": str(tmp_path / "home")}
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval",
               str(root / "notebooks" / "slurm.ipynb"), "--nbval-kernel-name", "monarch",
               "--nbval-sanitize-with", str(root / "notebooks" / "sanitize.cfg"), "--nbval-cell-timeout", "120",
               "--rootdir", str(tmp_path), "-o", "addopts="]
        proc = subprocess.run(cmd, cwd=root / "notebooks", env=env, capture_output=True, text=True, timeout=280)
        assert c.queue() == []
    assert proc.returncode == 0, f"nbval failed on slurm.ipynb:\n{proc.stdout[-6000:]}\n{proc.stderr[-2000:]}"
