"""How the controller waits on a call fanned out through a host agent (issue 11: its CPU per
call). Quick or slow, its batch is read by the waiting thread itself (one wake), and through
a loop of slow calls the I/O thread sleeps (the release timer, not a kick, takes the inbox
back after the last of them; what nobody waits for is still read). The wait hook runs in the
waiting thread and a timeout leaves the call running. While calls flow, they and their
batches stand for heartbeats; the heartbeat ticks have nothing to do between two heartbeats
that were answered, and a same-machine agent's end is seen through
its pidfd; a closed runtime leaves neither that nor its release timer open.
"""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time

import cloudpickle
import pytest

from monarch_kernel.actor import Actor, endpoint, this_host
from monarch_kernel.core import agent_links
from monarch_kernel.core.agent_links import AgentLink, AgentLinks
from monarch_kernel.core.runtime import Runtime, runtime

cloudpickle.register_pickle_by_value(sys.modules[__name__])


class Sleeper(Actor):
    @endpoint
    def nap(self, s: float = 0.0) -> int:
        if s:
            time.sleep(s)
        return 1


@pytest.fixture(autouse=True)
def fan_from_4(monkeypatch):
    monkeypatch.setenv("MONARCH_KERNEL_FANOUT_MIN", "4")


@pytest.fixture(scope="module")
def sleepers():
    pm = this_host().spawn_procs(per_host={"gpus": 4}, name="fanned-waits")
    yield pm.spawn("sleepers", Sleeper)
    pm.stop()


def _timed_call(rt, sleepers, s: float = 0.0) -> tuple[float, list[bool]]:
    """A call to all; (how long its get() waited, for each fan-in batch meanwhile: whether
    the I/O thread read it)."""
    seen: list[bool] = []
    real = rt.handlers["rb"]

    def spy(msg):
        seen.append(rt.is_io_thread())
        real(msg)
    fut = sleepers.nap.call(s)
    rt.on_message("rb", spy, replace=True)
    try:
        t0 = time.monotonic()
        assert fut.get(30).values() == [1] * 4
        return time.monotonic() - t0, seen
    finally:
        rt.on_message("rb", real, replace=True)


@contextlib.contextmanager
def _io_wakes(rt):
    """The I/O thread's wakes meanwhile (a list that grows; it calls _poll_ms once a wake)."""
    inbox = rt._inbox
    wakes: list = []
    real_poll_ms = inbox._poll_ms

    def counted(have, next_tick):
        wakes.append(have)
        return real_poll_ms(have, next_tick)
    inbox._poll_ms = counted
    try:
        yield wakes
    finally:
        del inbox._poll_ms


def test_fanned_calls_quick_or_slow_are_read_by_their_waiter_while_the_io_thread_sleeps(sleepers):
    rt = runtime()
    with _io_wakes(rt) as wakes:
        by_waiter = 0
        for i in range(12):
            _, seen = _timed_call(rt, sleepers, 0.03 if i % 4 else 0.0)   # mostly slow: 30 ms
            by_waiter += seen == [False]
        woken = len(wakes)
    # (a batch may land before the waiter takes the inbox: then the I/O thread reads it. Left to
    # the I/O thread, as after a slow wait before, every slow call's batch woke it: 9 or more.)
    assert by_waiter >= 9, by_waiter
    assert woken <= 6, wakes   # heartbeat ticks (a few a second) and their short polls, not a call's
    # After the last wait the I/O thread takes the inbox back by itself: what nobody waits
    # for (a callback's reply) is read.
    done = threading.Event()
    sleepers.nap.call(0.0).add_done_callback(lambda f: done.set())
    assert done.wait(10)


def test_a_wait_that_times_out_hands_the_inbox_straight_back_to_the_io_thread(sleepers):
    rt = runtime()
    delays = []
    for _ in range(5):
        for _ in range(3):   # a loop of slow calls first: the I/O thread sleeps through them
            sleepers.nap.call(0.02).get(30)
        fut = sleepers.nap.call(0.3)
        with _io_wakes(rt) as wakes:
            with pytest.raises(TimeoutError):
                fut.get(0.02)
            released = time.monotonic()
            while True not in wakes and time.monotonic() - released < 10:
                time.sleep(0.0005)
            delays.append(time.monotonic() - released)
        assert fut.get(30).values() == [1] * 4
    # The I/O thread takes the inbox at once (what comes next, this reply for a kernel's asyncio
    # loop, is read then), not 10 ms later (the release timer, or a short poll after a kick).
    assert sum(d < 0.008 for d in delays) >= 3, delays


def test_the_io_thread_sleeps_through_a_loop_of_5_ms_calls_too(sleepers):
    rt = runtime()
    for _ in range(3):
        sleepers.nap.call(0.004).get(30)
    with _io_wakes(rt) as wakes:
        t0 = time.monotonic()
        for _ in range(20):   # 100 ms or more: its 10 ms short polls woke it 10 times and more
            assert sleepers.nap.call(0.004).get(30).values() == [1] * 4
        took = time.monotonic() - t0
        woken = len(wakes)
    assert woken <= 4 or woken < took / 0.04, (woken, took)   # (a heartbeat tick or two; a slow machine)


