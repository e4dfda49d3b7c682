"""The host agent's fan path in one process: its FanRelay and fan links over real unix
sockets (socketpairs standing for the procs' ends), so each test can see exactly which
proc got a call and which batch went up, without 256 processes.

What they pin (issue 11, the agent's CPU per call to all): the agent keeps, per member
list, where a fanned call goes (node/fanout.py ``_members_of``) and reads a run of alike
replies in bulk (node/fanlink.py ``AgentLinks.poll``); neither may change what a proc gets
or what the controller is told.
"""
from __future__ import annotations

import os
import pickle
import signal
import socket
import time
import types

import pytest
import zmq

from monarch_kernel.core import wire
from monarch_kernel.core.runtime import host_id
from monarch_kernel.node import fanlink, fanout
from monarch_kernel.node.agent import Proc

_NONE = pickle.dumps(None, 5)


class Host:
    """A FanRelay with ``n`` linked procs (their ends: ``peers``) and a controller inbox."""

    def __init__(self, tmp_path, n: int):
        self.ctx = zmq.Context()
        self.key = os.urandom(32)
        self.keyring = wire.Keyring()
        self.keyring.add(self.key)
        self.agent = types.SimpleNamespace(ctx=self.ctx, key=self.key, bind_host="127.0.0.1",
                                           keyring=self.keyring, procs={}, proc_changes=lambda: Proc.changes,
                                           controller_addr=None, controller_seen=0.0)
        self.relay = fanout.FanRelay(self.agent)
        self.links = self.relay.links
        self.addr = f"ipc://{tmp_path}/controller"
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.bind(self.addr)
        self.contact = [self.addr, self.addr, host_id()]
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.connect(self.relay.fan_ipc)
        self.keys, self.peers = [], []
        for i in range(n):
            a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            a.setblocking(False)
            b.setblocking(False)
            c = fanlink._Conn(a, 0)
            c.key = f"agent.{i}"
            self.links.conns[c.fd] = c
            self.links.by_key[c.key] = c
            self.links.changes += 1
            self.links.ep.register(c.fd, fanlink._EPOLLIN)
            p = Proc(c.key, "mesh", "m", i)
            p.ref, p.state = types.SimpleNamespace(work_ipc="", work=""), "alive"
            self.agent.procs[c.key] = p
            self.keys.append(c.key)
            self.peers.append(b)

    def fan(self, call_id: int, keys=None, contact=None, joined: bool = True) -> None:
        """The controller's fanned call to ``keys`` (all by default), read by the agent; the
        keys NUL-joined as for an agent of fan_version 2, or a list as before."""
        keys = self.keys if keys is None else keys
        env = ("fan", "\0".join(keys) if joined else list(keys), contact or self.contact, call_id,
               pickle.dumps(("call", call_id), 5), [], [], None, 0, True)
        self.push.send_multipart(self.keyring.sign(self.key, wire.dumps(env), wire.dest_id(self.relay.fan_ipc)))
        assert self.relay.fan_in.poll(5000)
        self.relay.on_readable(self.relay.fan_in)

    def got_call(self, i: int) -> bool:
        try:
            return bool(self.peers[i].recv(65536))   # b"": the agent closed its link
        except BlockingIOError:
            return False

    def reply(self, i: int, call_id: int, ok: bool = True, header: bytes = _NONE) -> None:
        d = self.addr.encode()
        self.peers[i].send(b"r" + fanlink._pack_meta(call_id, ok, len(d)) + d + header)

    def output(self, i: int, call_id: int, text: str) -> None:
        d = self.addr.encode()
        self.peers[i].send(b"o" + fanlink._pack_meta(call_id, True, len(d)) + d + pickle.dumps(("out", text)))

    def read(self) -> None:
        self.relay.on_readable(self.links.fileno())

    def batches(self) -> list:
        out = []
        while self.inbox.poll(200):
            out.append(self.keyring.open(self.inbox.recv_multipart(), "controller"))
        return out

    def close(self) -> None:
        for b in self.peers:
            b.close()
        for s in (self.inbox, self.push):
            s.close(0)
        self.relay.close()
        self.ctx.term()


@pytest.fixture
def host(tmp_path):
    h = Host(tmp_path, 6)
    h.keyring.accept("controller", wire.dest_id(h.addr))
    yield h
    h.close()


def test_a_fanned_call_skips_a_proc_that_stopped_or_died_since_the_same_members_last_call(host):
    host.fan(1)
    assert all(host.got_call(i) for i in range(6))
    for i in range(6):
        host.reply(i, 1)
    host.read()
    (batch,) = host.batches()
    assert batch[1][0][:2] == ("ra", 1) and batch[1][0][3] == b"\x01" * 6   # one summary: all six
    host.agent.procs["agent.2"].state = "stopping"       # the agent stops it
    host.agent.procs["agent.4"].state = "dead"           # it died: its link is read and closed
    host.relay.forget_proc(host.agent.procs["agent.4"])
    host.fan(2)                                          # the same member list as call 1
    assert [host.got_call(i) for i in range(6)] == [True, True, False, True, False, True]
    for i in (0, 1, 3, 5):
        host.reply(i, 2)
    host.read()
    (batch,) = host.batches()   # complete with the four it was sent to: it goes at once
    assert batch[1][0][:2] == ("ra", 2) and batch[1][0][3] == b"\x01\x01\x00\x01\x00\x01"


