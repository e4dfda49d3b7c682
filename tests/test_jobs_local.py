"""ProcessJob and LocalJob: the job interface with hosts that are local processes."""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import cloudpickle
import pytest

from monarch_kernel.actor import Actor, endpoint
from monarch_kernel.core.connection import connection_path as job_path
from monarch_kernel.job import JobError, JobGoneError, LocalJob, ProcessJob, job_load

ROOT = Path(__file__).resolve().parents[1]
cloudpickle.register_pickle_by_value(sys.modules[__name__])


class Pid(Actor):
    def __init__(self):
        self.calls = 0

    @endpoint
    def pid(self) -> tuple:
        self.calls += 1
        return os.getpid(), self.calls


def _agent_pids(job) -> list[int]:
    return [a["pid"] for a in job._agents]


def test_process_job_hosts_are_separate_agents_and_a_new_process_reattaches_to_the_same_actors(tmp_path):
    job = ProcessJob(meshes={"hosts": 2})
    try:
        state = job.state()
        assert len(set(_agent_pids(job))) == 2
        procs = state.hosts.spawn_procs(per_host={"gpus": 1})
        assert procs.sizes == {"hosts": 2, "gpus": 1}
        first = procs.spawn("pids", Pid).pid.call().get(timeout=30).values()
        saved = job.dump(tmp_path / "job.json")
        assert oct(os.stat(saved).st_mode & 0o777) == "0o600"
        job.disconnect()
        code = ("import json, sys; from monarch_kernel.job import job_load\n"
                "job = job_load(sys.argv[1])\n"
                "pm = job.state().hosts.proc_mesh('procs')\n"
                "print(json.dumps(pm.actor_mesh('pids').pid.call().get(timeout=20).values()))\n"
                "job.disconnect()\n")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), str(ROOT)]))
        out = subprocess.run([sys.executable, "-c", code, str(saved)], capture_output=True, text=True,
                             timeout=60, env=env)
        assert out.returncode == 0, out.stderr
        again = [tuple(v) for v in json.loads(out.stdout.strip().splitlines()[-1])]
        assert again == [(pid, n + 1) for pid, n in first]
    finally:
        pids = _agent_pids(job)
        job.kill()
    assert not [p for p in pids if _running(p)]
    assert not job.active and not os.path.exists(job_path(job.name))


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_process_job_whose_agents_died_is_reported_gone_and_renewed_only_when_asked():
    job = ProcessJob(meshes={"hosts": 1}, name="gone-test")
    try:
        job.state()
        for pid in _agent_pids(job):
            os.kill(pid, 9)
        while any(_running(p) for p in _agent_pids(job)):
            time.sleep(0.01)
        with pytest.raises(JobGoneError, match="process job 'gone-test' .* is gone: host agent pid"):
            ProcessJob(meshes={"hosts": 1}, name="gone-test").state()
        fresh = ProcessJob(meshes={"hosts": 1}, name="gone-test")
        fresh.state(renew=True).hosts.spawn_procs(per_host={"gpus": 1})
        fresh.kill()
    finally:
        job.kill()


def test_local_job_has_the_per_host_dims_of_this_host():
    job = LocalJob(name="local-job-test")
    try:
        procs = job.state().hosts.spawn_procs(per_host={"gpus": 2})
        assert procs.sizes == {"gpus": 2}
    finally:
        job.kill()


def test_bad_job_specs_say_what_is_wrong():
    with pytest.raises(ValueError, match=r"meshes\['hosts'\] must be a positive number of hosts, got 0"):
        ProcessJob(meshes={"hosts": 0})
    with pytest.raises(ValueError, match="mesh name '2x' must be an identifier"):
        ProcessJob(meshes={"2x": 1})
    job = ProcessJob(meshes={"hosts": 1}, name="spec-clash")
    try:
        job.state()
        with pytest.raises(JobError, match="cached with another spec"):
            ProcessJob(meshes={"hosts": 2}, name="spec-clash").state()
    finally:
        job.kill()


class Env(Actor):
    @endpoint
    def get(self, name: str) -> str | None:
        return os.environ.get(name)


