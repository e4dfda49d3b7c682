"""Preloading modules in each host's zygote (HostMesh.preload, MONARCH_KERNEL_PRELOAD,
`%mesh connect --preload`): procs forked after start with them loaded, once a host rather
than once a rank; a module that cannot load is named with its host, and the mesh goes on."""
from __future__ import annotations

import os
import signal
import sys
import time
import uuid

import cloudpickle
import pytest
from kernel_harness import KernelHarness

from monarch_kernel.actor import Actor, endpoint, this_host
from monarch_kernel.job import ProcessJob

cloudpickle.register_pickle_by_value(sys.modules[__name__])

# A module nothing of the runtime imports (checked below: a proc without the preload lacks it).
MODULE = "email.mime.text"


class Loaded(Actor):
    @endpoint
    def has(self, module: str) -> bool:
        return module in sys.modules


def loaded_in(procs, module: str = MODULE) -> list[bool]:
    return list(procs.spawn("loaded", Loaded).has.call(module).get(60).values())


def test_procs_spawned_after_a_preload_have_its_modules_and_a_bad_module_is_named_with_its_host():
    host = this_host()
    try:
        before = host.spawn_procs(per_host={"gpus": 2}, name="before")
        assert loaded_in(before) == [False, False]   # (so the check below can fail)

        took = host.preload(MODULE)
        assert list(took) == [host.hosts[0]] and took[host.hosts[0]] >= 0
        assert loaded_in(host.spawn_procs(per_host={"gpus": 2}, name="after")) == [True, True]
        assert loaded_in(before) == [False, False]   # procs already running: on first use, as before

        with pytest.raises(ValueError, match=rf"no_such_module_xyz on host {host.hosts[0]}: ModuleNotFoundError"):
            host.preload("wave", "no_such_module_xyz")
        with pytest.raises(ValueError, match="'os; rm -rf' is not a module name"):
            host.preload("os; rm -rf")   # never sent: a preload imports names, it runs no code
        third = host.spawn_procs(per_host={"gpus": 1}, name="third")   # the mesh goes on
        assert loaded_in(third, "wave") == [True] and loaded_in(third, MODULE) == [True]
    finally:
        host.shutdown()


def test_the_environment_preloads_as_agents_start_and_a_respawned_proc_has_it_too():
    job = ProcessJob(meshes={"hosts": 2}, env={"MONARCH_KERNEL_PRELOAD": f"{MODULE},wave"})
    try:
        procs = job.state().hosts.spawn_procs(per_host={"gpus": 1})
        assert loaded_in(procs) == [True, True] and loaded_in(procs, "wave") == [True, True]
        victim = procs.procs()[1].pid
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while procs.dead_ranks() != [1] and time.monotonic() < deadline:
            time.sleep(0.05)
        procs.respawn()
        assert procs.procs()[1].pid != victim and loaded_in(procs) == [True, True]
    finally:
        job.kill()


def test_a_module_synced_to_the_host_can_be_preloaded(tmp_path, monkeypatch):
    """`%mesh sync` (or `--env`) puts code on the hosts that is not installed there: the
    procs import it from the synced folders, and so does a preload (it was 'No module')."""
    host = this_host()
    try:
        first = host.spawn_procs(per_host={"gpus": 1}, name="first")   # (the agent's cwd: not the workspace)
        ws = tmp_path / "ws"
        ws.mkdir()
        monkeypatch.chdir(ws)
        name = f"m_preload_{uuid.uuid4().hex[:8]}"
        (ws / f"{name}.py").write_text("VALUE = 7\n")
        first.sync_workspace()
        host.preload(name)
        assert loaded_in(host.spawn_procs(per_host={"gpus": 1}, name="second"), name) == [True]
    finally:
        host.shutdown()


def test_connect_preload_in_a_notebook_loads_the_modules_on_every_rank_and_says_so():
    # the kernel's agent, started ahead of `%mesh connect`, takes the preload too
    h = KernelHarness(prewarm=True, env={"MONARCH_KERNEL_DEFAULT_MESH": "kt-preload"})
    try:
        r = h.ok("%mesh connect --procs 2 --preload email.mime.text", timeout=120)
        assert "preloaded email.mime.text on 1 host in" in r.stdout, r.stdout
        r = h.ok(f"%%on_mesh\nimport sys\n{MODULE!r} in sys.modules")
        assert r.result.count("True") == 2 and "False" not in r.result, r.result
        # set in the notebook after its agent was started ahead: `%mesh connect` asks for it
        h.ok("%env MONARCH_KERNEL_PRELOAD=wave")
        r = h.ok("%mesh connect")
        assert "preloaded wave on 1 host in" in r.stdout, r.stdout
        bad = h.run("%mesh connect --preload numpy,no_such_module_xyz")
        said = bad.stderr + bad.error.get("evalue", "")
        assert "no_such_module_xyz on host" in said and "numpy" not in said, (said, bad.outputs)
        assert h.ok("%%on_mesh\nrank").result.count("\n") >= 1   # the mesh goes on
    finally:
        h.close(stop_meshes=("kt-preload",))
