"""The host agent's half of fan-out and fan-in (issue 11, section 2): one message per host.

Fan-out. The controller sends a call, a spawn or a broadcast for many procs of this host
to the agent's *fan inbox* once: ``("fan", proc keys, reply contact, call id, the inner
message's pickled header, its buffers)``, signed for this inbox. The agent checks it and
writes the inner message to each proc on that proc's *fan link* (node/fanlink.py: a unix
socket authenticated once per connection; one system call each way, no zmq I/O thread).
A proc without a link (MONARCH_KERNEL_FAN_LINK=0) gets it as before: the body MACed once,
stamped for its work inbox (a signed message names its receiving socket, so it cannot be
replayed to another; wire.py) and pushed over ipc. The agent never unpickles the inner
message.

Fan-in. A fanned call carries ``reply_to = "fan+" + controller address``. Its procs send
the reply, and the output written while they run it, on their fan link (a record naming
``dest`` and the call id; ``_take_replies``/``_take_output``), or without one to the agent's
*gather inbox* (ipc), each message prefixed with a routing frame ``dest \\0 call id``. A
fanned reply is
``("rv", call id, proc key, ok, value header, value buffers)``: the value pickled on its
own, so the agent checks the proc's signature and replay stamp and reads the small tuple
without ever unpickling a user's object (its class may not even import here). The agent
holds the items per destination and sends one signed batch ``("rb", items, buffers)``
when every member of a call on this host has answered, or ``MONARCH_KERNEL_FANIN_FLUSH_S``
(2 ms) after the first one waiting when it holds output (slow members), ``REPLIES_WAIT_S``
(0.1 s) when it holds replies only. Members that answered alike go up as one summary per
value, not a key each (node/fantree.py ``summarise``). The controller checks one
signature per batch and unpickles only the values: per member a few microseconds instead
of a receive, a MAC check and a full message. A proc's output and reply leave on the same socket, in order,
and the agent keeps that order in the batch. Before a proc's death is reported, what it
sent is flushed.

Past a few hosts this agent may be a relay of a tree of agents: see node/fantree.py.

Everything runs on the agent's poll-loop thread; ``sockets()`` are polled by it.
"""
from __future__ import annotations

import logging
import pickle
import time
from collections import defaultdict, deque

import zmq

from monarch_kernel import config
from monarch_kernel.core import curve, wire
from monarch_kernel.core.fanout import FAN_PREFIX  # a fanned call's reply_to: its reply goes back through the agent
from monarch_kernel.core.messages import Fan
from monarch_kernel.core.runtime import host_id, ipc_name, is_local
from monarch_kernel.core.wire import PLAIN_TYPES
from monarch_kernel.node import fanlink
from monarch_kernel.node.fantree import Retained, addr_of, columns, members, replies_in, reroute, seen_before, summarise

log = logging.getLogger("monarch_kernel.agent")

_NOBLOCK, _RCVMORE = int(zmq.NOBLOCK), int(zmq.RCVMORE)
_SEND = zmq.backend.Socket.send   # the C send, without pyzmq's Python wrapper
MAX_HELD = 4096   # messages held for one destination before a batch goes regardless
MAX_CALLS = 8192  # calls still expecting replies here (a dead member's never comes)
RELAY_WAIT = 10   # a relay holds an incomplete batch this many FANIN_FLUSH_S (20 ms by default)
BATCH_EVERY = 32  # a call to n procs here holds an incomplete batch n // 32 FANIN_FLUSH_S (up to RELAY_WAIT)
# An incomplete batch of replies only (no output held) waits this long: every batch costs the
# controller a wake, a check and a dispatch (~0.2 ms a batch at 256 procs on a loaded 2-core
# machine), and replies alone show nothing until the call is complete, except to a stream
# or a progress count (which see them in 0.1 s steps). A death, output or MAX_HELD flush.
REPLIES_WAIT_S = 0.1


def _last_calls() -> deque:
    return deque(maxlen=32)


