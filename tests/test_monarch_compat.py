"""Monarch's actor API and its semantics, against real procs (issue 15, items 1-10).

Written from Monarch's documented behaviour (its docs, examples and tests), not copied:
stop() futures, supervision (BaseException and broadcast failures fail the actor, async
__supervise__, a replaceable unhandled_fault_hook, __cleanup__(exc)), the client as an
actor (this_proc/context on the controller), ports and channels, named controllers, an
actor stopping itself, logging_option, Monarch's signatures, endpoint names that collide
with mesh methods, and arguments that fail to unpickle on the receiving proc.
"""
from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import cloudpickle
import pytest

import monarch_kernel.actor as monarch_actor
from monarch_kernel.actor import (
    Accumulator,
    Actor,
    ActorError,
    ActorMesh,
    Channel,
    Future,
    MeshFailure,
    Port,
    ValueMesh,
    as_endpoint,
    concurrent_endpoint,
    context,
    current_actor_name,
    current_rank,
    endpoint,
    get_or_spawn_controller,
    send,
    this_host,
    this_proc,
)
from monarch_kernel.core.runtime import runtime

cloudpickle.register_pickle_by_value(sys.modules[__name__])


class Worker(Actor):
    def __init__(self, log_dir: str = ""):
        self.log_dir = log_dir
        self.n = 0

    @endpoint
    def bump(self) -> int:
        self.n += 1
        return self.n

    @endpoint
    def value(self) -> int:
        return self.n

    @endpoint
    def rank(self) -> int:
        return current_rank().rank

    @endpoint
    def exit(self) -> None:
        raise SystemExit(3)

    @endpoint
    def boom(self) -> None:
        raise ValueError("boom on purpose")

    @endpoint(explicit_response_port=True)
    def later(self, port: Port[int], x: int) -> None:
        threading.Timer(0.2, lambda: port.send(x * 2)).start()   # answer from another thread

    @endpoint(explicit_response_port=True)
    def forward(self, port: Port, other) -> None:
        other.answer_for.call_one(port).get(30)                  # someone else answers our caller

    @endpoint
    def answer_for(self, port: Port) -> None:
        port.send(f"answered by rank {current_rank().rank}")

    @endpoint
    def who(self) -> str:
        return current_actor_name()

    @endpoint
    def quit(self) -> None:
        context().actor_instance.stop()

    @endpoint
    def give_up(self) -> None:
        context().actor_instance.abort("giving up")

    @endpoint
    def controller_from_an_actor(self) -> int:
        return get_or_spawn_controller("registry", Registry).get(30).add.call_one(1).get(30)

    @endpoint
    def say(self, text: str) -> None:
        print(text)
        logging.getLogger("w").info("info " + text)

    def plain(self, x: int) -> int:
        return x + 1

    def __cleanup__(self, exc):
        if self.log_dir:
            Path(self.log_dir, f"cleanup-{current_rank().rank}").write_text(repr(exc))


class Registry(Actor):
    def __init__(self):
        self.total = 0

    @endpoint
    def add(self, n: int) -> int:
        self.total += n
        return self.total


class Parent(Actor):
    """Spawns a child mesh and supervises it with an async __supervise__."""

    def __init__(self, handle: bool):
        self.handle, self.seen = handle, []

    async def __supervise__(self, failure: MeshFailure) -> bool:
        await asyncio.sleep(0.01)   # awaited, not taken as a truthy coroutine object
        self.seen.append(str(failure))
        return self.handle

    @endpoint
    async def start(self, procs) -> list:
        self.child = procs.spawn("child", Worker)
        return (await self.child.rank.call()).values()

    @endpoint
    async def kill_child(self) -> str:
        try:
            await self.child.slice(gpus=1).exit.call_one()
        except ActorError as e:
            return e.exc_type
        return "no error"

    @endpoint
    async def seen_failures(self) -> list:
        return list(self.seen)