def test_process_job_as_monarch_examples_call_it_with_several_meshes_env_and_no_cache():
    job = ProcessJob({"trainers": 2, "dataloaders": 1}, env={"MK_JOB_TEST": "yes"})
    try:
        state = job.state(cached_path=None)
        assert not job_path(job.name).exists()          # cached_path=None: no cache, as in Monarch
        trainers = state.trainers.spawn_procs(per_host={"gpus": 1})
        loaders = state.dataloaders.spawn_procs(per_host={"gpus": 1})
        assert trainers.sizes == {"hosts": 2, "gpus": 1} and loaders.sizes == {"hosts": 1, "gpus": 1}
        assert trainers.spawn("env", Env).get.call("MK_JOB_TEST").get(timeout=30).values() == ["yes", "yes"]
        with pytest.raises(AttributeError, match="the job has no mesh 'learners'; its meshes: dataloaders, trainers"):
            _ = state.learners
    finally:
        job.kill()


def test_kill_releases_only_what_this_job_object_applied_never_a_job_cached_by_someone_else():
    mine = ProcessJob(meshes={"hosts": 1}, name="kill-rule")
    try:
        mine.state()
        theirs = ProcessJob(meshes={"hosts": 1}, name="kill-rule")   # same name and spec, never applied
        with pytest.warns(UserWarning, match=r"never applied in this process, so kill\(\) released nothing.*"
                                             r"job_load\(.*\)\.kill\(\) or `%mesh stop kill-rule`"):
            theirs.kill()
        assert all(_running(p) for p in _agent_pids(mine)) and job_path("kill-rule").exists()
        # an uncached job of the same spec: its kill() ends its own agents, not the cache of mine
        private = ProcessJob(meshes={"hosts": 1}, name="kill-rule")
        private.state(cached_path=None)
        private_pids = _agent_pids(private)
        private.kill()
        assert not [p for p in private_pids if _running(p)]
        assert all(_running(p) for p in _agent_pids(mine)) and job_path("kill-rule").exists()
        loaded = job_load(job_path("kill-rule"))   # what the warning says: this releases it
        loaded.kill()
        assert not [p for p in _agent_pids(mine) if _running(p)] and not job_path("kill-rule").exists()
    finally:
        mine.kill()


SIGTERMED = """
import json, sys, time
from monarch_kernel.job import ProcessJob
default = ProcessJob(meshes={"hosts": 1}, name="term-default")
chosen = ProcessJob(meshes={"hosts": 1}, name="term-chosen", lease=600)
private = ProcessJob(meshes={"hosts": 1}, name="term-private")
procs = default.state().hosts.spawn_procs(per_host={"gpus": 1})
chosen.state()
private.state(cached_path=None)
pids = {j.name: [a["pid"] for a in j._agents] for j in (default, chosen, private)}
pids["procs"] = [r["pid"] for r in default.state().hosts.status()]
print(json.dumps(pids), flush=True)
time.sleep(300)
"""


def test_sigterm_to_the_controller_ends_its_process_job_agents_unless_a_lease_was_chosen():
    env = dict(os.environ, PYTHONPATH=str(ROOT), MONARCH_KERNEL_NO_TORCH="1")
    ctl = subprocess.Popen([sys.executable, "-c", SIGTERMED], stdout=subprocess.PIPE, text=True, env=env)
    try:
        pids = json.loads(ctl.stdout.readline())
        assert pids["procs"] and all(_running(p) for p in sum(pids.values(), []))
        ctl.terminate()
        assert ctl.wait(20) == -15   # still ended by SIGTERM, as without us
        deadline = time.monotonic() + 10
        ended = pids["term-default"] + pids["procs"] + pids["term-private"]
        while [p for p in ended if _running(p)] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [p for p in ended if _running(p)], "agents or procs left after SIGTERM"
        assert not job_path("term-default").exists()
        assert all(_running(p) for p in pids["term-chosen"])   # lease=600: persistent by choice
    finally:
        if ctl.poll() is None:
            ctl.kill()
            ctl.wait()
        if job_path("term-chosen").exists():
            job_load(job_path("term-chosen")).kill()
    assert not [p for p in pids["term-chosen"] if _running(p)]


def _connect_args(line: str):
    import shlex

    from monarch_kernel.jupyter.commands import CONNECT

    return CONNECT.parse_args(shlex.split(line))


