"""Persistence against real processes: a named mesh outlives the controller that started
it, a second controller process attaches and finds the same procs and actor state, the
lease stops an unattached agent, and stop()/shutdown()/the end of a private controller end
their processes."""
from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time

import pytest

from monarch_kernel.actor import MeshGoneError, attach, this_host
from monarch_kernel.core.connection import connection_path, home

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "persist_controller.py")


def controller(*args: str, timeout: float = 120) -> dict:
    """Run the helper controller to completion; its RESULT line as a dict."""
    out = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=timeout,
                         cwd=os.path.dirname(SCRIPT))
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):   # (gone, or gone between the open and the read)
        return False


def wait_gone(pids, within: float) -> list[int]:
    """The pids still alive after ``within`` seconds (empty when all ended in time)."""
    deadline = time.monotonic() + within
    left = [p for p in pids if alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [p for p in left if alive(p)]
    return left


def test_a_second_controller_attaches_to_the_same_procs_and_state():
    name = "persist-attach"
    first = controller("start", name, "60", "exit")
    assert first["state"] == [{"total": 105, "pid": pid} for pid in first["pids"]]
    assert alive(first["agent_pid"]) and all(alive(p) for p in first["pids"])   # outlived its controller
    path = connection_path(name)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700

    second = controller("attach", name)                                         # another process
    assert second["agent_pid"] == first["agent_pid"] and second["pids"] == first["pids"]
    assert second["before"] == first["state"]
    assert [s["total"] for s in second["state"]] == [106, 106]

    hm = attach(name)                                                           # and this one
    try:
        assert this_host(name) is hm
        pm = hm.proc_mesh("procs")
        assert [r.pid for r in pm.procs()] == first["pids"] and pm.sizes == {"gpus": 2}
        keeper = pm.actor_mesh("keeper")
        assert [s["total"] for s in keeper.state.call().get(30).values()] == [106, 106]
        assert keeper.add.call(4).get(30).values() == [110, 110]
        # a new mesh on the same, re-attached agent works too
        assert hm.spawn_procs(per_host={"gpus": 1}, name="more").size() == 1
    finally:
        hm.shutdown()
    assert wait_gone([first["agent_pid"], *first["pids"]], 5) == []
    assert not path.exists()
    with pytest.raises(MeshGoneError, match=f"no mesh named '{name}'"):
        attach(name)


def test_the_lease_stops_an_agent_nobody_attaches_to():
    name = "persist-lease"
    first = controller("start", name, "2", "detach")
    t0 = time.monotonic()
    pids = [first["agent_pid"], *first["pids"]]
    assert all(alive(p) for p in pids)
    assert wait_gone(pids, 10) == [], "the agent and its procs outlived a 2 s lease"
    assert time.monotonic() - t0 > 1.0   # not before the lease
    assert not connection_path(name).exists()
    with pytest.raises(MeshGoneError, match="no mesh named"):
        attach(name)


def test_the_end_of_a_private_controller_ends_its_mesh():
    p = subprocess.Popen([sys.executable, SCRIPT, "private"], stdout=subprocess.PIPE, text=True,
                         cwd=os.path.dirname(SCRIPT))
    try:
        line = ""
        while not line.startswith("RESULT "):
            line = p.stdout.readline()
            assert line, "the controller exited early"
        info = json.loads(line[len("RESULT "):])
        pids = [info["agent_pid"], *info["pids"]]
        assert all(alive(x) for x in pids)
        p.send_signal(signal.SIGKILL)
        p.wait(10)
        assert wait_gone(pids, 5) == [], "the mesh of a SIGKILLed private controller kept running"
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        p.stdout.close()


def test_stop_ends_the_procs_and_the_host_stays_usable():
    hm = this_host()
    pm = hm.spawn_procs(per_host={"gpus": 2}, name="to-stop")
    pids = [r.pid for r in pm.procs()]
    assert all(alive(x) for x in pids)
    pm.slice(gpus=0).stop()          # stops the whole mesh, even from a slice
    assert wait_gone(pids, 3) == []
    assert "to-stop" not in hm.proc_meshes
    pm.stop()                        # a second stop is harmless
    again = hm.spawn_procs(per_host={"gpus": 1}, name="after-stop")
    try:
        assert again.size() == 1 and alive(again.procs()[0].pid)
    finally:
        again.stop()


def test_a_proc_that_died_while_detached_is_reported_on_attach_and_respawned():
    name = "persist-died"
    first = controller("start", name, "60", "detach")
    os.kill(first["pids"][1], signal.SIGKILL)
    log_file = home() / "logs" / f"{name}.log"
    deadline = time.monotonic() + 5
    while f"pid {first['pids'][1]}) killed" not in log_file.read_text() and time.monotonic() < deadline:
        time.sleep(0.02)   # the agent has noticed the death before anyone attaches
    hm = attach(name)
    try:
        pm = hm.proc_mesh("procs")
        keeper = pm.actor_mesh("keeper")
        assert pm.dead_ranks() == [1]
        from monarch_kernel.actor import SupervisionError

        with pytest.raises(SupervisionError, match="rank 1.*died while no controller was attached"):
            keeper.state.call()
        assert keeper.slice(gpus=0).state.call_one().get(30)["total"] == 105
        pm.respawn()                 # the actor is re-created from its recorded spawn arguments
        assert [s["total"] for s in keeper.state.call().get(30).values()] == [105, 100]
        assert pm.procs()[1].pid != first["pids"][1] and pm.procs()[0].pid == first["pids"][0]
    finally:
        hm.shutdown()
    assert wait_gone([first["agent_pid"], first["pids"][0]], 5) == []