class Grand(Actor):
    """Owns a Parent that declines its child's failure: it reaches here, one level up."""

    def __init__(self):
        self.seen = []

    def __supervise__(self, failure: MeshFailure) -> bool:
        self.seen.append(str(failure))
        return True

    @endpoint
    def start(self, parent_procs, procs) -> list:
        self.parent = parent_procs.spawn("parent", Parent, False)
        return self.parent.start.call_one(procs).get(30)

    @endpoint
    def kill_grandchild(self) -> str:
        return self.parent.kill_child.call_one().get(30)

    @endpoint
    def seen_failures(self) -> list:
        return list(self.seen)


class Streamer(Actor):
    def __init__(self, log_dir: str = ""):
        self.log_dir = log_dir

    @concurrent_endpoint
    async def slow(self, s: float) -> float:
        await asyncio.sleep(s)
        return s

    async def __cleanup__(self, exc):
        await asyncio.sleep(0.05)   # awaited on the proc's loop before the stop completes
        if self.log_dir:
            Path(self.log_dir, f"async-cleanup-{current_rank().rank}").write_text(repr(exc))


@pytest.fixture(scope="module")
def procs():
    pm = this_host().spawn_procs(per_host={"gpus": 2}, name="compat")
    yield pm
    pm.stop()


def _eventually(fn, within: float = 10.0):
    deadline = time.monotonic() + within
    while True:
        try:
            return fn()
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


# ------------------------------------------------------------------ 1. stop() futures
def test_stop_returns_futures_and_runs_cleanup_with_none(procs, tmp_path):
    w = procs.spawn("w", Worker, str(tmp_path))
    fut = w.stop(reason="done here")
    assert isinstance(fut, Future) and fut.get(30) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cleanup-0", "cleanup-1"]
    assert (tmp_path / "cleanup-0").read_text() == "None"
    assert w.stop().get(5) is None   # again: already stopped, still a Future

    pm = this_host().spawn_procs(per_host={"gpus": 1}, name="short")
    assert asyncio.run(_await(pm.stop())) is None   # awaitable as in Monarch's async code
    assert pm.stop().get() is None


async def _await(fut):
    return await fut


# ------------------------------------------------------------------ 2. supervision
def test_a_base_exception_fails_the_actor_and_reaches_the_owners_async_supervise(procs):
    sup_pm = this_host().spawn_procs(per_host={"gpus": 1}, name="parent")
    try:
        parent = sup_pm.spawn("parent", Parent, True)
        assert parent.start.call_one(procs).get(30) == [0, 1]
        assert parent.kill_child.call_one().get(30) == "SystemExit"   # the caller still hears of it
        seen = _eventually(lambda: _nonempty(parent.seen_failures.call_one().get(30)))
        assert len(seen) == 1 and "rank 1" in seen[0] and "SystemExit" in seen[0]
        runtime().raise_unhandled()   # handled by the parent: nothing surfaces at the controller
    finally:
        sup_pm.stop()


def _nonempty(x):
    assert x
    return x


def test_a_declined_failure_goes_up_the_supervision_tree(procs):
    up = this_host().spawn_procs(per_host={"gpus": 1}, name="tree")
    try:
        grand = up.spawn("grand", Grand)
        assert grand.start.call_one(up, procs).get(60) == [0, 1]
        assert grand.kill_grandchild.call_one().get(30) == "SystemExit"
        seen = _eventually(lambda: _nonempty(grand.seen_failures.call_one().get(30)))
        assert len(seen) == 1 and "SystemExit" in seen[0] and "child" in seen[0]
        runtime().raise_unhandled()   # handled by the grandparent: nothing reaches the controller
    finally:
        up.stop()


