"""SSHJob against real sshd on two hosts, each its own network namespace (tests/ssh_hosts.py):
key-based login, the mesh key on ssh's stdin. Skipped with the reason without root/sshd."""
from __future__ import annotations

import os
import re
import sys
import time

import cloudpickle
import pytest
from kernel_harness import KernelHarness, home_processes
from ssh_hosts import hosts_fixture

from monarch_kernel.actor import Actor, endpoint
from monarch_kernel.job import JobError, SSHJob

cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def hosts():
    yield from hosts_fixture()


def _job(hosts, names=("h1", "h2"), **kw) -> SSHJob:
    # The agents carry this session's home, so the orphan check sees them too.
    env = {"MONARCH_KERNEL_HOME": os.environ["MONARCH_KERNEL_HOME"]}
    return SSHJob(hosts=list(names), ssh_args=["-F", hosts.config], env=env, connect_timeout=2, **kw)


class Where(Actor):
    @endpoint
    def host(self) -> str:
        import socket

        return socket.gethostname()


def test_ssh_job_starts_an_agent_per_host_and_the_key_never_reaches_a_command_line(hosts):
    names = ("h1", "root@h2:22")   # both spellings of a host: ssh config alias, user@host:port
    job = _job(hosts, names)
    try:
        procs = job.state().hosts.spawn_procs(per_host={"gpus": 2})
        assert procs.spawn("where", Where).host.call().get(timeout=60).values() == ["h1", "h1", "h2", "h2"]
        key = job._key.hex()
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        assert key.encode() not in f.read(), f"the key is on the command line of pid {pid}"
                except OSError:
                    pass
        job.disconnect()
        again = _job(hosts, names)   # a new job object, as after a kernel restart: the same agents
        assert again.state().hosts.proc_mesh("procs").actor_mesh("where").host.call().get(timeout=20).values() \
            == ["h1", "h1", "h2", "h2"]
        assert again.job_id == job.job_id
    finally:
        job.kill()


def test_an_unreachable_host_is_named_and_no_agent_is_left_on_the_others(hosts):
    t0 = time.monotonic()
    with pytest.raises(JobError, match="nowhere: .*none were left running"):
        _job(hosts, names=("h1", "nowhere")).state()
    assert time.monotonic() - t0 < 15


def test_connect_ssh_cell_runs_cells_on_both_hosts_shows_the_job_and_stop_ends_every_agent(hosts):
    """The user's line, through a real kernel and the system ssh client: the test hosts'
    client config and the session's home (so the orphan check sees the agents) go in as
    ssh options with --ssh-args, as a user passes a cluster's config or a jump host."""
    k = KernelHarness()
    ssh_args = f"-F {hosts.config} -o SetEnv=MONARCH_KERNEL_HOME={k.home}"
    try:
        r = k.ok(f'%mesh connect far --ssh h1,h2 --ssh-args "{ssh_args}" --per-host gpus=2', timeout=120)
        m = re.search(r"mesh 'far': 4 procs \(hosts=2, gpus=2\) on ssh job (ssh-\w+) started", r.stdout)
        assert m, r.stdout + r.stderr
        kernel = k.value("__import__('os').getpid()")
        on_hosts = home_processes(k.home) - {kernel}
        assert len(on_hosts) >= 2 + 2 + 4   # an agent and a zygote per host, 4 procs
        out = k.ok("%%on_mesh\nimport socket\nf'{socket.gethostname()} rank {rank}'")
        assert all(f"h{1 + r // 2} rank {r}" in out.stdout + out.result for r in range(4)), out.stdout + out.result
        status = k.ok("%mesh status")
        shown = status.stdout + status.result + "".join(
            str(msg["content"].get("data", {})) for msg in status.outputs)
        assert f"ssh job {m.group(1)} (on h1,h2)" in shown, shown
        assert "stopped" in k.ok("%mesh stop far", timeout=60).stdout
        deadline = time.monotonic() + 10
        while home_processes(k.home) - {kernel} and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not home_processes(k.home) - {kernel}, "agents, zygotes or procs left on the hosts"
        assert k.run("%%on_mesh\n1").status == "error"
    finally:
        k.close(stop_meshes=("far",))


def test_an_interrupt_while_ssh_starts_the_agents_leaves_none_running(hosts, tmp_path):
    import signal
    import threading

    slow = tmp_path / "slow-python"   # each host takes 3 s to start: the interrupt lands meanwhile
    slow.write_text(f'#!/bin/sh\nsleep 3\nexec {sys.executable} "$@"\n')
    slow.chmod(0o755)
    before = home_processes(os.environ["MONARCH_KERNEL_HOME"])
    job = _job(hosts, python_exe=str(slow), name="ssh-interrupted")
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            job.state()
    finally:
        timer.cancel()
    deadline = time.monotonic() + 10
    while home_processes(os.environ["MONARCH_KERNEL_HOME"]) - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not home_processes(os.environ["MONARCH_KERNEL_HOME"]) - before, "agents left on the hosts"
    assert not job.active


def test_the_lease_ends_the_ssh_agents_no_notebook_is_attached_to(hosts):
    before = home_processes(os.environ["MONARCH_KERNEL_HOME"])
    job = _job(hosts, lease=2.0, name="ssh-leased")
    try:
        job.state()
        job.disconnect()
        deadline = time.monotonic() + 20
        while home_processes(os.environ["MONARCH_KERNEL_HOME"]) - before and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not home_processes(os.environ["MONARCH_KERNEL_HOME"]) - before, "agents left after their lease"
        with pytest.raises(JobError, match="no longer runs"):
            job.state()
    finally:
        job.kill()


def test_a_host_cut_off_fails_its_ranks_the_other_keeps_its_state_and_agents_killed_outside_are_reported(hosts):
    """Issue 12's faults for ssh hosts: a host whose link goes down fails its ranks and the
    other keeps its state; agents ended from outside are reported on the next interaction."""
    import signal

    from monarch_kernel.actor import SupervisionError
    from monarch_kernel.job import JobGoneError

    job = _job(hosts, name="ssh-faults")
    try:
        where = job.state().hosts.spawn_procs(per_host={"gpus": 1}).spawn("where", Counted)
        assert where.host.call().get(timeout=60).values() == [("h1", 1), ("h2", 1)]
        hosts.net.link("h2", up=False)
        try:
            with pytest.raises(SupervisionError, match="host lost"):
                where.slice(hosts=1).host.call().get(timeout=30)
            assert where.slice(hosts=0).host.call().get(timeout=10).values() == [("h1", 2)]
        finally:
            hosts.net.link("h2", up=True)
        h2_agent = job._handle["agents"]["1"]
        os.kill(h2_agent, signal.SIGKILL)   # (the "hosts" share this machine's pid space)
        with pytest.raises(JobGoneError, match=rf"the agent on h2 \(pid {h2_agent}\) no longer runs"):
            job.state()
    finally:
        job.kill()


class Counted(Actor):
    def __init__(self):
        self.n = 0

    @endpoint
    def host(self) -> tuple:
        import socket

        self.n += 1
        return socket.gethostname(), self.n
