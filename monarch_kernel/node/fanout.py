"""The host agent's half of fan-out and fan-in (issue 11, section 2): one message per host.

Fan-out. The controller sends a call, a spawn or a broadcast for many procs of this host
to the agent's *fan inbox* once: ``("fan", proc keys, reply contact, call id, the inner
message's pickled header, its buffers)``, signed for this inbox. The agent checks it, MACs
the inner message's body once, and stamps it for each proc's work inbox (a signed message
names its receiving socket, so it cannot be replayed to another; wire.py), then pushes it
over ipc. The agent holds the mesh key anyway; it never unpickles the inner message.

Fan-in. A fanned call carries ``reply_to = "fan+" + controller address``. Its procs send
the reply, and the output written while they run it, to the agent's *gather inbox* (ipc),
each message prefixed with a routing frame ``dest \\0 call id``. A fanned reply is
``("rv", call id, proc key, ok, value header, value buffers)``: the value pickled on its
own, so the agent checks the proc's signature and replay stamp and reads the small tuple
without ever unpickling a user's object (its class may not even import here). The agent
holds the items per destination and sends one signed batch ``("rb", items, buffers)``
when every member of a call on this host has answered, or ``MONARCH_KERNEL_FANIN_FLUSH_S``
(2 ms) after the first one waiting (output, slow members). The controller checks one
signature per batch and unpickles only the values: per member a few microseconds instead
of a receive, a MAC check and a full message. A proc's output and reply leave on the same socket, in order,
and the agent keeps that order in the batch. Before a proc's death is reported, what it
sent is flushed.

Everything runs on the agent's poll-loop thread; ``sockets()`` are polled by it.
"""
from __future__ import annotations

import logging
import pickle
import time

import zmq

from monarch_kernel import config
from monarch_kernel.core import curve, wire
from monarch_kernel.core.runtime import host_id, ipc_name

log = logging.getLogger("monarch_kernel.agent")

MAX_HELD = 4096   # messages held for one destination before a batch goes regardless
MAX_CALLS = 8192  # calls still expecting replies here (a dead member's never comes)


class _Held:
    __slots__ = ("items", "buffers", "since", "sock", "dest")

    def __init__(self, sock, dest: bytes):
        self.items: list = []
        self.buffers: list = []
        self.since = 0.0
        self.sock, self.dest = sock, dest   # dest: the controller inbox's name (wire.dest_id)


