"""The actor API against real procs: spawning, the endpoint adverbs, slicing, futures,
ValueMesh, context inside endpoints, proc-to-proc calls, ordering and output."""
from __future__ import annotations

import asyncio
import os
import pickle
import sys
import threading
import time

import cloudpickle
import pytest

from monarch_kernel.actor import (
    Actor,
    ActorMesh,
    Extent,
    Future,
    Point,
    ProcMesh,
    ValueMesh,
    context,
    current_rank,
    current_size,
    endpoint,
    this_host,
)
from monarch_kernel.core.runtime import runtime

# Test modules are not importable on the workers: ship this module's classes by value,
# as a notebook cell or a __main__ script would be.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


class Counter(Actor):
    def __init__(self, start: int = 0):
        self.n = start
        self.log: list = []
        self.event: asyncio.Event | None = None

    @endpoint
    def incr(self, by: int = 1) -> int:
        self.n += by
        return self.n

    @endpoint
    def value(self) -> int:
        return self.n

    @endpoint
    def whoami(self) -> dict:
        ctx = context()
        return {"rank": current_rank().rank, "coords": dict(current_rank()), "size": current_size(),
                "pid": os.getpid(), "name": ctx.actor_instance.name,
                "proc_rank": ctx.actor_instance.proc_rank,
                "env_rank": int(os.environ["RANK"])}

    @endpoint
    def sleep_then(self, seconds: float, value):
        time.sleep(seconds)
        return value

    @endpoint
    def staggered(self, unit: float) -> int:
        """Higher ranks answer first."""
        r = current_rank().rank
        time.sleep((current_size()["gpus"] - 1 - r) * unit)
        return r

    @endpoint
    def push(self, i: int) -> None:
        self.log.append(i)

    @endpoint
    def take_log(self) -> list:
        out, self.log = self.log, []
        return out

    @endpoint
    def talk(self, lines: int) -> str:
        r = current_rank().rank
        for i in range(lines):
            print(f"r{r} line {i}")
        print(f"r{r} to stderr", file=sys.stderr)
        print(f"r{r} no newline", end="")
        return "done"

    @endpoint
    def talk_both(self, lines: int) -> str:
        for i in range(lines):
            print(f"out {i}")
            if i % 7 == 0:
                print(f"err {i}", file=sys.stderr)
        return "done"

    @endpoint
    async def async_whoami(self) -> tuple:
        await asyncio.sleep(0.01)
        return (current_rank().rank, threading.current_thread().name)

    @endpoint
    async def wait_for_event(self) -> str:
        self.event = self.event or asyncio.Event()
        await self.event.wait()
        return "released"

    @endpoint
    async def set_event(self) -> bool:
        self.event = self.event or asyncio.Event()
        self.event.set()
        return True

    @endpoint
    def relay(self, other: ActorMesh, x: int) -> list:
        """Call another actor mesh from inside this actor."""
        return other.incr.call(x).get(3).values()

    @endpoint
    async def async_relay(self, other: ActorMesh, x: int) -> list:
        """From an async endpoint, the proc's main thread stays free: the target may live
        on this very proc."""
        return (await other.incr.call(x)).values()

    @endpoint
    def relay_broadcasts(self, other: ActorMesh, n: int) -> None:
        for i in range(n):
            other.push.broadcast(i)


@pytest.fixture(scope="module")
def procs():
    pm = this_host().spawn_procs(per_host={"hosts": 1, "gpus": 2}, name="api")
    yield pm
    pm.stop()


@pytest.fixture(scope="module")
def counters(procs):
    return procs.spawn("counters", Counter, 10)


# ---------------------------------------------------------------- spawning and shape
def test_spawn_procs_with_several_dims(procs):
    assert isinstance(procs, ProcMesh)
    assert procs.sizes == {"hosts": 1, "gpus": 2}
    assert procs.extent == Extent(("hosts", "gpus"), (1, 2))
    assert len(procs) == 2 and procs.size() == 2 and procs.size("gpus") == 2 and procs.size("hosts") == 1
    pids = [r.pid for r in procs.procs()]
    assert len(set(pids)) == 2 and os.getpid() not in pids


def test_init_runs_on_every_rank_with_its_arguments(counters):
    got = counters.value.call().get(30)
    assert isinstance(got, ValueMesh)
    assert got.values() == [10, 10] or min(got.values()) >= 10
    fresh = counters.whoami.call().get(30)
    assert fresh.extent == Extent(("hosts", "gpus"), (1, 2))


def test_context_inside_endpoints(counters, procs):
    got = counters.whoami.call().get(30)
    by_pid = {r.rank: r.pid for r in procs.procs()}
    for p, info in got.items():
        assert info["rank"] == p.rank
        assert info["coords"] == {"hosts": 0, "gpus": p.rank}
        assert info["size"] == {"hosts": 1, "gpus": 2}
        assert info["name"] == "counters"
        assert info["pid"] == by_pid[p.rank] and info["env_rank"] == p.rank == info["proc_rank"]


