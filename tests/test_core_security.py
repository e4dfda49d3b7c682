"""Security against real sockets: forged or malformed messages sent to a proc's work inbox,
its ctrl inbox, the host agent's ROUTER and the controller's inbox are dropped and logged,
never unpickled, and the mesh keeps working; the connection file is private; everything
listens on loopback by default. Peers without the keys: test_core_strangers.py."""
from __future__ import annotations

import logging
import os
import pickle
import stat
import sys
import time

import cloudpickle
import psutil
import pytest
import zmq

from monarch_kernel.actor import Actor, endpoint, this_host
from monarch_kernel.core import curve, wire
from monarch_kernel.core.connection import connection_path, home
from monarch_kernel.core.runtime import runtime

cloudpickle.register_pickle_by_value(sys.modules[__name__])

NAME = "security-test"


class Echo(Actor):
    @endpoint
    def echo(self, x):
        return x


class CreatesAFile:
    """Unpickling this creates ``path``: the proof that a message was unpickled."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.fixture(scope="module")
def mesh():
    hm = this_host(NAME, lease=60)
    pm = hm.spawn_procs(per_host={"gpus": 2})
    am = pm.spawn("echo", Echo)
    yield hm, pm, am
    hm.shutdown()


def forged_messages(key: bytes, path: str) -> dict[str, list]:
    """Messages a stranger could send: each would run ``open(path, 'w')`` if unpickled.
    Built through wire.Keyring, so they do not depend on the frame layout."""
    evil = pickle.dumps(("call", CreatesAFile(path)), protocol=5)
    benign = pickle.dumps(("call", "x" * len(evil)), protocol=5)
    anywhere = b"\0" * 8   # the checks below come before the destination's
    signed = wire.Keyring().sign(key, [benign], anywhere)
    # the mesh's key id and a valid signature, but over other bytes than those sent
    swapped = [f[: len(f) - len(benign)] + evil if bytes(f).endswith(benign) else f for f in signed]
    assert swapped != signed
    return {
        "wrong key": wire.Keyring().sign(os.urandom(32), [evil], anywhere),
        "signature over other bytes": swapped,
        "garbage": [b"\xff" * 100],
        "short garbage": [b"\xff" * 10],
        "too few bytes": [b"x", b"y"],
        "unsigned pickle": [evil],
    }


def send_all(addr: str, messages: dict, sock_type=zmq.PUSH, server_key: bytes | None = None) -> None:
    """Send as a peer that got past CURVE (it knows the endpoint's public key, as one that
    saw the address would, but not the mesh key): the MAC layer behind it is what is tested.
    A peer without the public key does not get this far (test_core_strangers.py)."""
    ctx = zmq.Context.instance()
    s = ctx.socket(sock_type)
    s.setsockopt(zmq.LINGER, 2000)
    curve.connect(s, addr, server_key)
    for frames in messages.values():
        s.send_multipart(frames)
    s.close()


def wait_for(pred, within: float = 5.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


def capture_output():
    rt = runtime()
    got: list = []
    orig = rt.output
    rt.output = lambda rank, stream, text: got.append((rank, stream, text))
    return got, lambda: setattr(rt, "output", orig)


@pytest.mark.parametrize("inbox", ["work", "ctrl"])
def test_forged_messages_to_a_proc_are_dropped_logged_and_not_unpickled(mesh, tmp_path, inbox):
    hm, pm, am = mesh
    path = tmp_path / f"pwned-{inbox}"
    ref = pm.procs()[1]
    got, restore = capture_output()
    try:
        send_all(getattr(ref, inbox), forged_messages(hm._key, str(path)))
        where = "work inbox" if inbox == "work" else "inbox"
        logged = lambda: "".join(t for r, s, t in got if r == 1 and s == "stderr")  # noqa: E731
        assert wait_for(lambda: logged().count(f"on {where}") >= 6), logged()
    finally:
        restore()
    text = logged()
    assert "dropped an unauthenticated message" in text and "unknown key" in text and "bad signature" in text
    assert "dropped a malformed message" in text
    assert not path.exists(), "a forged message was unpickled"
    assert am.echo.call("still here").get(30).values() == ["still here"] * 2


def test_forged_messages_to_the_agent_router_are_dropped_and_logged(mesh, tmp_path):
    hm, pm, am = mesh
    path = tmp_path / "pwned-agent"
    log_file = home() / "logs" / f"{NAME}.log"
    before = log_file.read_text().count("dropped")
    send_all(hm._agents[0]["addr"], forged_messages(hm._key, str(path)), zmq.DEALER, curve.agent_keys(hm._key)[0])
    assert wait_for(lambda: log_file.read_text().count("dropped") - before >= 6), log_file.read_text()[-2000:]
    text = log_file.read_text()
    assert "dropped an unauthenticated message on agent router" in text
    assert not path.exists()
    assert am.echo.call(1).get(30).values() == [1, 1]
    assert len(hm.status()) >= 2      # the agent still answers its controller


def test_forged_messages_to_the_controller_inbox_are_dropped_and_logged(mesh, tmp_path, caplog):
    hm, pm, am = mesh
    path = tmp_path / "pwned-controller"
    with caplog.at_level(logging.WARNING, logger="monarch_kernel.wire"):
        send_all(runtime().address, forged_messages(hm._key, str(path)))
        assert wait_for(lambda: sum("dropped" in r.getMessage() for r in caplog.records) >= 6)
    assert not path.exists()
    assert am.echo.call(2).get(30).values() == [2, 2]


def test_a_validly_signed_message_is_unpickled(mesh, tmp_path):
    """The control for the tests above: the same payload, signed with the mesh key, does
    reach pickle.loads (so their negative result means the check, not a broken payload)."""
    hm, pm, am = mesh
    path = tmp_path / "signed"
    header = pickle.dumps(CreatesAFile(str(path)), protocol=5)   # not a tuple: then ignored
    work = pm.procs()[0].work
    send_all(work, {"signed": wire.Keyring().sign(hm._key, [header], wire.dest_id(work))})
    assert wait_for(lambda: path.exists())
    assert am.echo.call(3).get(30).values() == [3, 3]


def test_connection_file_is_private(mesh):
    path = connection_path(NAME)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert mesh[0]._key.hex() in path.read_text()


def test_everything_listens_on_loopback_by_default(mesh):
    hm, pm, am = mesh
    addrs = [hm._agents[0]["addr"], runtime().address]
    for ref in pm.procs():
        addrs += [ref.work, ref.ctrl]
    assert all(a.startswith("tcp://127.0.0.1:") for a in addrs), addrs
    pids = [hm._agents[0]["pid"], os.getpid()] + [r.pid for r in pm.procs()]
    for pid in pids:
        listening = [c for c in psutil.Process(pid).net_connections(kind="inet")
                     if c.status == psutil.CONN_LISTEN]
        assert listening, f"pid {pid} listens on nothing?"
        assert {c.laddr.ip for c in listening} == {"127.0.0.1"}, (pid, listening)


def test_a_socket_reached_by_two_names_accepts_each_message_once():
    """A socket is named by its tcp port and its ipc name; one sender numbers messages per
    name, so both streams are accepted, and each message only once (frames signed as on
    the wire, opened as the receiving socket does)."""
    key = os.urandom(32)
    sender, receiver = wire.Keyring(), wire.Keyring()
    receiver.add(key)
    tcp, ipc = wire.dest_id("tcp://127.0.0.1:5000"), wire.dest_id("ipc://@monarch-test")
    receiver.accept("inbox", tcp, ipc)
    sent = [sender.sign(key, wire.dumps(("m", name, i)), dest) for i in range(3)
            for name, dest in (("tcp", tcp), ("ipc", ipc))]
    assert [receiver.open(f, "inbox") for f in sent] == [("m", n, i) for i in range(3) for n in ("tcp", "ipc")]
    assert [receiver.open(f, "inbox") for f in sent] == [None] * 6          # replays
    other = wire.dest_id("tcp://127.0.0.1:5001")
    assert receiver.open(sender.sign(key, wire.dumps(("m",)), other), "inbox") is None   # not ours


def test_after_a_long_run_in_order_every_replay_inside_and_past_the_window_is_refused():
    """A long stream in order (the pipelined case, where the guard takes its shortcut) still
    refuses any message seen before, out-of-order ones inside the window are still taken
    once, and those older than the window are refused."""
    key = os.urandom(32)
    sender, receiver = wire.Keyring(), wire.Keyring()
    receiver.add(key)
    dest = wire.dest_id("ipc://@monarch-test-window")
    receiver.accept("inbox", dest)
    n = wire.REPLAY_WINDOW * 3
    sent = [sender.sign_one(key, wire.dumps(("m", i))[0], dest) for i in range(n + 2)]
    late = sent.pop(n - 5)                          # held back: arrives out of order, later
    assert [receiver.open([f], "inbox") for f in sent[:n]] == [("m", i) for i in range(n + 1) if i != n - 5]
    for i in (n - 1, n - 6, n - wire.REPLAY_WINDOW + 1, n - wire.REPLAY_WINDOW - 10, 0):
        assert receiver.open([sent[i]], "inbox") is None, i          # replays, inside and past the window
    assert receiver.open([late], "inbox") == ("m", n - 5)            # late, never seen: taken once
    assert receiver.open([late], "inbox") is None
    assert receiver.open([sent[n]], "inbox") == ("m", n + 1)         # the stream goes on
    assert receiver.replays_dropped == 6