def test_replies_read_in_bulk_keep_each_procs_order_and_split_at_another_call_an_error_or_output(host):
    host.fan(7)
    host.fan(8, host.keys[:3])
    for i in range(6):
        host.got_call(i)
        host.got_call(i)
    host.reply(0, 7)
    host.reply(1, 7)
    host.output(2, 7, "two says hi")
    host.reply(2, 7)
    host.reply(3, 7, ok=False, header=pickle.dumps(ValueError("three failed")))
    host.reply(4, 7, header=pickle.dumps(4))
    host.reply(5, 7)
    for i in range(3):
        host.reply(i, 8)
    host.read()
    items = [it for b in host.batches() for it in b[1]]
    out = [it for it in items if it[0] == "out"]
    assert out == [("out", "two says hi")]
    summaries = [it for it in items if it[0] == "ra"]
    assert [(it[1], it[3]) for it in summaries] == [(8, b"\x01\x01\x01")]   # call 8: all alike
    runs = [it for it in items if it[0] == "rc"]
    assert {it[1] for it in runs} == {7}   # call 7 key by key (an error, a value): its runs
    got = {}
    for _, _, keys, oks, headers, _counts in runs:
        for j, key in enumerate(keys):
            assert key not in got   # each member's reply once
            got[key] = (True if oks is None else oks[j], None if headers is None else pickle.loads(headers[j]))
    assert sorted(got) == host.keys
    assert got["agent.0"] == (True, None) and got["agent.4"] == (True, 4)
    assert got["agent.3"][0] is False and isinstance(got["agent.3"][1], ValueError)
    at = {key: n for n, it in enumerate(items) if it[0] == "rc" for key in it[2]}
    assert items.index(out[0]) < at["agent.2"]   # rank 2's output before its reply


def test_a_fanned_call_from_the_attached_controller_counts_as_its_heartbeat(host):
    """fan_version 3: a controller that only sends calls for longer than HOST_TIMEOUT_S
    (it sends no heartbeat while it calls) is not detached by its agent."""
    host.agent.controller_addr = list(host.contact)
    host.fan(1, contact=["tcp://127.0.0.1:1", "", "elsewhere"])   # another controller's call
    assert host.agent.controller_seen == 0.0
    before = time.monotonic()
    host.fan(2)
    assert host.agent.controller_seen >= before
    assert host.relay.describe()["fan_version"] >= 3


def test_a_fanned_call_that_lists_its_members_reaches_them_as_a_joined_one_does(host):
    """A controller that sends member keys as a list (to an agent it did not see say
    fan_version 2) still reaches every member, and the batch still comes back whole."""
    host.fan(3, host.keys[:4], joined=False)
    assert [host.got_call(i) for i in range(6)] == [True] * 4 + [False] * 2
    for i in range(4):
        host.reply(i, 3)
    host.read()
    (batch,) = host.batches()
    assert batch[1][0][:2] == ("ra", 3) and batch[1][0][3] == b"\x01" * 4


def test_a_record_too_short_for_what_it_announces_closes_that_link_and_the_others_answer(host):
    """A proc's garbled record (a reply or a head shorter than its route or lengths) is not
    read past its end: that link is closed, as for an unknown kind, and the agent goes on."""
    host.fan(4)
    for i in range(6):
        host.got_call(i)
    host.peers[1].send(b"r\x04\x00")                       # a reply cut inside its route
    host.peers[2].send(b"R" + (3).to_bytes(4, "little"))    # a head announcing 3 lengths, none there
    for i in (0, 3, 4, 5):
        host.reply(i, 4)
    host.read()
    assert "agent.1" not in host.links.by_key and "agent.2" not in host.links.by_key
    assert host.peers[1].recv(10) == b"" and host.peers[2].recv(10) == b""   # closed
    host.relay.flush_all()
    (batch,) = host.batches()
    assert [(it[0], it[1], it[3]) for it in batch[1]] == [("ra", 4, b"\x01\x00\x00\x01\x01\x01")]


def test_procs_that_never_stop_writing_let_the_agents_loop_go_round(host):
    """Output read from the fan links until none was ready: procs printing as fast as they
    can kept the agent in one read for over a second (its controller's heartbeats and its
    flush timers waited). A read now ends after POLL_SLICE_S with the links still readable,
    and the next read goes on where it stopped, in order."""
    host.fan(7)
    for i in range(6):
        host.got_call(i)
    d = host.addr.encode()
    head = b"o" + fanlink._pack_meta(7, True, len(d)) + d
    records = [head + pickle.dumps(("out", f"line {n}\n")) for n in range(200_000)]
    pid = os.fork()
    if pid == 0:   # a proc printing as fast as it can (a process of its own: no shared GIL)
        try:
            peer = host.peers[0]
            peer.setblocking(True)
            for rec in records:
                peer.send(rec)
        finally:
            os._exit(0)
    try:
        time.sleep(0.2)
        t0 = time.monotonic()
        host.read()
        took = time.monotonic() - t0
        assert os.waitpid(pid, os.WNOHANG) == (0, 0), "the read ended only when the proc stopped writing"
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert took < 1.0, f"one read took {took:.2f} s"
    while host.links.ep.poll(0):
        host.read()
    host.relay.flush_all()
    lines = [it[1] for b in host.batches() for it in b[1] if it[0] == "out"]
    assert len(lines) > 100 and lines == [f"line {i}\n" for i in range(len(lines))]   # in order, none lost