def test_context_on_the_controller_is_the_client_actor():
    # As in Monarch: the controller is the "client" actor, rank 0 of a one-member mesh.
    assert context().actor_instance.name == "client"
    assert current_rank().rank == 0 and current_size() == {}


def test_call_one_on_a_single_member_slice(counters):
    before = counters.slice(hosts=0, gpus=1).value.call_one().get(30)
    assert counters.slice(hosts=0, gpus=1).incr.call_one(by=5).get(30) == before + 5
    other = counters.slice(hosts=0, gpus=0).value.call_one().get(30)
    assert counters.slice(hosts=0, gpus=0).value.call_one().get(30) == other  # rank 0 untouched


def test_choose_prefers_the_member_without_calls_in_flight(counters):
    busy = counters.slice(hosts=0, gpus=0).sleep_then.call_one(1.0, "slow")
    picked = [counters.whoami.choose().get(30)["rank"] for _ in range(3)]
    assert picked == [1, 1, 1]
    assert busy.get(30) == "slow"
    assert counters.whoami.choose().get(30)["rank"] in (0, 1)


def test_stream_yields_results_as_they_arrive(counters):
    futs = list(counters.staggered.stream(0.8))   # Monarch's shape: a done Future per member
    assert [f.get() for f in futs] == [1, 0]  # rank 1 answers first, and is not held back for rank 0
    assert list(counters.staggered.stream(0.8).values()) == [1, 0]   # or the values directly


def test_broadcast_is_fire_and_forget_and_ordered_with_later_calls(counters):
    counters.take_log.call().get(30)
    for i in range(5):
        assert counters.push.broadcast(i) is None
    assert counters.take_log.call().get(30).values() == [[0, 1, 2, 3, 4]] * 2


def test_messages_from_one_sender_arrive_in_order(counters):
    one = counters.slice(hosts=0, gpus=1)
    futs = [one.push.call_one(i) for i in range(300)]
    for i in range(0, 300, 2):
        one.push.broadcast(1000 + i)
    log = one.take_log.call_one().get(30)
    assert [f.get(30) for f in futs] == [None] * 300
    assert log == list(range(300)) + [1000 + i for i in range(0, 300, 2)]


# ---------------------------------------------------------------- slicing handles
def test_slicing_an_int_drops_the_dim_a_slice_keeps_it(counters, procs):
    g1 = counters.slice(gpus=1)
    assert g1.sizes == {"hosts": 1} and len(g1) == 1
    kept = counters.slice(gpus=slice(1, 2))
    assert kept.sizes == {"hosts": 1, "gpus": 1}
    assert kept.whoami.call().get(30).item(hosts=0, gpus=0)["rank"] == 1
    assert procs.slice(hosts=0).sizes == {"gpus": 2}
    assert procs.slice(hosts=0, gpus=0).sizes == {} and len(procs.slice(hosts=0, gpus=0)) == 1


def test_flatten_rename_size_on_actor_and_proc_meshes(counters, procs):
    flat = counters.flatten("ranks")
    assert flat.sizes == {"ranks": 2} and flat.extent == Extent(("ranks",), (2,))
    assert [v["rank"] for v in flat.whoami.call().get(30).values()] == [0, 1]
    renamed = counters.rename(gpus="devices")
    assert renamed.size("devices") == 2 and renamed.sizes == {"hosts": 1, "devices": 2}
    got = renamed.value.call().get(30)
    assert got.extent.labels == ("hosts", "devices")
    assert procs.flatten("p").sizes == {"p": 2} and procs.rename(hosts="nodes").size("nodes") == 1


def test_spawn_on_a_proc_slice_places_the_actor_there(procs):
    sub = procs.slice(gpus=slice(1, 2))
    am = sub.spawn("only_second", Counter)
    try:
        info = am.whoami.call().get(30)
        assert info.extent == Extent(("hosts", "gpus"), (1, 1))
        only = info.values()[0]
        assert only["rank"] == 0 and only["env_rank"] == 1 and only["pid"] == procs.procs()[1].pid
        assert only["size"] == {"hosts": 1, "gpus": 1}
    finally:
        am.stop()


def test_handles_find_meshes_by_name(procs, counters):
    assert procs.actor_mesh("counters").value.call().get(30) == counters.value.call().get(30)
    assert "counters" in procs.actor_meshes()


