"""The mesh outlives the kernel: restart and re-attach, disconnect, a dead agent, the
default name and the prewarmed agent. Real kernels (jupyter_client), real meshes."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import psutil
import pytest
from kernel_harness import KernelHarness

NOTEBOOK = "/work/some dir/train model.ipynb"


@pytest.fixture(scope="module")
def k():
    # A prewarming kernel that knows its notebook, as under jupyter_server.
    h = KernelHarness(prewarm=True, env={"JPY_SESSION_NAME": NOTEBOOK})
    try:
        yield h
    finally:
        h.close(stop_meshes=(default_name(),))


def default_name() -> str:
    from monarch_kernel.jupyter import session

    old = os.environ.get("JPY_SESSION_NAME")
    os.environ["JPY_SESSION_NAME"] = NOTEBOOK
    try:
        return session.default_mesh_name()
    finally:
        if old is None:
            del os.environ["JPY_SESSION_NAME"]
        else:
            os.environ["JPY_SESSION_NAME"] = old


def test_default_name_comes_from_the_notebook_and_the_agent_is_prewarmed(k):
    name = default_name()
    assert name.startswith("train-model-") and len(name) == len("train-model-") + 6
    deadline = time.monotonic() + 30   # the kernel starts the agent in the background
    while not os.path.exists(os.path.join(k.home, "meshes", f"{name}.json")):
        assert time.monotonic() < deadline, "no prewarmed agent"
        time.sleep(0.1)
    r = k.ok("%mesh connect --procs 2", timeout=120)
    assert f"mesh '{name}': 2 procs (gpus=2) started" in r.stdout
    # the widget progress bar was shown while the procs started
    assert any("application/vnd.jupyter.widget-view+json" in d["data"] for d in r.data("display_data"))


def test_restart_reattaches_with_namespaces_and_actors_kept(k):
    k.ok("%%on_mesh\nkept = f'state of rank {rank}'")
    k.ok("from monarch_kernel.actor import Actor, endpoint\n"
         "class Counter(Actor):\n    def __init__(self):\n        self.n = 0\n"
         "    @endpoint\n    def incr(self):\n        self.n += 1\n        return self.n\n"
         "c = mesh.spawn('counter', Counter)\nc.incr.call().get()")
    k.restart()
    r = k.run("%%on_mesh\n1")   # a new kernel: nothing connected until the connect cell runs
    assert r.status == "error" and "run `%mesh connect` first" in r.stderr
    r = k.ok("%mesh connect --procs 2")
    assert "re-attached (namespaces and actors kept)" in r.stdout
    assert "rank 1: 'state of rank 1'" in k.ok("%on_mesh kept").result
    assert k.value("mesh.actor_mesh('counter').incr.call().get().values()") == [2, 2]


def test_disconnect_leaves_it_running_and_connect_reattaches(k):
    r = k.ok("%mesh disconnect")
    assert "keeps running" in r.stdout
    r = k.run("%%on_mesh\nrank")
    assert r.status == "error" and "no mesh is connected" in r.stderr and "%mesh connect" in r.stderr
    assert "alive" in k.ok("%mesh list").result
    assert "re-attached" in k.ok("%mesh connect").stdout
    assert "rank 0: 'state of rank 0'" in k.ok("%on_mesh kept").result


def test_connect_with_another_size_names_the_running_one(k):
    r = k.run("%mesh connect --procs 3")
    assert r.status == "error" and "already runs with gpus=2" in r.stderr and "%mesh stop" in r.stderr


def test_after_a_restart_a_rank_that_dies_fails_its_cell_at_once_though_the_old_kernel_used_the_same_call_ids():
    """A host agent remembers the fanned calls each proc answered lately, so that a reply
    still on its way is not failed by the proc's death. Every controller counts its calls
    from 1, so after a kernel restart those numbers were the new kernel's too: a cell on a
    rank that died waited 5 s for a reply that never comes (found on 8 hosts x 32 procs,
    where every cell goes through the agents; here 4 procs, fanned from 2 members)."""
    h = KernelHarness(env={"MONARCH_KERNEL_FANOUT_MIN": "2"})
    try:
        h.ok("%mesh connect lc-ids --procs 4", timeout=120)
        for i in range(24):   # each answered by every proc through its agent: ids 1..~28 remembered
            h.ok(f"%%on_mesh\nx = {i}")
        h.restart()
        h.ok("%mesh connect lc-ids")
        took = []
        for victim in (1, 2, 3):   # each death the first of its proc (the agent forgets a dead one's calls)
            t0 = time.monotonic()
            r = h.run(f"%%on_mesh --ranks {victim}\nimport os; os.kill(os.getpid(), 9)")
            took.append(time.monotonic() - t0)
            said = r.error["evalue"] if r.status == "error" else r.stdout
            assert f"rank {victim}" in said and "killed by signal SIGKILL" in said, said[-1500:]
        assert max(took) < 2.5, took   # (5.0 s each before the fix, for the ids the old kernel used)
        assert "23" in h.ok("%%on_mesh --ranks 0\nx").result   # (a failure on one rank costs the others nothing)
    finally:
        h.close(stop_meshes=("lc-ids",))


def test_a_mesh_whose_agent_is_gone_says_so_and_connect_starts_a_new_one(k):
    name = default_name()
    with open(os.path.join(k.home, "meshes", f"{name}.json")) as f:
        pid = json.load(f)["agents"][0]["pid"]
    os.kill(pid, signal.SIGKILL)
    _wait_gone(pid)
    r = k.run("%%on_mesh\nrank")
    assert r.status == "error"
    assert f"mesh '{name}' is gone" in r.stderr and f"`%mesh connect {name}`" in r.stderr
    # killed with no word in its log: what is lost, and where its log is
    assert "(its procs and their state are lost); its log: " in r.stderr and "zygote" not in r.stderr, r.stderr
    assert "gone" in k.ok("%mesh list").result.split(name)[1].splitlines()[0]
    r = k.ok("%mesh connect --procs 2", timeout=120)
    assert "started" in r.stdout
    assert "rank 1: 1" in k.ok("%on_mesh rank").result
    assert "rank 1: False" in k.ok("%on_mesh 'kept' in globals()").result


def _wait_gone(pid: int, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while os.path.exists(f"/proc/{pid}") and open(f"/proc/{pid}/stat").read().split()[2] != "Z":
        assert time.monotonic() < deadline, f"pid {pid} still runs"
        time.sleep(0.05)


def test_a_mesh_whose_zygote_was_killed_says_why_it_is_gone(k):
    """The zygote forks and reaps a host's procs, which die with it, and the agent stops: the
    notebook said only "its host agent no longer runs"; now why, from the agent's log."""
    name = default_name()
    with open(os.path.join(k.home, "meshes", f"{name}.json")) as f:
        agent = json.load(f)["agents"][0]["pid"]
    zygote = next(c for c in psutil.Process(agent).children() if "zygote" in " ".join(c.cmdline()))
    threading.Timer(1.0, zygote.kill).start()   # while a cell runs: it fails, with the notebook's advice
    r = k.run("%%on_mesh\nimport time\ntime.sleep(30)", timeout=60)
    text = r.stderr + str(r.error)
    assert r.status == "error" and "host lost" in text and f"`%mesh connect {name}` starts a new mesh" in text, text
    assert "this_host(name)" not in text, text   # (the actor API's advice)
    _wait_gone(agent)
    r = k.run("%%on_mesh\nrank")
    assert r.status == "error" and f"mesh '{name}' is gone" in r.stderr, r.stderr
    assert f"the zygote (pid {zygote.pid}, the process that forks this host's procs) was killed by SIGKILL" \
        in r.stderr, r.stderr
    assert "the 2 procs it forked died with it" in r.stderr and "its log: " in r.stderr, r.stderr
    r = k.ok("%mesh connect --procs 2", timeout=120)   # a new one starts (the fixture stops it)
    assert "rank 1: 1" in k.ok("%on_mesh rank").result