def test_connect_shorthands_make_the_job_they_name_and_bad_combinations_say_why():
    from IPython.core.error import UsageError

    from monarch_kernel.jupyter.jobs import job_from_args

    slurm = job_from_args({}, _connect_args('train --slurm "-N 2 -p gpu --gpus-per-node 8"'), None)
    assert (slurm.kind, slurm.name, slurm.meshes, slurm.slurm_args) == \
        ("slurm", "train", {"hosts": 2}, ["-p", "gpu", "--gpus-per-node", "8"])
    assert job_from_args({}, _connect_args('train --slurm "-N 2"'), 90.0).lease == 90.0   # --lease
    assert slurm.allocation == "sbatch"
    assert job_from_args({}, _connect_args('train --slurm "-N 2" --salloc'), None).allocation == "salloc"
    with pytest.raises(UsageError, match="--salloc goes with --slurm"):
        job_from_args({}, _connect_args("train --salloc"), None)
    k8s = job_from_args({}, _connect_args("kube --k8s ml --image img:1 --replicas 3"), None)
    assert (k8s.kind, k8s.namespace, k8s.meshes) == ("kubernetes", "ml", {"hosts": 3})
    ssh = job_from_args({}, _connect_args("far --ssh gpu1,alice@gpu2:2222"), None)
    assert ssh.hosts == ["gpu1", "alice@gpu2:2222"] and ssh.meshes == {"hosts": 2} and ssh.ssh_args == []
    ssh = job_from_args({}, _connect_args('far --ssh gpu1 --ssh-args "-F ~/c.conf -o \'ProxyJump=a b\'"'), None)
    assert ssh.ssh_args == ["-F", os.path.expanduser("~/c.conf"), "-o", "ProxyJump=a b"]
    with pytest.raises(UsageError, match="--ssh-args goes with --ssh"):
        job_from_args({}, _connect_args('far --slurm "-N 1" --ssh-args "-F c"'), None)
    local = job_from_args({}, _connect_args("here --hosts 3"), 60.0)
    assert (local.kind, local.name, local.meshes, local.lease) == ("process", "here", {"hosts": 3}, 60.0)
    with pytest.raises(UsageError, match="--hosts must be at least 1, got 0"):
        job_from_args({}, _connect_args("here --hosts 0"), None)
    with pytest.raises(UsageError, match="not allowed with argument"):
        _connect_args('here --hosts 2 --slurm "-N 2"')
    mine = ProcessJob({"hosts": 1})
    assert job_from_args({"j": mine}, _connect_args("x --job j"), None) is mine
    with pytest.raises(UsageError, match="--k8s NAMESPACE needs --image"):
        job_from_args({}, _connect_args("kube --k8s ml"), None)
    with pytest.raises(UsageError, match="'j' is a int, not a job"):
        job_from_args({"j": 3}, _connect_args("x --job j"), None)
    with pytest.raises(UsageError, match="node count must be a number"):
        job_from_args({}, _connect_args('x --slurm "-N 2-4"'), None)
    with pytest.raises(UsageError, match="not allowed with argument"):
        _connect_args('x --slurm "-N 2" --ssh a,b')


def test_a_notebook_runs_cells_on_the_mesh_of_a_multi_mesh_job_it_names_and_moves_between_them():
    from kernel_harness import KernelHarness

    k = KernelHarness(env={"MONARCH_KERNEL_NO_TORCH": "1"})
    try:
        k.ok("from monarch_kernel.job import ProcessJob\npj = ProcessJob({'trainers': 2, 'loaders': 1}, name='multi')")
        bad = k.run("%mesh connect multi --job pj --mesh learners")
        assert bad.status == "error", bad.stdout
        assert "has no mesh 'learners'; its meshes: trainers, loaders" in bad.stderr, bad.stderr
        assert not job_path("multi").exists()   # a typo asks for nothing
        r = k.ok("%mesh connect multi --job pj --mesh loaders --procs 1", timeout=120)
        assert "mesh 'multi': 1 procs (hosts=1, gpus=1) on mesh 'loaders' of process job" in r.stdout, r.stdout
        assert "the job's other meshes: trainers (`pj.state().trainers` in Python; " \
               "`%mesh connect multi --mesh trainers` runs the cells there)" in r.stdout
        k.ok("%%on_mesh\nwhere = f'loader {rank}'")
        status = k.ok("%mesh status")
        shown = status.stdout + status.result + "".join(str(m["content"].get("data", {})) for m in status.outputs)
        assert "mesh 'loaders' of trainers, loaders" in shown, shown
        assert k.value("pj.state().trainers.spawn_procs(per_host={'gpus': 1}).sizes") == {"hosts": 2, "gpus": 1}
        k.ok("job = 'a variable of mine'")
        r = k.ok("%mesh connect multi --mesh trainers", timeout=120)
        assert "mesh 'multi': 2 procs (hosts=2, gpus=1) on mesh 'trainers'" in r.stdout, r.stdout
        assert "the job's other meshes: loaders (`%mesh connect multi --mesh loaders` runs" in r.stdout, r.stdout
        assert k.value("job") == "a variable of mine"   # never overwritten
        out = k.ok("%%on_mesh\n'where' in globals()")
        assert "True" not in out.stdout + out.result
        k.ok("%mesh connect multi --mesh loaders", timeout=60)
        out = k.ok("%%on_mesh\nwhere")   # the loaders' namespace was kept
        assert "loader 0" in out.stdout + out.result
        agents = k.value("[a['pid'] for a in pj._agents]")
        assert len(agents) == 3
        k.ok("%mesh stop multi", timeout=60)
        deadline = time.monotonic() + 10
        while [p for p in agents if _running(p)] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [p for p in agents if _running(p)]
    finally:
        k.close(stop_meshes=("multi",))