# ---------------------------------------------------------------- ValueMesh from a real call
def test_value_mesh_from_a_call(counters):
    got = counters.whoami.call().get(30)
    assert [p.coords for p, _ in got] == [{"hosts": 0, "gpus": 0}, {"hosts": 0, "gpus": 1}]
    assert all(isinstance(p, Point) for p, _ in got.items())
    assert got.item(hosts=0, gpus=1)["rank"] == 1
    assert [v["rank"] for v in got.values()] == [0, 1]
    back = pickle.loads(pickle.dumps(got))
    assert back == got and back.item(hosts=0, gpus=0) == got.item(hosts=0, gpus=0)


# ---------------------------------------------------------------- futures
def test_get_timeout_leaves_the_call_running(counters):
    fut = counters.slice(gpus=0).sleep_then.call_one(1.0, "late")
    assert isinstance(fut, Future)
    with pytest.raises(TimeoutError, match="still running"):
        fut.get(timeout=0.1)
    assert not fut.done()
    assert fut.get(30) == "late" and fut.done()


def test_await_in_a_running_loop_does_not_block_it(counters):
    async def main():
        ticks = 0
        stop = False

        async def ticker():
            nonlocal ticks
            while not stop:
                ticks += 1
                await asyncio.sleep(0.01)

        t = asyncio.ensure_future(ticker())
        got = await counters.sleep_then.call(0.5, "x")
        stop = True
        await t
        one = await counters.slice(gpus=1).value.call_one()
        return got, ticks, one

    got, ticks, one = asyncio.run(main())
    assert got.values() == ["x", "x"]
    assert ticks >= 10  # the loop kept running while the call was in flight
    assert isinstance(one, int)


def test_async_endpoints_run_on_the_procs_event_loop_concurrently(counters):
    got = counters.async_whoami.call().get(30)
    assert [v[0] for v in got.values()] == [0, 1]
    assert all(v[1] != "MainThread" for v in got.values())
    waiting = counters.wait_for_event.call()
    with pytest.raises(TimeoutError):
        waiting.get(0.2)
    assert counters.set_event.call().get(30).values() == [True, True]
    assert waiting.get(30).values() == ["released", "released"]


# ---------------------------------------------------------------- proc to proc
def _count_replies_at_controller(fn):
    """Run ``fn`` while counting the call replies the controller's runtime receives."""
    rt = runtime()
    seen = []
    orig = rt.handlers["r"]

    def spy(msg):
        seen.append(msg[1])
        orig(msg)

    rt.handlers["r"] = spy
    try:
        return fn(), seen
    finally:
        rt.handlers["r"] = orig


def test_an_actor_calls_another_mesh_proc_to_proc(procs, counters):
    """The inner call's replies go to the calling proc; the controller sees only the outer
    reply (counted by wrapping its 'r' handler)."""
    relays = procs.slice(gpus=slice(0, 1)).spawn("relays", Counter)
    target = counters.slice(gpus=slice(1, 2))
    relays.initialized.get(30)   # spawn returns at once: its own reply must not be counted below
    try:
        before = target.value.call().get(30).values()
        got, seen = _count_replies_at_controller(lambda: relays.relay.call_one(target, 7).get(30))
        assert got == [b + 7 for b in before]
        assert len(seen) == 1, f"the controller saw {len(seen)} replies; the inner call should bypass it"
        # an async endpoint can call a mesh that includes its own proc
        before = counters.value.call().get(30).values()
        got, seen = _count_replies_at_controller(lambda: relays.async_relay.call_one(counters, 1).get(30))
        assert got == [b + 1 for b in before] and len(seen) == 1
    finally:
        relays.stop()
    assert counters.value.call().get(30).values() == got


def test_sync_endpoint_can_call_an_actor_on_its_own_proc(procs, counters):
    relays = procs.slice(gpus=slice(0, 1)).spawn("relays_same_proc", Counter)
    try:
        assert relays.relay.call_one(counters.slice(gpus=slice(0, 1)), 1).get(5)
    finally:
        relays.stop()


def test_broadcasts_from_an_actor_arrive_in_order(procs, counters):
    sender = procs.slice(gpus=slice(0, 1)).spawn("sender", Counter)
    try:
        counters.take_log.call().get(30)
        sender.relay_broadcasts.call_one(counters.slice(gpus=1), 200).get(30)
        deadline = time.monotonic() + 10
        log: list = []
        while len(log) < 200 and time.monotonic() < deadline:
            log += counters.slice(gpus=1).take_log.call_one().get(30)
        assert log == list(range(200))
    finally:
        sender.stop()


def test_meshes_and_endpoints_pickle(counters):
    back = cloudpickle.loads(cloudpickle.dumps(counters.slice(gpus=1)))
    assert back.sizes == {"hosts": 1}
    assert back.value.call_one().get(30) == counters.slice(gpus=1).value.call_one().get(30)