def test_stop_ends_procs_and_agent(k):
    name = default_name()
    assert f"mesh '{name}' stopped" in k.ok("%mesh stop").stdout
    assert not os.path.exists(os.path.join(k.home, "meshes", f"{name}.json"))
    r = k.run("%%on_mesh\n1")
    assert "no mesh is connected" in r.stderr
    r = k.run(f"%mesh stop {name}")
    assert r.status == "error" and f"no mesh named '{name}'" in r.stderr + r.error.get("evalue", "")
    k.ok("%mesh connect --procs 2", timeout=120)   # left for the fixture's teardown to stop


def test_load_ext_in_a_plain_ipython_kernel():
    h = KernelHarness(kernel_name="python3")
    try:
        h.ok("%load_ext monarch_kernel")
        assert "started" in h.ok("%mesh connect plain --procs 2", timeout=120).stdout
        r = h.ok("%%on_mesh\nprint('hi')\nrank * 3")
        assert r.stdout == "[ranks 0-1] hi\n" and "rank 1: 3" in r.result   # identical lines merged
    finally:
        h.close(stop_meshes=("plain",))


def test_a_closed_kernel_leaves_no_home_behind():
    """A kernel test's MONARCH_KERNEL_HOME (its meshes' files, its procs' logs: a flood test
    writes ~180 MB) goes with the kernel, so repeated runs of the suite do not fill /tmp."""
    h = KernelHarness(env={"MONARCH_KERNEL_NO_TORCH": "1"})
    home = h.home
    try:
        h.ok("%mesh connect lifecycle_home --procs 1", timeout=120)
        h.ok("%%on_mesh\nprint('to the log')")
        assert os.listdir(os.path.join(home, "logs")), "the procs' logs are under the kernel's home"
    finally:
        h.close(stop_meshes=("lifecycle_home",))
    assert not os.path.exists(home)