def test_a_broadcast_raise_fails_the_actor_and_goes_to_a_replaced_unhandled_fault_hook(procs, tmp_path):
    seen: list = []
    monarch_actor.unhandled_fault_hook = seen.append
    try:
        w = procs.spawn("w", Worker, str(tmp_path))
        w.slice(gpus=1).boom.broadcast()
        _eventually(lambda: _nonempty(seen))
        assert isinstance(seen[0], MeshFailure) and "boom on purpose" in str(seen[0])
        assert seen[0].mesh == seen[0].mesh_name == "w" and seen[0].rank == 1
        assert "boom on purpose" in seen[0].report()
        # cleanup got Monarch's argument: the exception
        assert "ValueError('boom on purpose')" in (tmp_path / "cleanup-1").read_text()
        assert w.slice(gpus=0).bump.call_one().get(30) == 1      # rank 0 lives on
        with pytest.raises(ActorError, match="gone from this proc: it failed"):
            w.slice(gpus=1).bump.call_one().get(30)
        runtime().raise_unhandled()   # the replaced hook returned: the failure was dropped
    finally:
        monarch_actor.unhandled_fault_hook = monarch_actor.default_unhandled_fault_hook


def test_by_default_an_unhandled_failure_is_raised_at_the_next_interaction_not_exit(procs):
    w = procs.spawn("w", Worker)
    w.boom.broadcast()
    raised = _eventually(lambda: _raises(lambda: procs.spawn("again", Worker).value.call().get(30)))
    assert isinstance(raised, ActorError) and "boom on purpose" in str(raised)
    assert procs.spawn("after", Worker).value.call().get(30).values() == [0, 0]   # once only


def test_a_failed_spawn_reported_after_the_cell_showed_it_is_not_raised_again():
    """The race CI hit: the notebook's end-of-cell wait showed a failed ``__init__`` and
    consumed it, then the I/O thread's spawn callback, still running, queued the same error,
    and the next cell raised it again."""
    from monarch_kernel.core.errors import MeshFailure, SupervisionError
    from monarch_kernel.core.supervision import deliver_unhandled

    rt = runtime()
    failure = MeshFailure("late-report", 0, "vm", None, "actor failed to start: boom")
    err = SupervisionError(failure, "shown under its cell")
    rt.consume_unhandled(err)          # the cell showed it first ...
    deliver_unhandled(failure, err)    # ... then the I/O thread reports it
    assert not rt.has_unhandled(), rt.unhandled()
    rt.raise_unhandled()               # nothing left to surface


class SlowInit(Actor):
    def __init__(self):
        time.sleep(1.0)

    @endpoint
    def value(self) -> int:
        return 0


def test_a_mesh_stopped_before_its_actors_finished_init_is_not_a_failure(procs):
    """Stopping a proc mesh (or killing a job) while a spawn's __init__ still ran failed that
    spawn with 'the proc mesh was stopped', and the next, unrelated spawn raised it."""
    doomed = this_host().spawn_procs(per_host={"gpus": 1}, name="doomed")
    doomed.spawn("slow", SlowInit)
    doomed.stop().get()
    assert procs.spawn("unrelated", Worker).value.call().get(30).values() == [0, 0]


def _raises(fn):
    try:
        fn()
    except Exception as e:
        return e
    raise AssertionError("did not raise yet")


# ------------------------------------------------------------------ 4. the client is an actor
def test_this_proc_and_context_work_on_the_controller():
    assert context().actor_instance.name == "client" and current_actor_name() == "client"
    counter = this_proc().spawn("counter", Worker)
    assert counter.bump.call_one().get(30) == 1
    assert counter.who.call_one().get(30) == "counter[0]"
    assert this_proc() is this_proc()   # one client proc


# ------------------------------------------------------------------ 5. ports and channels
def test_channel_ports_send_and_explicit_response_ports(procs):
    port, recv = Channel.open()
    port.send(3)
    assert recv.recv().get(5) == 3
    w = procs.spawn("w", Worker)
    send(w.bump, (), {}, port=port)          # results go to the port, nobody waits on a call
    assert sorted([recv.recv().get(30), recv.recv().get(30)]) == [1, 1]
    ranked_port, ranked = Channel.open_ranked()
    send(w.bump, (), {}, port=ranked_port)   # (sender's rank, value)
    assert sorted([ranked.recv().get(30), ranked.recv().get(30)]) == [(0, 2), (1, 2)]
    send(w.bump, (), {}, port=ranked_port, selection="choose")   # one member only
    assert ranked.recv().get(30)[1] == 3
    assert w.slice(gpus=0).later.call_one(21).get(30) == 42         # answered later, from a thread
    assert w.later.call(5).get(30).values() == [10, 10]
    other = w.slice(gpus=1)
    assert w.slice(gpus=0).forward.call_one(other).get(30) == "answered by rank 1"