class _Held:
    """What waits to go up one way: to the controller ``dest`` itself (``parent`` ""), or
    to a parent agent of the tree (its fan inbox address), as a merged batch."""
    __slots__ = ("items", "buffers", "since", "dest", "parent", "window", "shown")

    def __init__(self, dest: str, parent: str, window: float):
        self.items: list = []
        self.buffers: list = []
        self.since = 0.0
        self.dest, self.parent = dest, parent
        self.window = window   # how long an incomplete batch waits (longer for a relay: RELAY_WAIT)
        self.shown = 0         # items held that a user sees (output): they wait only ``window``

    def due_in(self, now: float) -> float:
        """Seconds until this incomplete batch goes up (<= 0: now)."""
        return self.since + (self.window if self.shown else max(self.window, REPLIES_WAIT_S)) - now


class _Members:
    """A member list of fanned messages (a call to all: the same every call) and, while no
    proc or link changed (``version``), where each goes: fan link connections, or procs
    reached by a signed zmq push. ``pos``: each key's place (fantree.summarise)."""
    __slots__ = ("keys", "pos", "version", "linked", "unlinked")

    def __init__(self, keys: list):
        self.keys = keys
        self.pos = dict(zip(keys, range(len(keys))))
        self.version = None
        self.linked: list = []
        self.unlinked: list = []


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
        tcp = curve.bind(self.fan_in, f"tcp://{agent.bind_host}:*", secret, curve.MAX_FRAME)
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
        self.held: dict[tuple[str, str], _Held] = {}  # (destination, parent or "") -> what waits
        self.up_links: dict[str, tuple] = {}          # address -> (PUSH, its dest id): controllers, agents
        self.contacts: dict[str, list] = {}           # destination address -> its contact
        self.expected: dict[tuple[str, int], int] = {}   # (dest, call id) -> replies still to come here
        self.up_of: dict[tuple[str, int], str] = {}   # (dest, call id) -> parent agent ("" = direct)
        self.own: dict[tuple[str, int], list] = {}    # (dest, call id) -> its members here (summarise)
        self.last_up: dict[str, str] = {}             # dest -> the parent of its latest call
        # proc key -> its latest fanned calls answered, as (where the reply goes, call id): call ids
        # are each controller's own count, so another controller's (one attached before a kernel
        # restart) may be the same numbers
        self.replied: dict[str, deque] = defaultdict(_last_calls)
        self.sends: dict[tuple[str, int], None] = {}   # tree sends seen (dest, send id), oldest first
        self.tree = Retained()                        # what went to parents, until they are known safe
        self.members: dict[str, _Members] = {}        # member list (fan_version 2) -> where they go
        self.fanned = 0
        self.flush_s = config.FANIN_FLUSH_S.get()
        # Each proc's fan link (node/fanlink.py): its fanned calls go down, and their replies
        # and output come up, on it; the gather inbox serves procs without one.
        self.links = fanlink.AgentLinks(agent.keyring, agent.key, ipc_name("link")[len("ipc://"):],
                                        self._link_ok, self._take_replies, self._take_output) \
            if config.FAN_LINK.get() else None
        self._done: dict[int, _Held] = {}   # batches completed while reading (flushed after)

    # ---------------------------------------------------------------- for the agent
    def sockets(self) -> tuple:
        return (self.fan_in, self.gather) + ((self.links.fileno(),) if self.links is not None else ())

    def contact(self) -> list:
        return [self.fan_tcp, self.fan_ipc, host_id()]

    def describe(self) -> dict:
        """Added to the agent's hello answer: where the controller sends fanned messages, and
        what this agent reads (2: member keys joined by NUL in one string; summaries; 3: a
        fanned message from the attached controller counts as its heartbeat)."""
        return {"fan": self.contact(), "fan_version": 3}

    def proc_config(self) -> dict:
        return {"gather": self.gather_ipc, **({"fan_link": self.links.path} if self.links is not None else {})}

    def on_readable(self, sock) -> None:
        if sock is self.fan_in:
            self._drain_fan()
        elif sock is self.gather:
            self._drain_gather()
        else:
            self.links.poll()
            self._flush_done()

    def _link_ok(self, key: str, pid: int) -> bool:
        """A fan link's hello names proc ``key`` from pid ``pid``: one we are starting?"""
        p = self.agent.procs.get(key)
        return p is not None and p.state == "starting" and (not p.pid or p.pid == pid)

    def timeout_ms(self, default: int) -> int:
        """How long the agent's poll may sleep: less while a batch waits to be flushed."""
        now, ms = time.monotonic(), default
        for h in self.held.values():
            if h.items:
                ms = min(ms, max(0, int(h.due_in(now) * 1000) + 1))
        return ms

    def tick(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for h in list(self.held.values()):
            if h.items and h.due_in(now) <= 0:
                self._flush(h)

    def flush_all(self) -> None:
        """Before a death is reported: what the dead proc sent must arrive first."""
        for h in list(self.held.values()):
            if h.items:
                self._flush(h)

    def forget_proc(self, p) -> None:
        """Proc ``p`` ended: what it wrote on its link before it did joins the batches (the
        agent flushes them before it reports the death), then its sockets close."""
        if self.links is not None:
            self.links.drain(p.key)
            self._flush_done()
        ref = p.ref
        s = self.to_procs.pop(ref.work_ipc, None) if ref is not None else None
        if s is not None:
            s.close(0)

    def replied_calls(self, key: str) -> list:
        """The calls a proc that just ended replied to lately, as (destination, call id) (its
        replies may still be on their way up a tree when its death, sent straight to the
        controller, arrives)."""
        return list(self.replied.pop(key, ()))

    def close(self) -> None:
        for s in (*self.to_procs.values(), *(link[0] for link in self.up_links.values()), self.fan_in, self.gather):
            s.close(0)
        if self.links is not None:
            self.links.close_all()

    def reroute(self, dest: str, lost_contact, calls=None) -> int:
        return reroute(self, dest, lost_contact, calls)

    # ---------------------------------------------------------------- fan-out
    def _drain_fan(self) -> None:
        agent, heard = self.agent, False
        for _ in range(1000):
            try:
                frames = curve.joined(self.fan_in.recv_multipart(zmq.NOBLOCK, copy=False))
            except zmq.Again:
                return
            env = agent.keyring.open(frames, "fan inbox")
            if type(env) is not tuple or not env:
                continue
            if env[0] == "ub" and len(env) == 4:   # a child agent's batch, to merge and send up
                self._from_child(*env[1:])
                continue
            if env[0] != "fan" or len(env) < 6:
                continue
            _, keys, contact, call_id, header, bufs, children, parent, sid, summaries = Fan.of(env)
            if not heard and contact and agent.controller_addr and contact[0] == agent.controller_addr[0]:
                # Signed by the attached controller (directly or through a parent agent): as good
                # as a heartbeat from it (fan_version 3: it sends none while it calls).
                agent.controller_seen = time.monotonic()
                heard = True
            if sid and contact and seen_before(self, contact[0], sid, call_id, parent):
                continue   # sent again by the controller after our parent was lost: done already
            # Children first: their subtrees start while this host stamps its own procs.
            below = sum(self._forward(child, contact, call_id, header, bufs, sid, summaries) for child in children)
            m = self._members_of(keys)
            keys = m.keys
            sent = len(m.linked)
            if sent:   # on their fan links: unsigned, point to point (fanlink.py)
                self.links.send_each(m.linked, fanlink.records(fanlink.CALL, [header, *bufs]))
            if m.unlinked:
                sent += self._send_signed(m.unlinked, header, bufs)
            self.fanned += sent
            if call_id and contact:
                dest = contact[0]
                self.contacts[dest] = contact
                k = (dest, call_id)
                self.expected[k] = self.expected.get(k, 0) + sent + below
                up = self.up_of[k] = self.last_up[dest] = addr_of(parent) if parent else ""
                if summaries and sent:   # its replies may go up as summaries (fantree.summarise)
                    own = self.own
                    own[k] = [keys, m.pos, sent]
                    if len(own) > MAX_CALLS:   # calls whose member died before replying
                        for old in list(own)[:MAX_CALLS // 2]:
                            del own[old]
                # Each partial batch costs the controller a wake and a receive: a relay waits longer
                # for its subtree, and so does a call to many procs of this host (on 2 cores 256
                # procs answer over tens of ms; 2 ms windows sent 1.75 batches a call). A complete
                # call still goes at once, and a death flushes.
                h = self.held_slot(dest, up)
                h.window = self.flush_s * (RELAY_WAIT if below else min(RELAY_WAIT, max(1, sent // BATCH_EVERY)))
                if len(self.expected) > MAX_CALLS:   # calls whose member died before replying
                    for old in list(self.expected)[:MAX_CALLS // 2]:   # oldest first
                        del self.expected[old]
                if len(self.up_of) > MAX_CALLS:
                    for old in list(self.up_of)[:MAX_CALLS // 2]:
                        del self.up_of[old]

    def _members_of(self, keys) -> _Members:
        """The procs a fanned message for ``keys`` (one string joined by NUL, fan_version 2,
        or a list) goes to, and how: kept per member list until a proc or a link changes, so
        a call to all costs no lookups and checks per member (the same members every call)."""
        if type(keys) is not str:   # a list (an agent of fan_version 1's controller): not kept
            m = _Members(list(keys))
        else:
            m = self.members.get(keys)
            if m is None:
                if len(self.members) >= 64:
                    self.members.clear()
                m = self.members[keys] = _Members(keys.split("\0") if keys else [])
        version = (self.agent.proc_changes(), self.links.changes if self.links is not None else 0)
        if m.version != version:
            procs, linked = self.agent.procs, self.links.by_key if self.links is not None else {}
            m.linked, m.unlinked, m.version = [], [], version
            for key in m.keys:
                p = procs.get(key)
                if p is None or p.state != "alive" or p.ref is None:
                    continue   # dead or stopped: the controller hears that from us, once
                c = linked.get(key)
                if c is not None:
                    m.linked.append(c)
                else:
                    m.unlinked.append(p)
        return m

    def _send_signed(self, procs: list, header: bytes, bufs: list) -> int:
        """To procs without a fan link: the body MACed once, stamped for each work inbox."""
        agent = self.agent
        sealed = agent.keyring.seal(agent.key, [header, *bufs])   # the body hashed once
        stamp, dest_id, to_procs, sent = agent.keyring.stamp, wire.dest_id, self.to_procs, 0
        for p in procs:
            try:
                addr = p.ref.work_ipc or p.ref.work
                sock = to_procs.get(addr) or self._to_proc(p.ref)
                frames = stamp(sealed, dest_id(addr))
                if len(frames) == 1:
                    _SEND(sock, frames[0])   # a small call: a copy beats a zero-copy Frame
                else:
                    sock.send_multipart(frames, copy=False)
                sent += 1
            except zmq.ZMQError as e:
                log.warning("could not forward to proc %s: %s", p.key, e)
        return sent

    def _forward(self, child, contact, call_id, header, bufs, sid, summaries) -> int:
        """Send a child agent its part of the tree (its procs' keys and its own subtree); how
        many replies it will send up to us."""
        fan, keys, subtree = child
        env = ("fan", keys, contact, call_id, header, [pickle.PickleBuffer(b) for b in bufs], subtree,
               self.contact(), sid, summaries)
        try:
            self._send_to(addr_of(fan), env, fan)
        except zmq.ZMQError as e:
            log.warning("could not forward to agent %s: %s", fan[0], e)
        return members(child)

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
        gather, opener, recv = self.gather, self.agent.keyring.open, wire.recv_message
        getsockopt = gather.getsockopt
        for _ in range(10_000):
            # The routing frame and the reply as bytes (a zmq.Frame apiece cost more than the
            # copy of a small reply); only a value's out-of-band buffers stay zero-copy.
            try:
                route = gather.recv(_NOBLOCK)
            except zmq.Again:
                break
            if not getsockopt(_RCVMORE):
                continue
            msg = opener(recv(gather), "gather inbox")
            if type(msg) is not tuple or not msg:
                continue
            dest, _, call = route.decode(errors="replace").partition("\0")
            call_id = int(call) if call.isdigit() else 0
            if msg[0] == "rv" and len(msg) == 6:
                _, rcall, key, ok, vheader, vbufs = msg
                self._take_replies(dest, call_id, ok, [key], [vheader], vbufs, rcall)
            else:
                self._take_output(dest, call_id, msg)
        self._flush_done()

    def _take_replies(self, dest: str, call_id: int, ok: bool, keys: list, vheaders: list, vbufs=(),
                      rcall=None) -> None:
        """Members ``keys``' replies to ``call_id`` (routed to ``dest``), alike but for their
        values (a run read from the fan links; ``vbufs``: the buffers of a single reply), into
        the batch going that way (complete or full: flushed by _flush_done). ``rcall``: the
        call id a signed reply names, when it came through the gather inbox."""
        h = self._held_for(dest, call_id)
        if h is None:
            return   # nobody asked us to gather for it: not ours to forward
        if rcall is not None:
            call_id = rcall
        items = h.items
        if not items:
            h.since = time.monotonic()
        replied = self.replied
        done = (dest, call_id)
        for key in keys:
            replied[key].append(done)
        run = items[-1] if items else None
        if type(run) is not list or run[1] != call_id:   # a call's replies in a row: one run
            run = ["rc", call_id, [], [], [], []]
            items.append(run)
        n = len(keys)
        run[2] += keys
        run[4] += vheaders
        if n == 1:
            run[3].append(ok)
            run[5].append(len(vbufs))
            if vbufs:
                h.buffers.extend(vbufs)
        else:
            run[3] += [ok] * n
            run[5] += [0] * n
        if self._answered(dest, call_id, n) or len(items) >= MAX_HELD:
            self._done[id(h)] = h

    def _take_output(self, dest: str, call_id: int, msg) -> None:
        """Output a member wrote while it ran ``call_id``, as it wrote it (order kept)."""
        h = self._held_for(dest, call_id)
        if h is None:
            return
        if not h.items:
            h.since = time.monotonic()
        h.items.append(msg)
        h.shown += 1
        if len(h.items) >= MAX_HELD:
            self._done[id(h)] = h

    def _flush_done(self) -> None:
        if self._done:
            done, self._done = self._done, {}
            for h in done.values():
                self._flush(h)

    def _from_child(self, dest, items, buffers) -> None:
        """A child agent's batch: merged, as it is (user values stay opaque), into ours."""
        if type(dest) is not str or type(items) is not list or type(buffers) is not list:
            return
        first = next((it[1] for it in items if replies_in(it)), 0)
        h = self._held_for(dest, first)
        if h is None:
            return
        if not h.items:
            h.since = time.monotonic()
        h.items.extend(items)
        h.buffers.extend(buffers)
        h.shown += sum(not replies_in(it) for it in items)
        complete = False
        for it in items:
            n = replies_in(it)
            if n and self._answered(dest, it[1], n):
                complete = True
        if complete or len(h.items) >= MAX_HELD:
            self._flush(h)

    def _answered(self, dest: str, call_id, n: int) -> bool:
        """Count ``n`` replies of a call in; True when every one expected here has come."""
        k = (dest, call_id)
        left = self.expected.get(k, 0) - n
        if left <= 0:
            self.expected.pop(k, None)
            return True
        self.expected[k] = left
        return False

    def _held_for(self, dest: str, call_id: int) -> _Held | None:
        parent = self.up_of.get((dest, call_id)) if call_id else None
        return self.held_slot(dest, self.last_up.get(dest, "") if parent is None else parent)

    def held_slot(self, dest: str, parent: str) -> _Held | None:
        h = self.held.get((dest, parent))
        if h is None:
            if dest not in self.contacts:
                return None
            h = self.held[(dest, parent)] = _Held(dest, parent, self.flush_s)
        return h

    def _flush(self, h: _Held) -> None:
        if self.own:
            summarise(h.items, self.own, h.dest)
        columns(h.items)
        # Values' buffers (tensors) ride out of band, zero copy, as they came.
        bufs = [pickle.PickleBuffer(b) for b in h.buffers]
        if h.parent:
            self.tree.keep(h.dest, h.parent, h.items, h.buffers)
            self.send_up(h.dest, h.parent, ("ub", h.dest, h.items, bufs))
        else:
            self.send_up(h.dest, "", ("rb", h.items, bufs))
        h.items, h.buffers, h.shown = [], [], 0

    def send_up(self, dest: str, parent: str, msg) -> None:
        try:
            if parent:
                self._send_to(parent, msg, None)
            else:
                contact = self.contacts[dest]
                self._send_to(addr_of(contact), msg, contact)
        except zmq.ZMQError as e:
            log.warning("could not send a batch of %d to %s: %s", len(msg[-2]), parent or dest, e)

    def _send_to(self, addr: str, msg, contact) -> None:
        """Sign ``msg`` for the inbox at ``addr`` (a controller, or an agent's fan inbox) and push it."""
        link = self.up_links.get(addr)
        if link is None:
            link = self.up_links[addr] = self._connect(addr, contact)
        agent = self.agent
        frames = agent.keyring.sign(agent.key, wire.dumps(msg), link[1])
        link[0].send_multipart(curve.chunked(frames) if addr[:4] == "tcp:" else frames, copy=False)   # tcp: capped

    def _connect(self, addr: str, contact) -> tuple[zmq.Socket, bytes]:
        s = self.agent.ctx.socket(zmq.PUSH)
        s.setsockopt(zmq.SNDHWM, 0)
        s.setsockopt(zmq.LINGER, 0)
        if contact is not None and len(contact) > 3 and contact[3] and addr == contact[0]:
            curve.connect(s, addr, contact[3])   # a controller's tcp inbox: its key comes apart
        else:
            curve.connect(s, addr)   # ipc, or an address that carries its key (agents' fan inboxes)
        return s, wire.dest_id(addr)


# -------------------------------------------------------------------- the proc's side


def real_address(reply_to):
    """A fanned call's reply_to without its mark (for response ports and direct sends)."""
    if type(reply_to) is str and reply_to.startswith(FAN_PREFIX):
        return reply_to[len(FAN_PREFIX):]
    return reply_to


def fanned(gather: str | None, reply_to) -> bool:
    return bool(gather) and type(reply_to) is str and reply_to.startswith(FAN_PREFIX)


_dumps = pickle.dumps


def send_fanned_reply(rt, gather: str, key: bytes, reply_to: str, call_id: int, proc_key: str, ok: bool,
                      value, unsendable, link=None) -> None:
    """A fanned call's reply, through the agent: the value pickled apart (see the module
    docstring), on the proc's fan link when it has one (``link``, fanlink.ProcLink), else
    signed to the gather inbox. ``unsendable(error)``: the ActorError to send when the value
    won't pickle."""
    dest = reply_to[len(FAN_PREFIX):]
    if link is not None:
        if type(value) in PLAIN_TYPES:
            link.send_reply(reply_to, call_id, ok, _dumps(value, 5))
            return
        try:
            vframes = wire.dumps(value, 1 if is_local(dest) else 0)
        except Exception as e:
            ok, vframes = False, wire.dumps(unsendable(e))
        link.send_reply(reply_to, call_id, ok, vframes[0], vframes[1:])
        return
    if type(value) in PLAIN_TYPES:
        # The usual reply (None, a number, a string): what call_one's lean reply does, through
        # the agent. A plain value pickles with pickle.dumps as with our picklers (wire.plain),
        # so both pickles are one C call each, and the message is signed in one pass.
        if rt.transport.send_plain_routed(gather, f"{dest}\0{call_id}".encode(), key,
                                          ("rv", call_id, proc_key, ok, _dumps(value, 5), [])):
            return
    dest_is_local = is_local(dest)
    try:
        vframes = wire.dumps(value, 1 if dest_is_local else 0)
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
        return f"{sink_addr}\0{busy_call[1]}".encode()   # the call: which way it goes up (a tree)
    return None
