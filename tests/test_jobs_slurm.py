"""SlurmJob against a real two-node Slurm cluster (tests/slurm_cluster.py): munged,
slurmctld and two slurmds, each node its own network namespace, address and hostname.

Skipped with the reason where root, namespaces or slurm-wlm are missing.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import cloudpickle
import pytest
from slurm_cluster import cluster_fixture

from monarch_kernel.actor import Actor, SupervisionError, endpoint
from monarch_kernel.job import JobError, JobGoneError, SlurmJob

ROOT = Path(__file__).resolve().parents[1]
cloudpickle.register_pickle_by_value(sys.modules[__name__])   # the nodes need not import this file


@pytest.fixture(scope="module")
def cluster():
    yield from cluster_fixture()


class Counter(Actor):
    def __init__(self):
        self.n = 0

    @endpoint
    def bump(self) -> tuple:
        import socket

        self.n += 1
        return socket.gethostname(), self.n

    @endpoint
    def sleep(self, s: float) -> float:
        time.sleep(s)
        return s


def test_slurm_job_spans_both_nodes_and_a_second_process_gets_the_same_actors_back(cluster):
    job = SlurmJob(meshes={"trainers": 2}, job_name="mk-test")
    lines = []
    try:
        state = job.state(progress=lines.append)
        assert any("running on n[1-2]" in line for line in lines), lines
        procs = state.trainers.spawn_procs(per_host={"gpus": 2})
        assert procs.sizes == {"hosts": 2, "gpus": 2}
        counters = procs.spawn("counters", Counter)
        assert counters.bump.call().get(timeout=60).values() == [("n1", 1), ("n1", 1), ("n2", 1), ("n2", 1)]
        assert counters.slice(hosts=1).bump.call().get(timeout=20).values() == [("n2", 2), ("n2", 2)]
        assert oct(os.stat(job.dump()).st_mode & 0o777) == "0o600"
        _assert_key_kept_secret(job._key.hex().encode(), cluster)
        # each agent bound its node's own address, never all interfaces
        assert sorted(a["addr"].rsplit(":", 1)[0] for a in job._agents) == \
            sorted(f"tcp://{ip}" for ip in cluster.node_ip.values())
        job.disconnect()
        # A new process, the same constructor call: the same allocation, procs and actors.
        code = ("import json; from monarch_kernel.job import SlurmJob\n"
                "job = SlurmJob(meshes={'trainers': 2}, job_name='mk-test')\n"
                "pm = job.state().trainers.proc_mesh('procs')\n"
                "print(json.dumps([job.job_id, pm.actor_mesh('counters').bump.call().get(timeout=20).values()]))\n"
                "job.disconnect()\n")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=90, cwd=ROOT)
        assert out.returncode == 0, out.stderr
        job_id, values = json.loads(out.stdout.strip().splitlines()[-1])
        assert job_id == job.job_id
        assert [tuple(v) for v in values] == [("n1", 2), ("n1", 2), ("n2", 3), ("n2", 3)]
    finally:
        t0 = time.monotonic()
        job.kill()
        took = time.monotonic() - t0
    assert cluster.queue() == []
    assert took < 15, took


def _assert_key_kept_secret(key: bytes, cluster) -> None:
    """The mesh key is on no process's command line, and where Slurm keeps it (the job's
    saved environment, state/hash.N/job.N/environment) no one but its owner can read it."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                assert key not in f.read(), f"the key is on the command line of pid {pid}"
        except OSError:
            pass
    for root, _, files in os.walk(cluster.dir):
        for name in files:
            path = os.path.join(root, name)
            try:
                with open(path, "rb") as f:
                    if key in f.read():
                        assert os.stat(path).st_mode & 0o077 == 0, f"{path} holds the key and others can read it"
            except OSError:
                pass


def test_a_node_cut_off_fails_its_ranks_within_5_s_and_the_other_node_keeps_its_state(cluster):
    job = SlurmJob(meshes={"hosts": 2})
    try:
        procs = job.state().hosts.spawn_procs(per_host={"gpus": 1})
        counters = procs.spawn("counters", Counter)
        assert counters.bump.call().get(timeout=60).values() == [("n1", 1), ("n2", 1)]
        fut = counters.slice(hosts=1).sleep.call(30)
        time.sleep(0.3)
        cluster.link("n2", up=False)
        t0 = time.monotonic()
        with pytest.raises(SupervisionError) as e:
            fut.get(timeout=20)
        assert time.monotonic() - t0 < 5.0
        assert "host lost" in str(e.value), e.value
        assert counters.slice(hosts=0).bump.call().get(timeout=10).values() == [("n1", 2)]
    finally:
        cluster.link("n2", up=True)
        job.kill()
    assert cluster.queue() == []