def test_accumulator_concurrent_endpoint_and_as_endpoint(procs):
    w = procs.spawn("w", Worker)
    w.bump.call().get(30)
    assert Accumulator(w.value, 10, lambda acc, v: acc + v).accumulate().get(30) == 12
    assert as_endpoint(w.plain).call(1).get(30).values() == [2, 2]
    with pytest.raises(AttributeError, match="not an @endpoint; call it with as_endpoint"):
        w.plain.call(1)
    s = procs.spawn("s", Streamer)
    t0 = time.monotonic()
    futs = [s.slice(gpus=0).slow.call_one(0.5) for _ in range(3)]
    assert [f.get(30) for f in futs] == [0.5] * 3 and time.monotonic() - t0 < 1.4   # concurrent
    with pytest.raises(ValueError, match="only wrap async"):
        concurrent_endpoint(lambda self: None)


def test_an_async_cleanup_is_awaited_before_stop_completes(procs, tmp_path):
    s = procs.spawn("s", Streamer, str(tmp_path))
    assert s.stop().get(30) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["async-cleanup-0", "async-cleanup-1"]


# ------------------------------------------------------------------ 6. named controllers, self-stop
def test_get_or_spawn_controller_is_one_actor_from_the_controller_and_from_actors(procs):
    reg = get_or_spawn_controller("registry", Registry).get(30)
    assert reg.add.call_one(5).get(30) == 5
    w = procs.spawn("w", Worker)
    assert sorted(w.controller_from_an_actor.call().get(30).values()) == [6, 7]
    assert get_or_spawn_controller("registry", Registry).get(30).add.call_one(0).get(30) == 7


def test_an_actor_stops_or_aborts_itself(procs, tmp_path):
    w = procs.spawn("w", Worker, str(tmp_path))
    w.slice(gpus=0).quit.call_one().get(30)
    err = _eventually(lambda: _raises(lambda: w.slice(gpus=0).bump.call_one().get(30)))
    assert isinstance(err, ActorError) and "stopped itself" in str(err)
    assert (tmp_path / "cleanup-0").read_text() == "None"
    seen: list = []
    monarch_actor.unhandled_fault_hook = seen.append
    try:
        w.slice(gpus=1).give_up.call_one().get(30)
        _eventually(lambda: _nonempty(seen))
        assert "giving up" in str(seen[0])
    finally:
        monarch_actor.unhandled_fault_hook = monarch_actor.default_unhandled_fault_hook


# ------------------------------------------------------------------ 7. logging_option
def test_logging_option_routes_proc_output(procs):
    got: list = []
    rt = runtime()
    saved = rt.output
    rt.output = lambda rank, stream, text: got.append(text)
    try:
        w = procs.spawn("w", Worker)
        assert asyncio.run(procs.logging_option(stream_to_client=False)) is None
        w.say.call("quiet").get(30)
        time.sleep(0.3)
        assert not any("quiet" in t for t in got)
        procs.logging_option(stream_to_client=True, level=logging.INFO).get()
        w.say.call("loud").get(30)
        _eventually(lambda: _nonempty([t for t in got if "info loud" in t]))
        with pytest.raises(ValueError, match="aggregate_window_sec needs stream_to_client"):
            procs.logging_option(stream_to_client=False, aggregate_window_sec=3)
    finally:
        rt.output = saved
        procs.logging_option(stream_to_client=True, level=logging.WARNING)