def test_connect_hosts_makes_a_multi_host_mesh_here_that_survives_a_kernel_restart():
    """`%mesh connect NAME --hosts N`: N local host agents (a ProcessJob named after the mesh),
    the procs per host; the same line after a restart re-attaches to them; stop ends them."""
    from kernel_harness import KernelHarness, home_processes

    k = KernelHarness(env={"MONARCH_KERNEL_NO_TORCH": "1"})
    try:
        # More hosts than the machine holds (--hosts typed for --procs): refused before any starts.
        r = k.run("%mesh connect typo --hosts 100000 --procs 1", timeout=60)
        said = r.stdout + r.stderr + str(r.error)
        assert "100000 hosts on this machine need about 20,000,000 MB" in said and "Ask for fewer hosts" in said, said
        kernel = k.value("__import__('os').getpid()")
        assert not home_processes(k.home) - {kernel}, "agents were started for a refused --hosts"
        r = k.ok("%mesh connect twohosts --hosts 2 --procs 2", timeout=120)
        assert "mesh 'twohosts': 4 procs (hosts=2, gpus=2) on process job" in r.stdout, r.stdout
        r = k.ok("%%on_mesh\nimport os\nzygote = os.getppid()\nprint('up')")
        assert "[ranks 0-3] up" in r.stdout, r.stdout
        assert k.value("len(mesh.slice(hosts=1))") == 2
        k.ok("%%on_mesh\nzygote")
        zygotes = k.value("list(_on_mesh.values())")
        assert len(set(zygotes)) == 2 and zygotes[0] == zygotes[1] != zygotes[2] == zygotes[3], zygotes
        # Each host reads apart in what the user sees (all would say this machine's hostname).
        here = socket.gethostname()
        table = k.value("mesh._repr_html_()")
        rows = re.findall(r"<tr><td>(\d+)</td><td>[^<]*</td><td>([^<]*)</td>", table)
        assert rows == [("0", f"{here}/hosts0"), ("1", f"{here}/hosts0"), ("2", f"{here}/hosts1"),
                        ("3", f"{here}/hosts1")], table
        status = k.ok("%mesh status")
        shown = status.stdout + status.result + "".join(str(m["content"].get("data", {})) for m in status.outputs)
        assert f"{here}/hosts1" in shown, shown

        k.restart()
        r = k.ok("%mesh connect twohosts --hosts 2 --procs 2", timeout=120)
        assert "mesh 'twohosts': 4 procs (hosts=2, gpus=2) on process job" in r.stdout, r.stdout
        assert "re-attached (namespaces and actors kept)" in r.stdout, r.stdout
        k.ok("%%on_mesh\nzygote")   # the same procs, their namespaces kept
        assert k.value("list(_on_mesh.values())") == zygotes

        _lose_a_host_of_two(k)
        kernel = k.value("__import__('os').getpid()")
        k.ok("%mesh stop twohosts", timeout=60)
        deadline = time.monotonic() + 10
        while home_processes(k.home) - {kernel} and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not home_processes(k.home) - {kernel}, "agents or procs left after %mesh stop"
    finally:
        k.close(stop_meshes=("twohosts",))