class FanRelay:
    def __init__(self, agent):
        self.agent = agent
        ctx = agent.ctx
        self.fan_in = ctx.socket(zmq.PULL)
        self.fan_in.setsockopt(zmq.LINGER, 0)
        self.fan_in.setsockopt(zmq.RCVHWM, 0)
        self.fan_in.setsockopt(zmq.MAXMSGSIZE, -1)
        self.fan_in.setsockopt(zmq.HANDSHAKE_IVL, 2000)
        secret = curve.agent_keys(agent.key)[1] if curve.wanted(agent.bind_host) else None
        tcp = curve.bind(self.fan_in, f"tcp://{agent.bind_host}:*", secret)
        self.fan_tcp = curve.with_key(tcp, curve.agent_keys(agent.key)[0] if secret else b"")
        self.fan_ipc = ipc_name("fan")
        self.fan_in.bind(self.fan_ipc)
        self.gather = ctx.socket(zmq.PULL)
        self.gather.setsockopt(zmq.LINGER, 0)
        self.gather.setsockopt(zmq.RCVHWM, 0)
        self.gather_ipc = ipc_name("gather")
        self.gather.bind(self.gather_ipc)
        agent.keyring.accept("fan inbox", wire.dest_id(self.fan_tcp), wire.dest_id(self.fan_ipc))
        agent.keyring.accept("gather inbox", wire.dest_id(self.gather_ipc))
        self.to_procs: dict[str, zmq.Socket] = {}     # proc work ipc -> PUSH
        self.held: dict[str, _Held] = {}              # destination address -> what waits for it
        self.contacts: dict[str, list] = {}           # destination address -> its contact
        self.expected: dict[tuple[str, int], int] = {}   # (dest, call id) -> replies still to come
        self.fanned = 0
        self.flush_s = config.FANIN_FLUSH_S.get()

    # ---------------------------------------------------------------- for the agent
    def sockets(self) -> tuple:
        return self.fan_in, self.gather

    def describe(self) -> dict:
        """Added to the agent's hello answer: where the controller sends fanned messages."""
        return {"fan": [self.fan_tcp, self.fan_ipc, host_id()]}

    def proc_config(self) -> dict:
        return {"gather": self.gather_ipc}

    def on_readable(self, sock) -> None:
        if sock is self.fan_in:
            self._drain_fan()
        else:
            self._drain_gather()

    def timeout_ms(self, default: int) -> int:
        """How long the agent's poll may sleep: less while a batch waits to be flushed."""
        if not any(h.items for h in self.held.values()):
            return default
        return 1

    def tick(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for dest, h in self.held.items():
            if h.items and now - h.since >= self.flush_s:
                self._flush(dest, h)

    def flush_all(self) -> None:
        """Before a death is reported: what the dead proc sent must arrive first."""
        for dest, h in self.held.items():
            if h.items:
                self._flush(dest, h)

    def forget_proc(self, p) -> None:
        ref = p.ref
        s = self.to_procs.pop(ref.work_ipc, None) if ref is not None else None
        if s is not None:
            s.close(0)

    def close(self) -> None:
        for s in (*self.to_procs.values(), *(h.sock for h in self.held.values()), self.fan_in, self.gather):
            s.close(0)

    # ---------------------------------------------------------------- fan-out
    def _drain_fan(self) -> None:
        agent = self.agent
        for _ in range(1000):
            try:
                frames = self.fan_in.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            env = agent.keyring.open(frames, "fan inbox")
            if type(env) is not tuple or len(env) != 6 or env[0] != "fan":
                continue
            _, keys, contact, call_id, header, bufs = env
            sealed = agent.keyring.seal(agent.key, [header, *bufs])   # the body hashed once
            sent = 0
            for key in keys:
                p = agent.procs.get(key)
                if p is None or p.state != "alive" or p.ref is None:
                    continue   # dead or stopped: the controller hears that from us, once
                try:
                    addr = p.ref.work_ipc or p.ref.work
                    self._to_proc(p.ref).send_multipart(agent.keyring.stamp(sealed, wire.dest_id(addr)), copy=False)
                    sent += 1
                except zmq.ZMQError as e:
                    log.warning("could not forward to proc %s: %s", key, e)
            self.fanned += sent
            if call_id and contact:
                dest = contact[0]
                self.contacts[dest] = contact
                self.expected[(dest, call_id)] = self.expected.get((dest, call_id), 0) + sent
                if len(self.expected) > MAX_CALLS:   # calls whose member died before replying
                    for k in list(self.expected)[:MAX_CALLS // 2]:   # oldest first
                        del self.expected[k]

    def _to_proc(self, ref) -> zmq.Socket:
        addr = ref.work_ipc or ref.work
        s = self.to_procs.get(addr)
        if s is None:
            s = self.to_procs[addr] = self.agent.ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.SNDHWM, 0)
            s.setsockopt(zmq.LINGER, 0)
            curve.connect(s, addr)
        return s

    # ---------------------------------------------------------------- fan-in
    def _drain_gather(self) -> None:
        done: set[str] = set()
        for _ in range(10_000):
            try:
                frames = self.gather.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            if len(frames) < 2:
                continue
            msg = self.agent.keyring.open(frames[1:], "gather inbox")
            if type(msg) is not tuple or not msg:
                continue
            dest, _, call = bytes(frames[0].buffer).decode(errors="replace").partition("\0")
            h = self.held.get(dest)
            if h is None:
                contact = self.contacts.get(dest)
                if contact is None:
                    continue   # nobody asked us to gather for it: not ours to forward
                h = self.held[dest] = _Held(*self._connect(contact))
            if not h.items:
                h.since = time.monotonic()
            if msg[0] == "rv" and len(msg) == 6:
                _, call_id, key, ok, vheader, vbufs = msg
                h.items.append(("r", call_id, key, ok, vheader, len(vbufs)))
                h.buffers.extend(vbufs)
            else:
                h.items.append(msg)   # output, as the proc wrote it
            if call:
                k = (dest, int(call))
                left = self.expected.get(k, 0) - 1
                if left <= 0:
                    self.expected.pop(k, None)
                    done.add(dest)
                else:
                    self.expected[k] = left
            if len(h.items) >= MAX_HELD:
                done.add(dest)
        for dest in done:
            self._flush(dest, self.held[dest])

    def _connect(self, contact) -> tuple[zmq.Socket, bytes]:
        s = self.agent.ctx.socket(zmq.PUSH)
        s.setsockopt(zmq.SNDHWM, 0)
        s.setsockopt(zmq.LINGER, 0)
        addr, ipc, hid = contact[0], contact[1], contact[2]
        if ipc and hid == host_id():
            s.connect(ipc)
            return s, wire.dest_id(ipc)
        curve.connect(s, addr, contact[3] if len(contact) > 3 and contact[3] else None)
        return s, wire.dest_id(addr)

    def _flush(self, dest: str, h: _Held) -> None:
        agent = self.agent
        # Values' buffers (tensors) ride out of band, zero copy, as they came.
        batch = agent.keyring.sign(agent.key, wire.dumps(
            ("rb", h.items, [pickle.PickleBuffer(b) for b in h.buffers])), h.dest)
        try:
            h.sock.send_multipart(batch, copy=False)
        except zmq.ZMQError as e:
            log.warning("could not send a batch of %d to %s: %s", len(h.items), dest, e)
        h.items, h.buffers = [], []


# -------------------------------------------------------------------- the proc's side
FAN_PREFIX = "fan+"   # reply_to of a fanned call: the reply goes back through the agent


def real_address(reply_to):
    """A fanned call's reply_to without its mark (for response ports and direct sends)."""
    if type(reply_to) is str and reply_to.startswith(FAN_PREFIX):
        return reply_to[len(FAN_PREFIX):]
    return reply_to


def fanned(gather: str | None, reply_to) -> bool:
    return bool(gather) and type(reply_to) is str and reply_to.startswith(FAN_PREFIX)


def send_fanned_reply(rt, gather: str, key: bytes, reply_to: str, call_id: int, proc_key: str, ok: bool,
                      value, unsendable) -> None:
    """A fanned call's reply, through the agent: the value pickled apart (see the module
    docstring). ``unsendable(error)``: the ActorError to send when the value won't pickle."""
    from monarch_kernel.core.runtime import is_local

    dest = reply_to[len(FAN_PREFIX):]
    try:
        vframes = wire.dumps(value, 1 if is_local(dest) else 0)
    except Exception as e:
        ok, vframes = False, wire.dumps(unsendable(e))
    msg = ("rv", call_id, proc_key, ok, vframes[0], [pickle.PickleBuffer(b) for b in vframes[1:]])
    frames = rt.keyring.stamp(rt.pack(key, msg), wire.dest_id(gather))
    rt.send_frames(gather, [f"{dest}\0{call_id}".encode(), *frames])


def output_route(gather: str | None, busy_call, sink_addr: str) -> bytes | None:
    """Output written while a fanned call runs goes the reply's way (order kept): the
    routing frame for it, or None to send it direct."""
    if not gather or busy_call is None:
        return None
    reply_to = busy_call[0]
    if type(reply_to) is str and reply_to.startswith(FAN_PREFIX) and reply_to[len(FAN_PREFIX):] == sink_addr:
        return f"{sink_addr}\0".encode()
    return None
