"""Hosts forming a tree (issue 11, section 2): past MONARCH_KERNEL_FANOUT_TREE_WIDTH hosts,
the controller sends a call to a few relay agents, which forward it to their child agents,
and the replies come back up merged. Three real host agents on loopback, width 1 so they
form a chain A -> B -> C (every hop of a deep tree, with few procs): a call to all 6 ranks
is one send from the controller, values, tensors and output come back; then the middle
relay B is frozen and killed with calls in flight: its own ranks fail naming its host, and
C's replies that were stuck in B, C's later ones, and a call B never forwarded all still
arrive (the controller resends a lost relay's part to its children; each child sends again
what it had sent up).
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time

import cloudpickle
import pytest
import torch

from monarch_kernel.actor import Actor, ActorError, SupervisionError, attach_to_workers, current_rank, endpoint
from monarch_kernel.core.connection import new_key
from monarch_kernel.core.runtime import runtime
from monarch_kernel.launch.local import start_local_agent
from monarch_kernel.node.fanout import REPLIES_WAIT_S
from monarch_kernel.node.fantree import members

cloudpickle.register_pickle_by_value(sys.modules[__name__])


class Member(Actor):
    @endpoint
    def say(self, i: int) -> int:
        print(f"tree line {i} from rank {current_rank().rank}")
        return i * 10 + current_rank().rank

    @endpoint
    def ones(self, n: int):
        return torch.ones(n) * current_rank().rank

    @endpoint
    def nothing(self) -> None:
        return None

    @endpoint
    def maybe(self, bad: int):
        r = current_rank().rank
        if r == bad:
            raise ValueError(f"rank {r} refuses")
        return None if r % 2 else r

    @endpoint
    def nap(self, seconds: list) -> int:
        time.sleep(seconds[current_rank().rank])
        return current_rank().rank



def _shut_down(hm, agents) -> None:
    """Stop the mesh, and wait for the agents this test started (kill one that lingers)."""
    hm.shutdown()
    for _, p in agents:
        try:
            p.wait(10)
        except Exception:
            p.kill()
            p.wait(10)

@pytest.fixture(scope="module")
def chain():
    mp = pytest.MonkeyPatch()
    mp.setenv("MONARCH_KERNEL_FANOUT_MIN", "2")          # 2 procs a host go through its agent
    mp.setenv("MONARCH_KERNEL_FANOUT_TREE_WIDTH", "1")   # one agent under each sender: A -> B -> C
    key = new_key()
    agents = [start_local_agent(key, name=f"tree-{c}", persistent=False, lease=120) for c in "abc"]
    hm = attach_to_workers([a["addr"] for a, _ in agents], key, name="tree-test")
    try:
        pm = hm.spawn_procs(per_host={"gpus": 2}, name="chained")
        yield pm.spawn("members", Member), [p for _, p in agents]
    finally:
        _shut_down(hm, agents)
        mp.undo()


def test_a_call_to_3_hosts_in_a_chain_is_one_send_and_every_rank_answers(chain, monkeypatch, capfd):
    members, _ = chain
    rt = runtime()
    sends: list[str] = []
    real = rt.send_frames
    monkeypatch.setattr(rt, "send_frames", lambda addr, frames: (sends.append(addr), real(addr, frames))[1])
    capfd.readouterr()
    assert members.say.call(3).get(30).values() == [30 + r for r in range(6)]
    out = capfd.readouterr().out   # every rank's line came up the tree before the reply
    for r in range(6):
        assert f"tree line 3 from rank {r}" in out, out
    assert len(sends) == 1 and sends[0] not in {r.work for r in members._state.proc_state.procs}
    got = members.ones.call(1000).get(30).values()   # values' buffers merged opaque at each relay
    assert [float(t[0]) for t in got] == [float(r) for r in range(6)] and got[5].shape == (1000,)
    members.say.broadcast(4)
    assert len(sends) == 3
    # MONARCH_KERNEL_FANOUT_MIN counts the members of a send, not of a host: 6 members on 3
    # hosts of 2 go through the 3 agents (no tree: width 0); a 4-member slice goes direct.
    monkeypatch.setenv("MONARCH_KERNEL_FANOUT_MIN", "6")
    monkeypatch.setenv("MONARCH_KERNEL_FANOUT_TREE_WIDTH", "0")
    del sends[:]
    assert members.say.call(7).get(30).values() == [70 + r for r in range(6)]
    assert len(sends) == 3
    assert members.slice(hosts=slice(0, 2)).say.call(8).get(30).values() == [80 + r for r in range(4)]
    assert len(sends) == 7


def test_a_relay_sends_a_complete_batch_up_at_once_not_after_its_hold():
    """Each relay counts what its subtree will send up, keys given as one NUL-joined string
    (fan_version 2) as well as a list; a wrong count (the string's characters) kept every
    complete batch at every relay for REPLIES_WAIT_S: a call through a chain of relays took
    ~0.1 s a level instead of milliseconds."""
    tree = (("a",), "k1\0k2", [(("b",), "k3\0k4\0k5", [(("c",), ["k6"], [])]), (("d",), "", [])])
    assert members(tree) == 6


def test_a_call_through_two_levels_of_relays_is_not_held_at_them(chain):
    member_mesh, _ = chain
    took = []
    for _ in range(10):
        t0 = time.monotonic()
        assert member_mesh.nothing.call().get(30).values() == [None] * 6
        took.append(time.monotonic() - t0)
    took.sort()
    assert took[5] < REPLIES_WAIT_S, f"a call through the chain A -> B -> C took {took[5]:.3f} s (p50)"


def test_runs_of_none_replies_values_and_errors_are_recorded_per_member(chain):
    """The agents send a call's replies as columnar runs; runs of None take a short path."""
    members, _ = chain
    rt = runtime()
    for _ in range(3):
        assert members.nothing.call().get(30).values() == [None] * 6
    with pytest.raises(ActorError, match="rank 3 refuses") as e:
        members.maybe.call(3).get(30)
    got = e.value.results.values()
    assert [got[r] for r in (0, 1, 2, 4, 5)] == [0, None, 2, 4, None] and isinstance(got[3], ActorError)
    keys = [r.key for r in members._state.proc_state.procs]
    assert [rt.calls.outstanding[k] for k in keys] == [0] * 6   # choose() sees them all idle
    assert members.say.choose(2).get(30) in {20 + r for r in range(6)}


def test_each_host_summarises_its_members_and_the_relays_pass_that_up_unopened(chain, monkeypatch):
    """A call answered alike comes back as one summary a host (named by its first member's
    key), through two relays: the controller reads no key per member, and marks each host's
    members answered exactly."""
    from monarch_kernel.core import fanout

    members, _ = chain
    items: list = []
    real = fanout._on_batch
    monkeypatch.setattr(fanout, "_on_batch", lambda rt, msg, resent=False: (items.extend(msg[1]),
                                                                           real(rt, msg, resent))[1])
    keys = [r.key for r in members._state.proc_state.procs]
    assert members.nothing.call().get(30).values() == [None] * 6
    assert {it[0] for it in items} == {"ra"}, items
    assert {it[2] for it in items} == {keys[0], keys[2], keys[4]}
    assert sum(it[3].count(1) for it in items) == 6
    del items[:]
    with pytest.raises(ActorError, match="rank 4 refuses") as e:   # C's error, up two relays
        members.maybe.call(4).get(30)
    got = e.value.results.values()
    assert [got[r] for r in (0, 1, 2, 3, 5)] == [0, None, 2, None, None] and isinstance(got[4], ActorError)
    assert {it[2] for it in items if it[0] == "ra"} == {keys[0], keys[2]}   # A, B: summaries; C: by key


def test_a_relay_killed_mid_call_fails_only_its_ranks_and_its_subtree_still_answers(chain):
    members, (a, b, c) = chain
    rt = runtime()
    naps = [0.2, 0.2, 30.0, 30.0, 0.5, 2.0]   # B's ranks (2, 3) are killed while they nap
    first = members.nap.call(naps)
    p1 = rt.pending_of(first)
    time.sleep(0.3)                  # the call is down the chain; C's rank 4 answers at 0.5 s ...
    os.kill(b.pid, signal.SIGSTOP)   # ... into B, frozen: it stays there
    second = members.nap.call([0.0] * 6)   # B never forwards this one to C
    p2 = rt.pending_of(second)
    time.sleep(0.7)
    assert p1.answered[4] == 0 and p2.answered[4] == 0
    t0 = time.monotonic()
    os.kill(b.pid, signal.SIGKILL)
    with pytest.raises(SupervisionError, match="rank 2.*host lost"):
        first.get(10)
    with pytest.raises(SupervisionError, match="host lost"):
        second.get(10)
    deadline = t0 + 5.0   # the 5 s bound of a lost host
    while (sum(p1.answered) < 6 or sum(p2.answered) < 6) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [p1.results[r] for r in (0, 1, 4, 5)] == [0, 1, 4, 5], p1.results
    assert [p2.results[r] for r in (0, 1, 4, 5)] == [0, 1, 4, 5], p2.results
    for p in (p1, p2):
        assert all("host lost" in str(p.results[r]) for r in (2, 3))
    # The survivors keep working: A and C, now both under the controller.
    assert members.slice(hosts=0).say.call(5).get(30).values() == [50, 51]
    assert members.slice(hosts=2).say.call(6).get(30).values() == [64, 65]


class Leaver(Actor):
    @endpoint
    def answer_then_exit(self, who: int, after: float = 0.0) -> int:
        time.sleep(after)
        r = current_rank().rank
        if r == who:   # exits once its reply has left (the reply is sent when this returns)
            threading.Timer(0.3, os._exit, (3,)).start()
        return r


def test_a_proc_that_replies_then_dies_keeps_its_reply_when_the_death_overtakes_it():
    """Its reply goes up through a relay, its death straight to the controller: the death
    arrives first. The agent names the calls it had answered, and those wait for the reply
    instead of failing the member (a death after a reply changes nothing)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("MONARCH_KERNEL_FANOUT_MIN", "2")
    mp.setenv("MONARCH_KERNEL_FANOUT_TREE_WIDTH", "1")   # A -> C
    key = new_key()
    agents = [start_local_agent(key, name=f"tree-late-{c}", persistent=False, lease=120) for c in "ac"]
    hm = attach_to_workers([a["addr"] for a, _ in agents], key, name="tree-late")
    relay = agents[0][1]
    try:
        m = hm.spawn_procs(per_host={"gpus": 2}, name="late").spawn("leavers", Leaver)
        assert m.answer_then_exit.call(-1).get(30).values() == [0, 1, 2, 3]
        fut = m.answer_then_exit.call(3, 0.6)   # rank 3 (on C) answers at 0.6 s, exits at 0.9 s
        time.sleep(0.2)                         # the call is down to C's procs ...
        os.kill(relay.pid, signal.SIGSTOP)      # ... and A, frozen, holds what C sends up
        try:
            victim = m._state.proc_state.procs[3].key
            deadline = time.monotonic() + 2.5   # its death reaches the controller, its reply cannot
            while victim not in runtime().calls.dead and time.monotonic() < deadline:
                time.sleep(0.05)
            assert victim in runtime().calls.dead and not fut.done()
        finally:
            os.kill(relay.pid, signal.SIGCONT)
        assert fut.get(30).values() == [0, 1, 2, 3]   # its reply counted: not failed by its death
        with pytest.raises(SupervisionError, match="rank 3"):
            m.answer_then_exit.call(-1).get(30)       # and it is dead now

        # Its reply lost for good (the relay and its own host both gone): the member fails
        # after all, within LATE_REPLY_S (5 s), rather than the call waiting forever.
        pair = m.slice(gpus=0)                        # ranks 0 (on A) and 2 (on C)
        fut = pair.answer_then_exit.call(2, 0.6)
        pending = runtime().pending_of(fut)
        time.sleep(0.2)
        os.kill(relay.pid, signal.SIGSTOP)
        victim = m._state.proc_state.procs[2].key
        deadline = time.monotonic() + 2.5
        while victim not in runtime().calls.dead and time.monotonic() < deadline:
            time.sleep(0.05)
        assert victim in runtime().calls.dead and not pending.answered[1]
        t0 = time.monotonic()
        os.kill(agents[1][1].pid, signal.SIGKILL)     # C: what it kept to send again dies with it
        os.kill(relay.pid, signal.SIGKILL)            # A, with rank 2's reply inside
        while not pending.answered[1] and time.monotonic() - t0 < 10:
            time.sleep(0.05)
        assert pending.answered[1] and "rank 2" in str(pending.results[1]), pending.results
        assert time.monotonic() - t0 < 8.0
    finally:
        _shut_down(hm, agents)
        mp.undo()


def test_an_agent_summarises_only_an_exact_set_of_its_members_and_keeps_output_in_place():
    """node/fantree.summarise on batches as an agent holds them (runs still lists): output
    keeps its place before the summary; a key it was not sent, a member twice, five values,
    an error or a tensor leave the replies key by key, and the call's kept keys are dropped
    then (they are not held for later batches that will not use them)."""
    from monarch_kernel.core import wire
    from monarch_kernel.node.fantree import summarise

    none, one = wire.dumps(None)[0], wire.dumps(1)[0]
    keys = ["h.1", "h.2", "h.3"]

    def run(cid, ks, headers, oks=None, counts=None):
        return ["rc", cid, list(ks), oks or [True] * len(ks), list(headers), counts or [0] * len(ks)]

    out = ("out", "line")
    own = {("c", 1): [keys, None, 3]}
    items = [out, run(1, ["h.2"], [none]), out, run(1, ["h.1", "h.3"], [one, none])]
    summarise(items, own, "c")
    assert items == [out, out, ("ra", 1, "h.1", b"\x00\x01\x01", none), ("ra", 1, "h.1", b"\x01\x00\x00", one)]
    assert own == {}   # every member of the call here answered: nothing kept
    for bad in (run(2, ["h.1", "x.9"], [none, none]), run(2, ["h.1", "h.1"], [none, none]),
                run(2, ["h.1", "h.2"], [none, none], oks=[True, False]),
                run(2, ["h.1", "h.2"], [none, none], counts=[0, 1])):
        own = {("c", 2): [keys, None, 3]}
        items = [bad]
        summarise(items, own, "c")
        assert items == [bad] and own == {}, bad
    five = [wire.dumps(v)[0] for v in range(5)]
    own = {("c", 3): [[f"h.{i}" for i in range(5)], None, 5]}
    items = [run(3, [f"h.{i}" for i in range(5)], five)]
    summarise(items, own, "c")
    assert items[0][0] == "rc" and own == {}
    own = {("c", 4): [keys, None, 3]}   # part of a call: summarised, the rest still expected
    items = [run(4, ["h.3"], [none])]
    summarise(items, own, "c")
    assert items == [("ra", 4, "h.1", b"\x00\x00\x01", none)] and own[("c", 4)][2] == 2