@pytest.mark.parametrize("allocation", ["sbatch", "salloc"])
def test_a_job_cancelled_from_outside_is_reported_on_the_next_interaction(cluster, allocation):
    job = SlurmJob(meshes={"hosts": 1}, allocation=allocation)
    try:
        procs = job.state().hosts.spawn_procs(per_host={"gpus": 1})
        counters = procs.spawn("counters", Counter)
        counters.bump.call().get(timeout=60)
        assert cluster.run("scancel", job.job_id).returncode == 0
        deadline = time.monotonic() + 15
        while cluster.queue() and time.monotonic() < deadline:   # Slurm has ended the job's tasks
            time.sleep(0.05)
        t0 = time.monotonic()
        with pytest.raises(SupervisionError):
            counters.bump.call().get(timeout=15)
        assert time.monotonic() - t0 < 10
        with pytest.raises(JobGoneError, match=f"slurm job {job.job_id} .*(CANCELLED|ended)"):
            job.state()
    finally:
        job.kill()
    assert cluster.queue() == []


def test_sbatch_refusing_the_job_says_why_at_once_and_leaves_nothing(cluster):
    t0 = time.monotonic()
    with pytest.raises(JobError, match="sbatch refused .*[Ii]nvalid partition"):
        SlurmJob(meshes={"hosts": 2}, partition="nosuch").state()
    with pytest.raises(JobError, match="sbatch refused .*Node count specification invalid"):
        SlurmJob(meshes={"hosts": 3}).state()
    with pytest.raises(JobError, match=r"sbatch refused .*Invalid generic resource \(gres\)"):
        SlurmJob(meshes={"hosts": 1}, gpus_per_node=1).state()   # the test nodes have no GPUs
    assert time.monotonic() - t0 < 5
    assert cluster.queue() == []


def test_a_job_pending_past_job_start_timeout_is_cancelled_with_its_pending_reason(cluster):
    job = SlurmJob(meshes={"hosts": 1}, slurm_args=["--begin=now+3600"], job_start_timeout=1.0)
    lines = []
    with pytest.raises(JobError, match=r"still pending after 1 s \(BeginTime\); it was cancelled"):
        job.state(progress=lines.append)
    assert any("queued (BeginTime)" in line for line in lines), lines
    assert cluster.queue() == []


def test_the_lease_releases_an_allocation_no_notebook_is_attached_to(cluster):
    job = SlurmJob(meshes={"hosts": 1}, lease=2.0)
    try:
        job.state()
        job.disconnect()
        deadline = time.monotonic() + 20
        while cluster.queue() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert cluster.queue() == []   # the agent left at its lease, and the allocation with it
        with pytest.raises(JobGoneError, match="has ended|COMPLETED"):
            job.state()
    finally:
        job.kill()


def test_a_job_connect_takes_over_the_name_of_a_prewarmed_local_agent(cluster):
    from monarch_kernel.jupyter.session import MeshSession

    s = MeshSession()
    s.prewarm("nb-prewarmed")   # what a kernel does at start for the notebook's default name
    s._prewarm.join()
    pm, spawned = s.connect("nb-prewarmed", 1, None, None, job=SlurmJob(meshes={"hosts": 1}, name="nb-prewarmed"))
    try:
        assert spawned and pm.sizes == {"hosts": 1, "gpus": 1}
        assert s.job.job_id and cluster.queue()
    finally:
        s.stop("nb-prewarmed")
    assert cluster.queue() == []


def test_slurm_unreachable_is_an_error_not_a_job_given_up(cluster, monkeypatch, tmp_path):
    job = SlurmJob(meshes={"hosts": 1})
    try:
        job.state()
        (tmp_path / "slurm.conf").write_text("SlurmctldHost=nowhere(10.255.255.1)\n")
        monkeypatch.setenv("SLURM_CONF", str(tmp_path / "slurm.conf"))
        with pytest.raises(JobError, match=f"cannot ask Slurm about job {job.job_id}") as e:
            job.state()
        assert not isinstance(e.value, JobGoneError)
        monkeypatch.setenv("SLURM_CONF", cluster.conf)
        assert job.state().hosts is not None and cluster.queue()   # the same job, still there
    finally:
        monkeypatch.setenv("SLURM_CONF", cluster.conf)
        job.kill()
    assert cluster.queue() == []


