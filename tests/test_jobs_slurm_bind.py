"""``MONARCH_KERNEL_BIND`` with a real two-node Slurm cluster (tests/slurm_cluster.py, each
node its own network namespace and address): the variable names the controller's address,
and sbatch hands the controller's environment to the nodes, so a node must not take the
controller's address for its own agent. Skipped with the reason where Slurm cannot run."""
from __future__ import annotations

import sys

import cloudpickle
import psutil
import pytest
from slurm_cluster import cluster_fixture

from monarch_kernel.actor import Actor, endpoint
from monarch_kernel.job import SlurmJob

cloudpickle.register_pickle_by_value(sys.modules[__name__])   # the nodes need not import this file


@pytest.fixture(scope="module")
def cluster():
    yield from cluster_fixture()


class Where(Actor):
    @endpoint
    def host(self) -> str:
        import socket

        return socket.gethostname()


@pytest.mark.timeout(180)
def test_bind_set_for_the_controller_reaches_the_nodes_environment_and_their_agents_still_start(cluster, monkeypatch):
    import os

    def listening() -> set[str]:
        return {c.laddr.ip for c in psutil.Process(os.getpid()).net_connections(kind="inet")
                if c.status == psutil.CONN_LISTEN and not c.laddr.ip.startswith("127.")}

    before = listening()   # (earlier tests of this process may have had it listen elsewhere)
    monkeypatch.setenv("MONARCH_KERNEL_BIND", cluster.bridge_ip)
    job = SlurmJob(meshes={"hosts": 2}, job_name="mk-bind", job_start_timeout=60)
    try:
        procs = job.state().hosts.spawn_procs(per_host={"gpus": 1})
        assert procs.spawn("where", Where).host.call().get(timeout=60).values() == ["n1", "n2"]
        # each node's agent is on its own address; the controller listens on the one named
        assert sorted(a["addr"].split("://")[1].rsplit(":", 1)[0] for a in job._agents) == \
            sorted(cluster.node_ip.values())
        after = listening()
        assert cluster.bridge_ip in after and after - before <= {cluster.bridge_ip}, (before, after)
    finally:
        job.kill()
    assert cluster.queue() == []


def test_a_bind_address_this_machine_does_not_have_fails_the_slurm_job_at_once_with_nothing_queued(cluster,
                                                                                                   monkeypatch):
    import time

    from monarch_kernel.job import JobError

    absent = cluster.bridge_ip.rsplit(".", 1)[0] + ".250"
    monkeypatch.setenv("MONARCH_KERNEL_BIND", absent)
    job = SlurmJob(meshes={"hosts": 2}, job_name="mk-bad-bind", job_start_timeout=60)
    t0 = time.monotonic()
    with pytest.raises(JobError, match=f"MONARCH_KERNEL_BIND={absent} is not an address of this machine"):
        job.state()
    assert time.monotonic() - t0 < 10
    assert cluster.queue() == [] and not job.active