# ------------------------------------------------------------------ 8. signatures
def test_monarch_signatures_and_defaults():
    one = this_host().spawn_procs()            # Monarch: one proc per host when per_host is not given
    try:
        assert len(one) == 1 and one.sizes == {}
    finally:
        one.stop()
    assert ActorMesh[Worker] is not None       # generic, as ActorMesh[T] in Monarch
    vm = ValueMesh(monarch_actor.Extent(("hosts", "gpus"), (2, 2)), [0, 1, 2, 3])
    assert vm.slice(hosts=1).values() == [2, 3] and vm.slice(gpus=slice(0, 1)).values() == [0, 2]
    assert vm.flatten("rank").extent == monarch_actor.Extent(("rank",), (4,))
    with pytest.raises(ValueError, match="needs the agents' key"):
        os.environ.pop("MONARCH_KERNEL_KEY", None)
        monarch_actor.attach_to_workers(workers=["tcp://127.0.0.1:1"], name="w", ca="trust_all_connections")
    with pytest.raises(ValueError, match="not an executable file"):
        this_host().with_python_executable("/nonexistent/python")


def test_with_python_executable_runs_procs_with_that_interpreter():
    hm = this_host().with_python_executable(sys.executable)
    try:
        pm = hm.spawn_procs(per_host={"gpus": 1})
        assert pm.spawn("w", Worker).rank.call_one().get(60) == 0
    finally:
        hm.shutdown()


# ------------------------------------------------------------------ 9. endpoint names
class Clash(Actor):
    @endpoint
    def name(self) -> str:
        return "hidden behind ActorMesh.name"


def test_an_endpoint_named_like_a_mesh_method_is_refused_at_spawn(procs):
    with pytest.raises(ValueError, match=r"endpoint\(s\) named 'name'.*ActorMesh.name.*Rename"):
        procs.spawn("c", Clash)


# ------------------------------------------------------------------ 10. unpicklable on arrival
class RefusesToLoad:
    def __getstate__(self):
        return 1

    def __setstate__(self, state):
        raise ValueError("cannot load me here")


def test_an_argument_whose_setstate_raises_on_the_proc_fails_the_call(procs):
    w = procs.spawn("w", Worker)
    t0 = time.monotonic()
    with pytest.raises(ActorError, match="cannot load me here"):
        as_endpoint(w.plain).call(RefusesToLoad()).get(30)
    assert time.monotonic() - t0 < 10
    assert w.bump.call().get(30).values() == [1, 1]   # the actors are fine


# ------------------------------------------------------------------ a Monarch-style program
def test_a_program_written_for_monarch_runs_end_to_end(tmp_path):
    script = Path(__file__).parent / "scripts" / "monarch_style_program.py"
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip().splitlines()[-1] == "ALL DONE", out.stdout


# ------------------------------------------------------------------ 3. a notebook still sees a bad __init__
def test_a_notebook_cell_that_spawns_shows_a_failed_init_under_itself():
    from kernel_harness import KernelHarness

    k = KernelHarness()
    try:
        r = k.run("from monarch_kernel.actor import Actor, endpoint, this_host\n"
                  "class Bad(Actor):\n"
                  "    def __init__(self):\n"
                  "        raise RuntimeError('init fails on purpose')\n"
                  "    @endpoint\n"
                  "    def ok(self):\n"
                  "        return 1\n"
                  "procs = this_host().spawn_procs(per_host={'gpus': 1})\n"
                  "bad = procs.spawn('bad', Bad)\n"
                  "print('spawn returned')", timeout=120)
        assert "spawn returned" in r.stdout
        assert r.error and r.error["ename"] == "SupervisionError", r.outputs
        assert "init fails on purpose" in r.error["evalue"]
        assert k.ok("procs.spawn('good', Actor).initialized.get(30)").error == {}   # not raised again
        assert k.ok("procs.stop()").outputs == []   # a Future for Monarch code, silent as a cell's value
        # spawn_procs() defaults to Monarch's one proc per host; %mesh connect keeps one per core here
        n = os.cpu_count()
        assert f"{n} procs (gpus={n}) started" in k.ok("%mesh connect compat-nb", timeout=120).stdout
    finally:
        k.close(stop_meshes=("compat-nb",))
