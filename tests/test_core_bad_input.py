"""Bad input against a real mesh: each mistake is a clear exception in the caller that
names what was wrong (and how to fix it), and the mesh still works afterwards."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import types

import cloudpickle
import pytest

from monarch_kernel.actor import (
    Actor,
    ActorError,
    MeshGoneError,
    attach,
    endpoint,
    this_host,
)
from monarch_kernel.core.connection import connection_path
from monarch_kernel.core.runtime import runtime

cloudpickle.register_pickle_by_value(sys.modules[__name__])


class Echo(Actor):
    def __init__(self, tag: str = "echo"):
        self.tag = tag

    @endpoint
    def echo(self, x):
        return x

    @endpoint
    def store(self, value, label: str = ""):
        return label

    @endpoint
    def give_lock(self):
        return threading.Lock()

    @endpoint
    def give_foreign(self):
        """An object of a class the controller cannot import."""
        mod = types.ModuleType("only_on_the_worker")
        exec("class Thing:\n    pass\n", mod.__dict__)
        sys.modules["only_on_the_worker"] = mod
        return mod.Thing()

    @endpoint
    def type_name(self, x) -> str:
        return type(x).__name__


class NotAnActor:
    def echo(self, x):
        return x


@pytest.fixture(scope="module")
def procs():
    pm = this_host().spawn_procs(per_host={"gpus": 2}, name="bad-input")
    yield pm
    pm.stop()


@pytest.fixture(scope="module")
def echo(procs):
    return procs.spawn("echo", Echo)


@pytest.fixture(autouse=True)
def mesh_still_works(request):
    """After every bad input here, the mesh answers a normal call."""
    yield
    if "echo" in request.fixturenames:
        am = request.getfixturevalue("echo")
        assert am.echo.call("ok").get(30).values() == ["ok", "ok"]


def test_slice_with_an_unknown_dimension(echo, procs):
    for mesh in (echo, procs):
        with pytest.raises(ValueError, match=r"unknown dimension 'hosts': this mesh's dimensions are gpus"):
            mesh.slice(hosts=0)
        with pytest.raises(ValueError, match=r"unknown dimension 'host'"):
            mesh.size("host")
    with pytest.raises(ValueError, match="unknown dimension 'ranks'"):
        echo.slice(gpus=0).slice(ranks=0)   # the int dropped the dim


def test_slice_with_an_out_of_range_index(echo, procs):
    for mesh in (echo, procs):
        with pytest.raises(ValueError, match=r"gpus=2 is out of range: gpus has size 2 \(valid indices 0..1\)"):
            mesh.slice(gpus=2)
        with pytest.raises(ValueError, match=r"gpus=3:5 starts out of range"):
            mesh.slice(gpus=slice(3, 5))
    with pytest.raises(TypeError, match=r"select with an int or a slice"):
        echo.slice(gpus="0")


def test_call_one_on_a_mesh_of_several(echo):
    with pytest.raises(ValueError, match=r"call_one needs a mesh of exactly 1 member; 'echo' has 2 \(gpus=2\)"
                                         r"\. Slice it first, e.g\. mesh\.slice\(gpus=0\), or use call\(\)"):
        echo.echo.call_one(1)
    assert echo.slice(gpus=1).echo.call_one(1).get(30) == 1


def test_an_endpoint_that_does_not_exist(echo):
    with pytest.raises(AttributeError, match=r"actor mesh 'echo' \(Echo\) has no endpoint 'ecko'; its endpoints "
                                             r"are: echo, give_foreign, give_lock, store, type_name"):
        echo.ecko.call(1)
    with pytest.raises(TypeError, match=r"call an endpoint with an adverb: echo\.call\(\.\.\.\)"):
        echo.echo(1)


def test_wrong_arguments_to_an_endpoint_fail_remotely_with_the_reason(echo):
    with pytest.raises(ActorError, match=r"TypeError: .*echo\(\) takes 2 positional arguments but 3 were given"):
        echo.echo.call(1, 2).get(30)


def test_an_argument_that_cannot_be_pickled_is_named_with_its_type(echo):
    rt = runtime()
    pending_before = rt.calls.pending_count()
    with pytest.raises(TypeError, match=r"echo\.store: argument 'value' \(_thread\.lock\) cannot be sent to the "
                                        r"mesh: it cannot be pickled"):
        echo.store.call(threading.Lock())
    with pytest.raises(TypeError, match=r"argument 'label' \(_thread\.lock\)"):
        echo.store.call(1, label=threading.Lock())
    with pytest.raises(TypeError, match=r"argument 'value' \(_thread\.lock\)"):
        echo.slice(gpus=0).store.call_one(threading.Lock())
    with pytest.raises(TypeError, match=r"argument 'value' \(_thread\.lock\)"):
        echo.store.broadcast(threading.Lock())
    assert rt.calls.pending_count() == pending_before      # nothing left waiting for a reply


def test_an_init_argument_that_cannot_be_pickled(procs, echo):
    with pytest.raises(TypeError, match=r"Echo\.__init__: argument 'tag' \(_thread\.lock\) cannot be sent"):
        procs.spawn("locked", Echo, threading.Lock())


def test_a_result_that_cannot_be_pickled(echo):
    with pytest.raises(ActorError, match=r"the result \(lock\) could not be sent back"):
        echo.slice(gpus=0).give_lock.call_one().get(30)


def test_a_result_the_controller_cannot_unpickle_fails_the_call(echo):
    with pytest.raises(ActorError, match=r"the result could not be unpickled here: ModuleNotFoundError\(\"No "
                                         r"module named 'only_on_the_worker'"):
        echo.give_foreign.call().get(10)
    with pytest.raises(ActorError, match="only_on_the_worker"):
        echo.slice(gpus=0).give_foreign.call_one().get(10)


def _controller_only_thing():
    mod = types.ModuleType("only_on_the_controller")
    exec("class Thing:\n    pass\n", mod.__dict__)
    sys.modules["only_on_the_controller"] = mod
    return mod.Thing()


def test_an_argument_the_worker_cannot_unpickle_fails_the_call(echo):
    """E.g. an object of a local module not (yet) synced to the workers."""
    thing = _controller_only_thing()
    try:
        with pytest.raises(ActorError, match=r"could not be unpickled on this worker: ModuleNotFoundError"
                                             r".*only_on_the_controller"):
            echo.type_name.call(thing).get(3)
        with pytest.raises(ActorError, match="only_on_the_controller"):
            echo.slice(gpus=0).type_name.call_one(thing).get(3)
        echo.slice(gpus=1).type_name.broadcast(thing)      # no caller waits: it surfaces on the next call
        with pytest.raises(ActorError, match="could not be unpickled on this worker"):
            for _ in range(50):
                echo.echo.call(0).get(3)
    finally:
        del sys.modules["only_on_the_controller"]


def test_spawning_something_that_is_not_an_actor(procs, echo):
    for bad in (NotAnActor, Echo(), len, "Echo"):
        with pytest.raises(TypeError, match=r"spawn\(\) needs a subclass of monarch_kernel\.actor\.Actor"):
            procs.spawn("bad", bad)
    with pytest.raises(TypeError, match=r"spawn\(\) takes the actor mesh's name first"):
        procs.spawn(Echo, Echo)


def test_bad_spawn_procs_arguments():
    hm = this_host()
    for bad, msg in (({"gpus": 0}, r"per_host\['gpus'\] must be a positive int, got 0"),
                     ({"gpus": "2"}, r"per_host\['gpus'\] must be a positive int, got '2'"),
                     ({"2gpus": 1}, r"dimension name '2gpus' must be an identifier"),
                     ([("gpus", 2)], r"per_host must be a dict")):
        with pytest.raises((TypeError, ValueError), match=msg):
            hm.spawn_procs(per_host=bad)


def test_using_a_stopped_mesh():
    pm = this_host().spawn_procs(per_host={"gpus": 1}, name="soon-stopped")
    am = pm.spawn("e", Echo)
    other = pm.spawn("f", Echo)
    other.stop()
    with pytest.raises(MeshGoneError, match=r"actor mesh 'f' was stopped"):
        other.echo.call(1)
    assert am.echo.call(1).get(30).values() == [1]     # stopping one actor mesh leaves the others
    pm.stop()
    with pytest.raises(MeshGoneError, match=r"proc mesh 'soon-stopped' was stopped; spawn a new one"):
        am.echo.call(1)
    with pytest.raises(MeshGoneError, match=r"was stopped"):
        pm.spawn("g", Echo)
    with pytest.raises(MeshGoneError, match=r"was stopped"):
        am.slice(gpus=0).echo.call_one(1)


def test_attaching_to_a_name_that_does_not_exist():
    with pytest.raises(MeshGoneError, match=r"no mesh named 'no-such-mesh' on this machine .* start it with "
                                            r"this_host\('no-such-mesh'\)"):
        attach("no-such-mesh")
    with pytest.raises(ValueError, match=r"bad mesh name '\.\./etc'"):
        attach("../etc")


def test_attaching_to_a_mesh_whose_agent_is_gone():
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    dead_pid = int(done.stdout)
    path = connection_path("agent-gone")
    import socket

    path.write_text(json.dumps({"name": "agent-gone", "key": "00" * 32, "persistent": True,
                                "agents": [{"addr": "tcp://127.0.0.1:9", "host": socket.gethostname(),
                                            "pid": dead_pid}]}))
    with pytest.raises(MeshGoneError, match=rf"mesh 'agent-gone' is gone: its agent \(pid {dead_pid}\) no longer "
                                            r"runs\. Start it again with this_host\('agent-gone'\)"):
        attach("agent-gone")
    assert not path.exists()        # the stale file is cleaned up
    with pytest.raises(MeshGoneError, match="no mesh named 'agent-gone'"):
        attach("agent-gone")


def test_using_a_host_mesh_that_was_shut_down():
    hm = this_host("bad-input-shut", lease=30)
    hm.shutdown()
    with pytest.raises(MeshGoneError, match=r"host mesh 'bad-input-shut' was detached or shut down; "
                                            r"attach\('bad-input-shut'\) to use it again"):
        hm.spawn_procs(per_host={"gpus": 1})
    with pytest.raises(MeshGoneError, match="no mesh named 'bad-input-shut'"):
        attach("bad-input-shut")
