"""A host's procs are one scheduling group, apart from their agent (node/linux.py).

256 procs printing as fast as they could on 2 cores left their agent, one of 257 equal
tasks, under 1 % of a CPU: it answered no heartbeat for 30 s and the controller declared
the host lost in the middle of the cell. The zygote starts a session of its own, so the
kernel's autogroup scheduler weighs the procs together against the agent.
"""
from __future__ import annotations

import os

import psutil
import pytest

from monarch_kernel.actor import this_host


def _autogroup(pid: int) -> str:
    with open(f"/proc/{pid}/autogroup") as f:
        return f.read().split()[0]


def test_the_procs_share_a_session_and_scheduling_group_apart_from_their_agent():
    host = this_host("sched-groups")
    try:
        procs = host.spawn_procs(per_host={"gpus": 3}, name="grouped")
        agent = psutil.Process(host._agents[0]["pid"])
        zygote = next(c for c in agent.children() if "zygote" in " ".join(c.cmdline()))
        kids = zygote.children()
        assert len(kids) == 3
        sessions = {os.getsid(p.pid) for p in kids}
        assert sessions == {zygote.pid}, "the procs are in the zygote's own session"
        assert os.getsid(agent.pid) != zygote.pid
        try:
            with open("/proc/sys/kernel/sched_autogroup_enabled") as f:
                enabled = f.read().strip() == "1"
        except OSError:
            enabled = False
        if enabled:   # (where it is off, or the cpu cgroup decides, the session alone is checked)
            assert {_autogroup(p.pid) for p in kids} == {_autogroup(zygote.pid)}
            assert _autogroup(agent.pid) != _autogroup(zygote.pid)
        procs.stop()
    finally:
        host.shutdown()


@pytest.mark.parametrize("stop", ["stop", "shutdown"])
def test_procs_in_their_own_session_still_go_with_their_host(stop):
    """A session of their own takes the procs out of the agent's process group: they must
    still end when the mesh stops or the host shuts down (no orphans)."""
    host = this_host(f"sched-{stop}")
    try:
        procs = host.spawn_procs(per_host={"gpus": 2}, name="ending")
        agent = psutil.Process(host._agents[0]["pid"])
        kids = [p for c in agent.children() for p in c.children()]
        assert len(kids) == 2
        if stop == "stop":
            procs.stop()
        else:
            host.shutdown()
        gone, alive = psutil.wait_procs(kids, timeout=15)
        assert not alive, f"procs left: {[p.pid for p in alive]}"
    finally:
        host.shutdown()