def test_the_job_parameters_reach_slurm_and_log_dir_keeps_the_nodes_logs(cluster, tmp_path):
    """qos= goes to sbatch the same way; this cluster keeps no accounting, so Slurm drops it."""
    python = tmp_path / "site-python"   # a python_exe of the site's own, e.g. on a shared file system
    python.write_text(f"#!/bin/sh\nMK_SITE_PYTHON=1 exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    job = SlurmJob(meshes={"hosts": 1}, python_exe=str(python), job_name="mk-params", time_limit="10:00",
                   cpus_per_task=2, mem="1M", account="mk-acct", log_dir=str(tmp_path))
    try:
        job.state()
        import psutil

        assert psutil.Process(job._agents[0]["pid"]).environ().get("MK_SITE_PYTHON") == "1"
        shown = cluster.run("scontrol", "show", "job", job.job_id).stdout
        for field in ("JobName=mk-params", "TimeLimit=00:10:00", "CPUs/Task=2", "MinMemoryNode=1M", "Account=mk-acct"):
            assert field in shown, shown
        log = tmp_path / f"monarch-{job.job_id}.out"
        deadline = time.monotonic() + 30
        while "zygote ready" not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "zygote ready" in log.read_text()   # the node's agent logs there
    finally:
        job.kill()
    assert cluster.queue() == []


def test_an_agent_killed_on_its_node_takes_its_zygote_and_procs_with_it(cluster):
    """The node starter begins the zygote before the agent (torch imports meanwhile) and
    hands it over; a kill -9 of the agent still ends that zygote and its procs."""
    import psutil

    job = SlurmJob(meshes={"hosts": 1}, name="agent-killed")
    try:
        procs = job.state(cached_path=None).hosts.spawn_procs(per_host={"gpus": 2})
        procs.spawn("counters", Counter).bump.call().get(timeout=60)
        agent = psutil.Process(job._agents[0]["pid"])
        family = [p for p in agent.parent().children(recursive=True) if p.pid != agent.pid]
        assert any("monarch_kernel.node.zygote" in " ".join(p.cmdline()) for p in family)
        assert len(family) >= 3   # the zygote and the 2 procs it forked
        agent.kill()
        gone, alive = psutil.wait_procs(family, timeout=10)
        assert not alive, f"left after the agent was killed: {[p.cmdline() for p in alive]}"
    finally:
        job.kill()
    assert cluster.queue() == []


# ---------------------------------------------------------------- allocation="salloc"
def _our_sruns(job_id: str) -> list[str]:
    r = subprocess.run(["pgrep", "-af", f"srun --jobid={job_id} "], capture_output=True, text=True)
    return [line for line in r.stdout.splitlines() if "pgrep" not in line]


def _launcher_of(job_id: str) -> int:
    """The pid of the sh this process started to hold job ``job_id``'s step (from /proc)."""
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{d}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except (OSError, ValueError):
            continue
        if ppid == os.getpid() and argv[:2] == [b"sh", b"-c"] and b"srun" in argv[2] and argv[4:5] == [job_id.encode()]:
            return int(d)
    raise AssertionError(f"no launcher of slurm job {job_id} among this process's children")


