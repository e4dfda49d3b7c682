"""SSHJob against real sshd on two hosts, each its own network namespace (tests/ssh_hosts.py):
key-based login, the mesh key on ssh's stdin. Skipped with the reason without root/sshd."""
from __future__ import annotations

import os
import sys
import time

import cloudpickle
import pytest
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
    job = _job(hosts)
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
        again = _job(hosts)   # a new job object, as after a kernel restart: the same agents
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
