"""Same-host peers are reached over ipc, found through their tcp address. A tcp port that a
new proc reuses must lead to the new proc, not to a cached socket of the old one. A
controller that starts listening on a job's network keeps its same-host procs' replies
off that network."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest
import zmq

from monarch_kernel.core import wire
from monarch_kernel.core.runtime import ProcRef, ipc_name, runtime


def _inbox(ctx):
    s = ctx.socket(zmq.PULL)
    name = ipc_name("test")
    s.bind(name)
    return s, name


def test_a_reused_tcp_address_reaches_the_new_procs_ipc_inbox():
    rt = runtime()
    key = b"k" * 32
    ctx = zmq.Context.instance()
    old, old_ipc = _inbox(ctx)
    new, new_ipc = _inbox(ctx)
    try:
        tcp = "tcp://127.0.0.1:1"   # never bound: only the ipc names carry messages
        ref = ProcRef("old", 0, "h", 1, tcp, tcp, "a", old_ipc, old_ipc, rt.host_id)
        rt.register_procs([ref], key)
        rt.keyring.accept("test inbox", wire.dest_id(tcp))   # messages name the tcp address
        rt.send(tcp, key, ("ping", 1))
        assert old.poll(5000) and rt.keyring.open(old.recv_multipart(), "test inbox") == ("ping", 1)
        # a new proc on this host got the same tcp port, with a new ipc name
        rt.register_procs([ref._replace(key="new", work_ipc=new_ipc, ctrl_ipc=new_ipc)], key)
        rt.send(tcp, key, ("ping", 2))
        assert new.poll(5000) and rt.keyring.open(new.recv_multipart(), "test inbox") == ("ping", 2)
        assert not old.poll(200)
    finally:
        old.close(0)
        new.close(0)
        for k in ("old", "new"):
            rt.procs.pop(k, None)


def test_a_peer_on_another_host_is_reached_over_tcp():
    rt = runtime()
    ref = ProcRef("far", 0, "h", 1, "tcp://10.9.9.9:5", "tcp://10.9.9.9:6", "a", "ipc://@x", "ipc://@y",
                  "another-host")
    rt.register_procs([ref], b"k" * 32)
    try:
        assert "tcp://10.9.9.9:5" not in rt.transport.ipc_alias
    finally:
        rt.procs.pop("far", None)


_LISTEN_ON = """
import subprocess, sys, cloudpickle
from monarch_kernel.actor import Actor, endpoint, this_host
from monarch_kernel.core.runtime import runtime
cloudpickle.register_pickle_by_value(sys.modules[__name__])
class E(Actor):
    @endpoint
    def echo(self, x):
        return x
pm = this_host().spawn_procs(per_host={"gpus": 2})
e = pm.spawn("e", E)
print("BEFORE", e.echo.call(1).get(30).values())
runtime().listen_on("10.77.0.1")         # as a job's launcher does: the job's network
print("LISTENING", e.echo.call(2).get(30).values(), e.slice(gpus=1).echo.call_one(3).get(30))
subprocess.run(["ip", "link", "del", "mkjob0"], check=True)   # that network goes away
try:
    print("AFTER", e.echo.call(4).get(10).values(), e.slice(gpus=0).echo.call_one(5).get(10))
except Exception as ex:
    print("LOST", type(ex).__name__, ex)
pm.stop().get(30)
"""


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("ip"),
                    reason="needs root, unshare and ip for a network namespace of its own")
@pytest.mark.parametrize("ipc", ["1", "0"])
def test_same_host_procs_keep_replying_when_the_network_the_controller_listens_on_goes_away(ipc):
    """Runtime.listen_on hands every peer a new address; procs on the controller's host keep
    reaching it the way they did (ipc, or loopback with ipc off), so their replies do not
    depend on that network. Run in a network namespace of its own, on a veth pair."""
    setup = ("ip link set lo up && ip link add mkjob0 type veth peer name mkjob1 "
             "&& ip addr add 10.77.0.1/24 dev mkjob0 && ip link set mkjob1 up "
             "&& ip link set mkjob0 up && exec \"$0\" -c \"$1\"")
    r = subprocess.run(["unshare", "--net", "sh", "-c", setup, sys.executable, _LISTEN_ON], capture_output=True,
                       text=True, timeout=120, env={**os.environ, "MONARCH_KERNEL_SAME_HOST_IPC": ipc,
                                                    "MONARCH_KERNEL_NO_TORCH": "1"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "LISTENING [2, 2] 3" in r.stdout, r.stdout + r.stderr
    assert "AFTER [4, 4] 5" in r.stdout, r.stdout + r.stderr[-3000:]


def test_messages_of_one_and_of_many_frames_read_back_whole_in_any_order():
    """recv_message asks zmq whether more frames follow only when the header may name a buffer:
    a one-frame message with a stray 0x97 byte, a message with out-of-band buffers and a large
    header in a frame of its own must each read back whole, and not bleed into the next."""
    import numpy as np

    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    try:
        addr = ipc_name("recv-test")
        pull.bind(addr)
        push.connect(addr)
        kr = wire.Keyring()
        key = b"k" * 32
        kr.add(key)
        dest = wire.dest_id(addr)
        kr.accept("test", dest)
        arr = np.arange(100_000, dtype=np.float64)
        msgs = [("plain", "\x97 in the text", 151), ("array", arr), ("big", "x" * 200_000), ("after", None)]
        for m in msgs:
            frames = kr.sign(key, wire.dumps(m), dest)
            push.send_multipart(frames, copy=False)
        got = [kr.open(wire.recv_message(pull), "test") for _ in msgs]
        assert got[0] == msgs[0] and got[2] == msgs[2] and got[3] == msgs[3]
        assert got[1][0] == "array" and np.array_equal(got[1][1], arr)
        plain = kr.sign_one(key, wire.pickle.dumps(("one", "\x97", 151), 5), dest)   # the call_one path
        push.send(plain)
        assert kr.open(wire.recv_message(pull), "test") == ("one", "\x97", 151)
    finally:
        pull.close(0)
        push.close(0)
        ctx.term()


def test_the_io_thread_reads_a_burst_that_never_ends_in_slices_so_its_heartbeats_go_out():
    """The controller's I/O thread drained its inbox until it was empty: under 256 ranks
    printing as fast as they can, one drain ran 5.3 s, no heartbeat went out, and every
    agent detached the controller mid-cell. It now reads for DRAIN_SLICE_S and goes round
    its loop (the heartbeat tick); what it left is read next time, in order."""
    from monarch_kernel.core import inbox as inbox_mod

    ctx = zmq.Context.instance()
    pull, name = _inbox(ctx)
    push = ctx.socket(zmq.PUSH)
    push.connect(name)
    try:
        n = 400
        for i in range(n):
            push.send(wire.dumps(("m", i))[0])
        while not pull.poll(1000):
            pass
        time.sleep(0.2)   # all of them arrived
        seen = []

        def dispatch(msg):
            seen.append(msg[1])
            time.sleep(0.002)   # routing a batch of a flood's output

        opener = lambda frames, where: wire.loads(frames[0])   # noqa: E731
        inbox_mod.Inbox._drain(pull, opener, dispatch)
        first = len(seen)
        while len(seen) < n and pull.poll(1000):
            inbox_mod.Inbox._drain(pull, opener, dispatch)
        assert first < n / 2, f"one drain read {first} of {n} messages (~{first * 2} ms): no slice"
        assert seen == list(range(n))   # the rest, read later, in order: nothing lost
    finally:
        push.close(0)
        pull.close(0)