def _state(pid: int) -> str | None:
    """A process's state letter (Z: a zombie), or None once it is gone (reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def test_salloc_allocation_spans_both_nodes_and_kill_leaves_nothing(cluster, monkeypatch):
    # as if the kernel ran inside a Slurm job of its own (a notebook server started by sbatch):
    # srun must not take that job's shape for the new allocation's step
    for var, value in (("SLURM_JOB_ID", "99999"), ("SLURM_NTASKS", "7"), ("SLURM_NNODES", "1"),
                       ("SLURM_CPUS_PER_TASK", "3"), ("SLURM_NODELIST", "n1"), ("SLURM_TASKS_PER_NODE", "7")):
        monkeypatch.setenv(var, value)
    job = SlurmJob(meshes={"trainers": 2}, allocation="salloc", job_name="mk-salloc")
    lines = []
    try:
        procs = job.state(progress=lines.append).trainers.spawn_procs(per_host={"gpus": 2})
        got = procs.spawn("c", Counter).bump.call().get(timeout=120)
        assert sorted(h for h, _ in got.values()) == ["n1", "n1", "n2", "n2"]
        assert any("allocated; starting the agents" in line for line in lines), lines
        assert _our_sruns(job.job_id)   # the step's srun runs here, in a session of its own
        job_id = job.job_id
        launcher = _launcher_of(job_id)
    finally:
        job.kill()
    assert _state(launcher) is None, "kill() left the step's launcher (sh) running or a zombie"
    assert cluster.queue() == []
    deadline = time.monotonic() + 10
    while _our_sruns(job_id) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _our_sruns(job_id) == []


def test_salloc_refusal_and_pending_timeout_say_why_and_leave_nothing(cluster):
    with pytest.raises(JobError, match="salloc refused .*[Ii]nvalid partition"):
        SlurmJob(meshes={"hosts": 2}, partition="nosuch", allocation="salloc").state(cached_path=None)
    with pytest.raises(JobError, match="salloc refused .*Node count specification invalid"):   # 3 of 2 nodes
        SlurmJob(meshes={"hosts": 3}, allocation="salloc").state(cached_path=None)
    assert cluster.queue() == []
    job = SlurmJob(meshes={"hosts": 1}, slurm_args=["--begin=now+3600"], job_start_timeout=1.0, allocation="salloc")
    lines = []
    with pytest.raises(JobError, match=r"still pending after 1 s \(BeginTime\); it was cancelled"):
        job.state(cached_path=None, progress=lines.append)
    assert any("queued (BeginTime)" in line for line in lines), lines
    assert cluster.queue() == []
    with pytest.raises(ValueError, match="allocation must be"):
        SlurmJob(meshes={"hosts": 1}, allocation="srun")
    # the interrupt button while salloc waits: its request is revoked, nothing queued or running
    import signal
    import threading

    job = SlurmJob(meshes={"hosts": 1}, slurm_args=["--begin=now+3600"], allocation="salloc", name="salloc-int")
    timer = threading.Timer(1.5, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            job.state(cached_path=None)
    finally:
        timer.cancel()
    assert cluster.queue() == [] and not job.active
    left = subprocess.run(["pgrep", "-af", "salloc --no-shell --job-name=salloc-int"], capture_output=True, text=True)
    assert [line for line in left.stdout.splitlines() if "pgrep" not in line] == []


def test_salloc_lease_releases_the_allocation_even_with_the_launcher_gone(cluster):
    """At the lease the agents end and the allocation is cancelled (an interactive
    allocation would otherwise sit idle until its time limit); the nodes do it themselves
    when the srun on the kernel's machine is gone too."""
    import signal

    for launcher_gone in (False, True):
        job = SlurmJob(meshes={"hosts": 2}, lease=2.0, allocation="salloc", name=f"salloc-lease-{int(launcher_gone)}")
        try:
            job.state(cached_path=None)
            job_id = job.job_id
            if launcher_gone:   # the wrapper (so it cannot cancel) and srun, all at once
                gone = [_launcher_of(job_id), *(int(line.split()[0]) for line in _our_sruns(job_id))]
                # srun is two processes: killed one after the other, the second saw the first die
                # and cancelled the step with SIGKILL (1 run in 6 under load), before any node could
                # cancel the allocation. A machine that is gone takes them all at the same instant:
                # stopped first, none of them can react.
                for pid in gone:
                    os.kill(pid, signal.SIGSTOP)
                for pid in gone:
                    os.kill(pid, signal.SIGKILL)
            job.disconnect()
            deadline = time.monotonic() + 30
            while cluster.queue() and time.monotonic() < deadline:
                time.sleep(0.1)
            assert cluster.queue() == [], launcher_gone
        finally:
            job.kill()


def test_salloc_launcher_is_reaped_when_its_step_ends_at_the_lease(cluster):
    """The sh that holds an salloc job's step (and cancels the allocation after it) is this
    process's child: when the step ends on its own (the lease), it is reaped at once, not
    left a zombie (``<defunct>`` in ps) until the process's next subprocess call."""
    job = SlurmJob(meshes={"hosts": 1}, lease=2.0, allocation="salloc", name="salloc-reaped")
    try:
        job.state(cached_path=None)
        launcher = _launcher_of(job.job_id)
        job.disconnect()
        # No subprocess call from here on: Python's subprocess module reaps the children it
        # lost track of at its next call, which would hide the zombie.
        deadline = time.monotonic() + 60
        while _state(launcher) not in (None, "Z") and time.monotonic() < deadline:
            time.sleep(0.1)
        deadline = time.monotonic() + 5
        while _state(launcher) == "Z" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _state(launcher) is None, f"the launcher is {_state(launcher)} 60 s after a 2 s lease"
    finally:
        job.kill()
    assert cluster.queue() == []


def test_salloc_allocation_is_released_when_the_kernels_machine_shuts_down(cluster):
    """A shutdown of the machine the kernel runs on sends every process SIGTERM: srun then
    cancels the step and Slurm kills the agents at once, before any node's starter can
    cancel the allocation. The launcher's sh outlives that SIGTERM and cancels it, so the
    interactive allocation is not left running without a step until its time limit."""
    import signal

    job = SlurmJob(meshes={"hosts": 2}, allocation="salloc", name="salloc-shutdown")
    try:
        job.state(cached_path=None)
        job_id = job.job_id
        launcher, sruns = _launcher_of(job_id), [int(line.split()[0]) for line in _our_sruns(job_id)]
        job.disconnect()
        for pid in [launcher, *sruns]:
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while cluster.queue() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert cluster.queue() == [], "the allocation outlived its step"
    finally:
        job.kill()
    assert cluster.queue() == []