def _lose_a_host_of_two(k) -> None:
    """kill -9 of host 1's agent: what the notebook says, and that the living host's ranks
    are still usable, each step as a user takes it."""
    import signal

    with open(os.path.join(k.home, "meshes", "twohosts.json")) as f:
        agents = [a["pid"] for a in json.load(f)["agents"]]
    os.kill(agents[1], signal.SIGKILL)
    deadline = time.monotonic() + 10   # (the agent's end is seen within a second: its pidfd)
    while (r := k.run("%%on_mesh\nzygote")).status == "ok" and time.monotonic() < deadline:
        time.sleep(0.2)
    said = "\n".join(r.error["traceback"]) if r.error else r.stdout
    # the other host's ranks keep their state; stop, then connect (a connect alone refuses a
    # job that lost a host). (Rank 2 may have answered this cell before its host was lost.)
    assert "SupervisionError" in said and "host lost" in said, said
    assert "`%mesh stop twohosts`, then `%mesh connect twohosts`" in said, said
    r = k.run("%%on_mesh\nzygote")   # (the cell above may have been sent before the loss was known)
    said = "\n".join(r.error["traceback"])
    assert "ranks 2-3: SupervisionError" in said and "`%mesh stop twohosts`, then" in said, said
    assert "the cell ran on no rank; `%%on_mesh --ranks 0-1` runs it on the living ones" in said, said
    k.ok("%%on_mesh --ranks 0-1\nzygote")
    assert len(set(k.value("list(_on_mesh.values())"))) == 1
    # %mesh top: the living host's ranks, the lost one's dead and why it gives no figures
    # (it stopped with "the agent of host ... is gone" for every host)
    text = k.value("(lambda t: (t.refresh(), t.text())[1])(__import__('monarch_kernel.telemetry.top', "
                   "fromlist=['_']).MeshTop(mesh, 'twohosts'))")
    assert "2 dead" in text and "no figures from it now: the agent of host" in text and "is gone" in text, text
    r = k.ok("%mesh top")
    assert "2 dead" in r.stdout + str(r.data("display_data")), r.outputs
    # %mesh list: one of its two agents gone (it read "gone" while the other host's ranks answered)
    row = [line for line in k.ok("%mesh list").result.splitlines() if line.startswith("twohosts")]
    assert row and "1 of 2 gone" in row[0], row


def test_kill_of_the_kernel_pid_ends_the_agents_of_its_process_job_mesh():
    import signal

    from kernel_harness import KernelHarness, home_processes

    k = KernelHarness(env={"MONARCH_KERNEL_NO_TORCH": "1"})
    try:
        k.ok("from monarch_kernel.job import ProcessJob\npj = ProcessJob({'hosts': 2}, name='kterm')")
        k.ok("%mesh connect kterm --job pj --procs 1", timeout=120)
        kernel = k.value("__import__('os').getpid()")
        assert len(home_processes(k.home) - {kernel}) >= 6   # 2 agents, 2 zygotes, 2 procs
        os.kill(kernel, signal.SIGTERM)   # a user's `kill <kernel pid>`
        deadline = time.monotonic() + 10
        while home_processes(k.home) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not home_processes(k.home), "agents left for their lease after the kernel got SIGTERM"
    finally:
        k.close()


def test_a_process_job_stopped_by_another_process_reads_gone_while_its_agents_wait_to_be_reaped():
    """The Mesh panel's stop (a Jupyter server asking the agents to shut down): the agents
    exit, but their parent (this process, as a kernel holds its ProcessJob) has not reaped
    them yet. Zombies answered ``kill(pid, 0)``, so the panel kept listing the mesh as running."""
    from monarch_kernel.core.connection import list_meshes
    from monarch_kernel.telemetry.server import _ask

    job = ProcessJob(meshes={"hosts": 2}, name="stopped-elsewhere")
    try:
        job.state()
        info = next(info for name, info, _ in list_meshes() if name == "stopped-elsewhere")
        _ask(info, "shutdown", timeout=10.0)
        deadline = time.monotonic() + 10
        while any(_running(p) for p in _agent_pids(job)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(_zombie(p) for p in _agent_pids(job))   # exited, not reaped
        assert [alive for name, _, alive in list_meshes() if name == "stopped-elsewhere"] == [False]
    finally:
        job.kill()


def _zombie(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "Z"