def test_while_fanned_calls_flow_no_heartbeat_goes_to_their_agent_and_it_keeps_us(sleepers, monkeypatch):
    rt = runtime()
    link = next(lk for lk in rt.agents.values() if lk.watched and lk.fan_heartbeats)   # (an agent of fan_version 3)
    heartbeats = []
    real = rt.pack_to

    def spy(addr, key, msg):
        if msg[2] == "hb" and addr == link.addr:
            heartbeats.append(time.monotonic())
        return real(addr, key, msg)
    monkeypatch.setattr(rt, "pack_to", spy)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 2.5:   # five heartbeat periods of calls (heartbeats every 0.5 s before)
        assert sleepers.nap.call(0.0).get(30).values() == [1] * 4
    calls_end = time.monotonic()
    assert [t for t in heartbeats if t > t0 + 1.0] == [], heartbeats   # (one may be due as the calls start)
    assert not link.lost and link.unanswered == 0
    time.sleep(1.5)   # no calls: heartbeats again, and answered
    assert [t for t in heartbeats if t > calls_end], heartbeats
    assert not link.lost and sleepers.nap.call(0.0).get(30).values() == [1] * 4   # still attached


def test_a_slow_fanned_wait_runs_the_wait_hook_and_honours_its_timeout(sleepers):
    rt = runtime()
    assert sleepers.nap.call(0.05).get(30).values() == [1] * 4
    ran = []
    old = rt.set_wait_hook((threading.get_ident(), lambda: ran.append(threading.get_ident())))
    try:
        fut = sleepers.nap.call(1.0)
        threading.Timer(0.3, rt.want_wait_hook).start()
        with pytest.raises(TimeoutError, match="still running"):
            fut.get(0.6)
        assert ran == [threading.get_ident()]
        assert fut.get(30).values() == [1] * 4
    finally:
        rt.set_wait_hook(old)
    for _ in range(20):   # each a little longer than the I/O thread's short polls
        assert sleepers.nap.call(0.012).get(10).values() == [1] * 4


def test_no_heartbeat_tick_between_two_answered_heartbeats():
    links = AgentLinks.__new__(AgentLinks)
    a, b = (AgentLink.__new__(AgentLink) for _ in range(2))
    for link, sent in ((a, 100.0), (b, 100.2)):
        link.watched, link.lost, link.unanswered, link.last_hb_sent = True, False, 0, sent
    links.links = {"a": a, "b": b}
    assert links.answered_until() == 100.0 + agent_links.HEARTBEAT_S   # the first heartbeat due
    b.unanswered = 1   # one has not answered: silence is looked at every half period, as before
    assert links.answered_until() == 0.0
    b.unanswered, b.lost = 0, True
    assert links.answered_until() == 0.0
    links.links = {}
    assert links.answered_until() == 0.0


def test_a_same_machine_agent_that_ended_is_seen_through_its_pidfd_zombie_or_not():
    link = AgentLink.__new__(AgentLink)
    link._pidfd = None
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        link.watch_pid(child.pid)
        assert link._pidfd is not None and not link.exited()
        child.kill()
        deadline = time.monotonic() + 10
        while not link.exited() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert link.exited()   # a zombie (not reaped yet) counts as ended
    finally:
        child.kill()
        child.wait()
        link.close_pid()
    assert link._pidfd is None


def _anon_fds(kind: str) -> int:
    """This process's open fds of one anonymous kind ("pidfd", "timerfd")."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}") == f"anon_inode:[{kind}]"
        except OSError:
            pass
    return n


def _pidfds() -> int:
    return _anon_fds("pidfd")


def test_a_closed_runtime_leaves_no_pidfd_of_its_agents_behind():
    before = _pidfds()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        for _ in range(3):   # kernels and tests make several runtimes in one process
            rt = Runtime()
            try:
                port = socket.socket()
                port.bind(("127.0.0.1", 0))
                addr = f"tcp://127.0.0.1:{port.getsockname()[1]}"
                port.close()
                rt.watch_agent(addr, b"k" * 32, child.pid)
                watched = threading.Event()
                rt.call_in_io(watched.set)   # (after the watch: the I/O thread runs them in order)
                assert watched.wait(10)
                assert _pidfds() == before + 1
            finally:
                rt.close()
            assert _pidfds() == before
    finally:
        child.kill()
        child.wait()


def _timerfds() -> int:
    return _anon_fds("timerfd")


def test_a_closed_runtime_leaves_no_release_timer_open():
    before = _timerfds()
    for _ in range(3):
        rt = Runtime()
        try:
            assert _timerfds() == before + 1
        finally:
            rt.close()
        assert _timerfds() == before