# ---------------------------------------------------------------- output
def _output_of(fut_fn) -> list:
    """(rank, stream, text) of each output message the controller got while ``fut_fn()``
    ran (it makes a call and waits for it)."""
    rt = runtime()
    got: list = []
    orig = rt.output
    rt.output = lambda rank, stream, text: got.append((rank, stream, text))
    try:
        fut_fn()
    finally:
        rt.output = orig
    return got


def _talk_both_lines(n: int) -> list:
    """What ``talk_both(n)`` prints, line by line, in the order written."""
    out = []
    for i in range(n):
        out.append(("stdout", f"out {i}"))
        if i % 7 == 0:
            out.append(("stderr", f"err {i}"))
    return out


def test_worker_output_reaches_the_controller_by_rank_in_order(counters):
    got = _output_of(lambda: counters.talk.call(30).get(30))
    for r in (0, 1):
        out = "".join(t for rank, s, t in got if rank == r and s == "stdout")
        err = "".join(t for rank, s, t in got if rank == r and s == "stderr")
        assert out == "".join(f"r{r} line {i}\n" for i in range(30)) + f"r{r} no newline"
        assert err == f"r{r} to stderr\n"
        # line by line: every chunk but a final flush ends at a line boundary
        chunks = [t for rank, s, t in got if rank == r and s == "stdout"]
        assert all(c.endswith("\n") for c in chunks[:-1])


def test_lines_printed_fast_in_a_fanned_call_go_in_a_few_messages_in_the_order_written(counters, monkeypatch):
    """A proc's lines printed within 20 ms of each other in a call fanned through the agent
    travel together (node/output_batch.py): 400 lines in a loop were 400 messages for the
    agent and the controller to carry, one at a time (here 150 for 150; now one each time
    stderr cuts in, every 7 lines); across stdout and stderr they keep their order."""
    monkeypatch.setenv("MONARCH_KERNEL_FANOUT_MIN", "2")   # (2 procs: through their agent)
    got = _output_of(lambda: counters.talk_both.call(150).get(30))
    for r in (0, 1):
        mine = [(s, t) for rank, s, t in got if rank == r]
        assert [(s, line) for s, t in mine for line in t.splitlines()] == _talk_both_lines(150)
        stdout_messages = [t for s, t in mine if s == "stdout"]
        assert len(stdout_messages) <= 40, f"{len(stdout_messages)} messages for 150 lines"


def test_lines_of_a_direct_call_go_at_once_in_the_order_written(counters):
    """A direct call's lines go one message a line from the writing thread's own socket, as
    its reply does (no timer thread's socket to overtake them); interleaved with stderr,
    they arrive in the order written."""
    got = _output_of(lambda: counters.talk_both.call(100).get(30))
    for r in (0, 1):
        mine = [(s, t) for rank, s, t in got if rank == r]
        assert [(s, line) for s, t in mine for line in t.splitlines()] == _talk_both_lines(100)
        assert all(t.count("\n") == 1 for s, t in mine)


def test_a_flood_of_output_is_limited_at_the_proc_and_the_rest_is_counted(counters):
    """Past its burst a proc stops sending lines (they stay in its log file) and says how
    many it kept back, so a flood cannot bury the controller's inbox (monarch_kernel/node/output_limit.py)."""
    t0 = time.monotonic()
    got = _output_of(lambda: counters.talk.call(3000).get(60))
    took = time.monotonic() - t0
    for r in (0, 1):
        sent = sum(t.count("\n") or 1 for rank, s, t in got if rank == r and s in ("stdout", "stderr"))
        kept = [t for rank, s, t in got if rank == r and s == "skipped"]
        assert sent <= 500 + 50 * took + 50, (sent, took)
        assert kept and "lines kept only in rank" in kept[-1] and f"%mesh logs {r}" in kept[-1]
        assert sent + sum(int(t.split()[0]) for t in kept) == 3000 + 2   # + the stderr line and the last chunk


# ---------------------------------------------------------------- a __main__ controller script
def test_main_module_classes_run_on_workers_with_real_tracebacks_and_prefixed_output():
    import json
    import subprocess

    script = os.path.join(os.path.dirname(__file__), "scripts", "main_controller.py")
    out = subprocess.run([sys.executable, script, "20"], capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(script))
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    result = json.loads(next(x for x in lines if x.startswith("RESULT "))[len("RESULT "):])
    assert result["apply"] == [9, 10] and result["hello"] == [20, 20]
    tb = result["traceback"]
    assert result["rank"] == 1
    assert "main_controller.py" in tb and "MARKER-LINE" in tb and "RuntimeError: failing on purpose" in tb
    for r in (0, 1):
        mine = [x for x in lines if x.startswith(f"[rank {r}] ")]
        assert mine == [f"[rank {r}] hello {i} from rank {r}" for i in range(20)]
