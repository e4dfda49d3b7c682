"""The per-process runtime: sockets, the I/O thread, pending calls, proc liveness.

Concurrency story (the only one in this package):
  * One I/O thread per process owns the *inbox* (a PULL socket every reply, output line
    and notice is sent to) and the DEALER links to host agents. It resolves Futures.
  * Any thread may *send*: each thread has its own PUSH socket per destination address
    (zmq sockets are not thread-safe), so messages from one sender thread to one
    destination arrive in order.
  * Other threads hand the I/O thread work (agent requests) through ``call_in_io``,
    which queues a function and writes a byte to a wake pipe.
Liveness of procs comes from their host agent (waitpid), never from Python heartbeats;
agents heartbeat the controller so a lost host is declared after ``host_timeout``.
"""
from __future__ import annotations

import collections
import itertools
import logging
import os
import sys
import threading
import time
import uuid
from typing import Callable, NamedTuple

import zmq

from . import curve, extensions, wire
from .errors import ActorError, HostUnreachableError, MeshFailure, SupervisionError
from .future import _PENDING as _PENDING_STATE
from .future import Future
from .host_liveness import LocalAgentWatch

log = logging.getLogger("monarch_kernel")

_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)   # plain ints: the enums cost on the hot path
HEARTBEAT_S = float(os.environ.get("MONARCH_KERNEL_HEARTBEAT_S", "0.5"))
HOST_TIMEOUT_S = float(os.environ.get("MONARCH_KERNEL_HOST_TIMEOUT_S", "3.0"))
# Same-host peers talk over ipc; 0 forces tcp (to measure the tcp path, e.g. with CURVE, on one host).
SAME_HOST_IPC = os.environ.get("MONARCH_KERNEL_SAME_HOST_IPC", "1") != "0"


class ProcRef(NamedTuple):
    """Where one proc lives. ``key`` is unique across meshes and respawns."""

    key: str
    rank: int
    host: str
    pid: int
    work: str   # the proc's work inbox (its main thread: calls, spawns, cells)
    ctrl: str   # the proc's runtime inbox (its I/O thread: replies, interrupts, notices)
    agent: str  # address of the host agent that owns it
    work_ipc: str = ""   # the same inboxes over ipc, for senders on the same host
    ctrl_ipc: str = ""
    host_id: str = ""    # which host (machine and network namespace) these ipc names live on
    curve: str = ""      # the proc's CURVE public key when its tcp inboxes leave the host (curve.py)


class PendingCall:
    """Collects the replies of one call. ``mode``: 'mesh' -> ValueMesh, 'one' -> value,
    'stream' -> items pushed to ``queue`` as they arrive."""

    __slots__ = ("future", "keys", "index", "results", "failed", "remaining", "extent", "mode",
                 "queue", "what", "answered")

    def __init__(self, keys: list[str], extent, mode: str, what: str):
        self.future = Future(what)
        self.keys = keys
        self.index = {k: i for i, k in enumerate(keys)}
        self.results = [None] * len(keys)
        self.answered = bytearray(len(keys))   # 1 where that member replied (a value may be None)
        self.failed: list[int] = []
        self.remaining = len(keys)
        self.extent = extent
        self.mode = mode
        self.queue = None
        self.what = what
        if mode == "stream":
            import queue

            self.queue = queue.SimpleQueue()

    def deliver(self, key: str, ok: bool, value) -> bool:
        """Record one member's reply; True once every member has answered (or died)."""
        i = self.index.get(key)
        if i is None or self.answered[i]:
            return False   # unknown, or already answered (a death after its reply changes nothing)
        self.results[i] = value
        self.answered[i] = 1
        self.remaining -= 1
        if not ok:
            self.failed.append(i)
            if isinstance(value, SupervisionError) and self.future._state is _PENDING_STATE:
                # A dead member fails the whole call now, not when the others finish; their
                # replies are still recorded (a cell keeps their values, see answered_so_far).
                if self.queue is not None:
                    self.queue.put((False, value))
                    self.queue.put(None)
                self.future.set_exception(value)
                return self.remaining <= 0
        if self.future._state is not _PENDING_STATE:
            return self.remaining <= 0   # failed earlier by a death: only recorded
        if self.queue is not None:
            self.queue.put((ok, value))
        if self.remaining:
            return False
        self._finish()
        return True

    def _finish(self):
        if self.mode == "one":
            if self.failed:
                self.future.set_exception(self.results[0])
            else:
                self.future.set_result(self.results[0])
            return
        from .values import ValueMesh

        mesh = ValueMesh(self.extent, self.results)
        if self.failed:
            first = self.results[min(self.failed)]
            if isinstance(first, ActorError):
                first.results = mesh
            self.future.set_exception(first)
        else:
            self.future.set_result(mesh)
        if self.queue is not None:
            self.queue.put(None)




class AgentLink:
    """The I/O thread's DEALER to one host agent, with request ids and heartbeats."""

    def __init__(self, rt: Runtime, addr: str, key: bytes):
        self.addr = addr
        self.key = key
        self.sock = rt.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        ident = wire.new_identity()   # the agent's replies are addressed to it (wire.dest_of_identity)
        self.sock.setsockopt(zmq.ROUTING_ID, ident)
        rt.keyring.accept(f"agent {addr}", wire.dest_of_identity(ident))
        curve.connect(self.sock, addr, curve.agent_keys(key)[0] if curve.wanted(addr) else None)
        self.requests: dict[int, Future] = {}
        self.last_seen = time.monotonic()
        self.last_hb_sent = 0.0
        self.unanswered = 0    # heartbeats sent since the agent was last heard
        self.watched = False   # heartbeat it and declare it lost on silence
        self.lost = False      # silent past HOST_TIMEOUT_S; heartbeats go on, so it can come back
        self.lost_since = 0.0
        self.lost_errors: dict[str, SupervisionError] = {}   # procs failed because of the silence
        self.failed_while_lost: list[str] = []   # what failed because of it (calls, requests)
        self.pid: int | None = None   # the agent's pid when it runs on this machine
        self.os_watch: LocalAgentWatch | None = None   # then: is its silence load? (host_liveness.py)
        self.host = ""

    def describe_loss(self, now: float) -> str:
        if self.pid and not _pid_alive(self.pid):
            return f"the agent of host {self.host or self.addr} (pid {self.pid}) is gone"
        return (f"host {self.host or self.addr} has not answered for {now - self.lost_since:.1f} s; "
                "requests to it fail until it answers again")


class Runtime:
    def __init__(self, bind_host: str | None = None, role: str = "controller"):
        # Loopback unless asked: a controller driving other hosts must bind where their
        # procs can reach it (MONARCH_KERNEL_BIND=10.0.0.5, or the launcher passes it).
        bind_host = bind_host or os.environ.get("MONARCH_KERNEL_BIND") or "127.0.0.1"
        self.pid = os.getpid()
        self.forks = _FORKS[0]
        self.role = role
        self.ident = uuid.uuid4().hex[:12]
        self.ctx = zmq.Context()
        self.keyring = wire.Keyring()
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.setsockopt(zmq.RCVHWM, 0)
        self.inbox.setsockopt(zmq.LINGER, 0)
        self.inbox.setsockopt(zmq.HANDSHAKE_IVL, 5000)   # peers that never greet are dropped
        self.curve_public = curve.process_keys()[0].decode() if curve.wanted(bind_host) else ""
        self.address = curve.with_key(curve.bind(self.inbox, f"tcp://{bind_host}:*",
                                                 curve.process_keys()[1] if self.curve_public else None),
                                      self.curve_public)
        self.curve_servers: dict[str, str] = {}   # tcp address -> its CURVE public key (curve.py)
        # Peers on this host reach the inbox over ipc (an abstract socket: no file to leak,
        # scoped to this network namespace), 5-30 us quicker a round trip than tcp here.
        self.host_id = host_id()
        self.ipc_address = ipc_name("inbox")
        self.inbox.bind(self.ipc_address)
        self.keyring.accept("inbox", wire.dest_id(self.address), wire.dest_id(self.ipc_address))
        self.ipc_alias: dict[str, str] = {}   # tcp address -> ipc address, for same-host peers
        self.contact = [self.address, self.ipc_address, self.host_id, self.curve_public]   # how peers reach us
        self.bind_host = bind_host
        self._tls = threading.local()
        self._all_senders: list[zmq.Socket] = []
        self._retired: dict[str, int] = {}   # address of a forgotten proc -> generation (forget_procs)
        self._retired_gen = 0
        self._pending: dict[int, PendingCall] = {}
        self._ids = itertools.count(1)
        self.outstanding: collections.Counter = collections.Counter()
        self.dead: dict[str, SupervisionError] = {}
        self.procs: dict[str, tuple[ProcRef, bytes]] = {}   # every proc this process knows
        self.agents: dict[str, AgentLink] = {}
        self.outages: list[dict] = []   # hosts that were silent and came back (see _host_back)
        self._tasks: collections.deque = collections.deque()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._unhandled: list[BaseException] = []
        self._closing = False
        # Inbox hand-off (see wait_for): whoever holds _inbox_lock reads the inbox.
        self._inbox_lock = threading.Lock()
        self._inbox_holder: int | None = None      # thread ident of the reader
        self._inbox_wanted = 0                     # user threads that want to read it
        self._want_lock = threading.Lock()
        self._inbox_released_at = 0.0
        # Set by a proc worker: (work socket, handler) its main thread serves while it waits.
        self.nested_work: tuple | None = None
        self.nested_thread: int | None = None
        self.handlers: dict[str, Callable] = {
            "r": self._on_result, "out": self._on_output, "died": self._on_died,
            "unhandled": self._on_unhandled, "replaced": self._on_replaced, "wake": _ignore,
        }
        self.agent_event_handlers: dict[str, Callable] = {"died": self._on_agent_died}
        self.output: Callable[[int, str, str], None] = _print_output
        self.death_listeners: list[Callable[[str, SupervisionError], None]] = []
        self.replace_listeners: list[Callable[[str, ProcRef], None]] = []
        self.mesh_states: dict = {}   # proc mesh id -> ProcMeshState known here
        # The debugger's console (issue 5): a thread blocked in Future.get() runs
        # ``wait_hook[1]()`` when it is that hook's thread (``wait_hook[0]``, a thread ident)
        # and a handler set ``wait_hook_due``. It runs inside get(), with the inbox handed back
        # to the I/O thread, so it may block (input()) and wait on other futures.
        self.wait_hook: tuple[int, Callable[[], None]] | None = None
        self.wait_hook_due = False
        self._thread = threading.Thread(target=self._io_loop, name="monarch-io", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------- sending (any thread)
    def _sender(self, addr: str) -> zmq.Socket:
        tls = self._tls
        socks = getattr(tls, "socks", None)
        if socks is None:
            socks = tls.socks = {}
            tls.retired_seen = self._retired_gen
        elif tls.retired_seen != self._retired_gen:
            self._close_retired(tls)
        # Keyed by where we really connect: a tcp port can be reused by a new proc on this
        # host with a new ipc name, and a socket cached by the tcp address would still send
        # to the old one.
        target = self.ipc_alias.get(addr, addr)
        s = socks.get(target)
        if s is None:
            s = self.ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.SNDHWM, 0)
            s.setsockopt(zmq.LINGER, 2000)
            curve.connect(s, target, self.curve_servers.get(target))   # CURVE only on tcp that leaves the host
            socks[target] = s
            self._all_senders.append(s)
        return s

    def forget_procs(self, refs) -> None:
        """Procs that were stopped or replaced: every thread closes its sockets to them (on
        its next send; sockets are not thread-safe), so a spawn/stop cycle leaks no fd."""
        retired = self._retired
        self._retired_gen += 1
        gen = self._retired_gen
        for r in refs:
            self.procs.pop(r.key, None)
            for a in (r.work, r.ctrl, r.work_ipc, r.ctrl_ipc):
                if a:
                    retired[a] = gen
            self.ipc_alias.pop(r.work, None)
            self.ipc_alias.pop(r.ctrl, None)
        while len(retired) > 4096:   # oldest first: every thread has long seen them
            del retired[next(iter(retired))]
        self.call_in_io(lambda: self._close_retired(self._tls) if hasattr(self._tls, "socks") else None)

    def _close_retired(self, tls) -> None:
        seen, retired, socks = tls.retired_seen, self._retired, tls.socks
        tls.retired_seen = self._retired_gen
        for target in [t for t in socks if retired.get(t, 0) > seen]:
            s = socks.pop(target)
            try:
                self._all_senders.remove(s)
            except ValueError:
                pass
            s.close(0)

    def pack(self, key: bytes, msg, dests=()) -> wire.Sealed:
        """Pickle ``msg`` and MAC its body; ``send_frames`` stamps it for each destination.
        ``dests``: the addresses it will be sent to; when all are on this host, large tensors
        may travel as same-host handles (wire.LARGE_TENSOR_HOOK)."""
        local = len(dests) if dests and wire.LARGE_TENSOR_HOOK is not None and all(map(is_local, dests)) else 0
        return self.keyring.seal(key, wire.dumps(msg, local))

    def pack_to(self, addr: str, key: bytes, msg) -> list:
        """The frames of ``msg`` for the one socket at ``addr`` (an agent link's requests)."""
        return self.keyring.sign(key, wire.dumps(msg), wire.dest_id(addr))

    def send_frames(self, addr: str, frames: list) -> None:
        if type(frames) is wire.Sealed:   # bound to this destination (no replay to another socket)
            frames = self.keyring.stamp(frames, wire.dest_id(addr))
        if len(frames) == 1:
            self._sender(addr).send(frames[0])   # small header: a copy beats a zero-copy Frame
        else:
            self._sender(addr).send_multipart(frames, copy=False)

    def send(self, addr: str, key: bytes, msg) -> None:
        self.send_frames(addr, self.pack(key, msg))

    def new_call(self, keys: list[str], extent, mode: str, what: str) -> tuple[int, PendingCall]:
        call_id = next(self._ids)
        p = PendingCall(keys, extent, mode, what)
        p.future._waiter = self.wait_for
        self._pending[call_id] = p
        out = self.outstanding
        for k in keys:
            out[k] += 1
        return call_id, p

    def pending_of(self, fut: Future) -> PendingCall | None:
        """The PendingCall behind a call's future (while it has members to hear from)."""
        for p in list(self._pending.values()):
            if p.future is fut:
                return p
        return None

    def answered_so_far(self, fut: Future) -> list | None:
        """For a call still pending: per member, (True, value) if it replied, else (False,
        None). Lets a caller that gives up keep what the members that did answer returned."""
        for p in list(self._pending.values()):
            if p.future is fut:
                return [(bool(a), v) for a, v in zip(p.answered, p.results)]
        return None

    def abandon(self, call_id: int) -> None:
        p = self._pending.pop(call_id, None)
        if p is not None:
            for k in p.keys:
                self.outstanding[k] -= 1

    # ---------------------------------------------------------------- failures and notices
    def raise_unhandled(self) -> None:
        """Unhandled supervision failures surface on the next interaction, once."""
        if self._unhandled:
            err = self._unhandled.pop(0)
            raise err

    def proc_failed(self, key: str, failure: MeshFailure, hint: str = "") -> None:
        """A proc is gone: fail every future waiting on it (any thread)."""
        if key in self.dead:
            return
        err = SupervisionError(failure, hint or "Call respawn() on its ProcMesh to replace it; "
                                                "the other ranks keep their state")
        self.dead[key] = err
        for call_id, p in list(self._pending.items()):
            if key in p.index and p.deliver(key, False, err):
                self._pending.pop(call_id, None)
        for fn in list(self.death_listeners):
            try:
                fn(key, err)
            except Exception:
                log.exception("death listener failed")
        self._wake_inbox_reader()

    def _wake_inbox_reader(self) -> None:
        """A user thread blocked on the inbox in wait_for must re-check its future."""
        holder = self._inbox_holder
        if holder is not None and holder != threading.get_ident():
            self.send(self.address, next(iter(self.keyring._keys.values())), ("wake",))

    def listen_on(self, host: str) -> str:
        """Also accept on ``tcp://host:*`` and give that address to peers from now on.

        A job's launcher calls it with the local address that routes to the job's hosts
        (a notebook's runtime starts on loopback, before any job exists). Procs and agents
        that already know the old address keep using it: it stays bound. The inbox is
        taken over as ``wait_for`` does, so no other thread touches the socket meanwhile.
        """
        if host == self.bind_host:
            return self.address
        with self._want_lock:
            self._inbox_wanted += 1
        try:
            while not self._inbox_lock.acquire(timeout=0.002):
                if self._inbox_holder == self._thread.ident:
                    os.write(self._wake_w, b"i")
            try:
                pub = curve.process_keys()[0].decode() if curve.wanted(host) else ""
                addr = curve.with_key(curve.bind(self.inbox, f"tcp://{host}:*",
                                                 curve.process_keys()[1] if pub else None), pub)
            finally:
                self._inbox_lock.release()
        finally:
            with self._want_lock:
                self._inbox_wanted -= 1
        self.keyring.accept("inbox", wire.dest_id(addr))
        self.address, self.bind_host, self.curve_public = addr, host, pub
        self.contact = [addr, self.ipc_address, self.host_id, pub]
        return addr

    def register_procs(self, refs, key: bytes) -> None:
        self.keyring.add(key)
        for r in refs:
            self.procs[r.key] = (r, key)
            for a in (r.work, r.ctrl, r.work_ipc, r.ctrl_ipc):   # a reused port is live again
                self._retired.pop(a, None)
            if r.host_id and r.host_id == self.host_id and r.work_ipc and SAME_HOST_IPC:
                self.ipc_alias[r.work] = r.work_ipc
                self.ipc_alias[r.ctrl] = r.ctrl_ipc
            if getattr(r, "curve", ""):
                self.curve_servers[r.work] = self.curve_servers[r.ctrl] = r.curve

    def learn_contact(self, contact):
        """A peer's ``contact`` ([tcp, ipc, host id], or a bare address) -> its tcp address,
        remembering the ipc alias when the peer shares our host."""
        if isinstance(contact, (list, tuple)):
            addr, ipc, hid = contact[:3]
            if ipc and hid == self.host_id and SAME_HOST_IPC:
                self.ipc_alias[addr] = ipc
            if len(contact) > 3 and contact[3]:
                self.curve_servers[addr] = contact[3]
            return addr
        return contact

    # ----------------------------------------------------------------- waiting on the inbox
    def wait_for(self, fut: Future, timeout: float | None) -> None:
        """Called by ``Future.get`` on a pending future: read the inbox in this thread until
        ``fut`` is done, so its reply wakes this thread directly.

        Leader/follower: the inbox is read by whoever holds ``_inbox_lock`` (a mutex is the
        full memory barrier zmq asks for to move a socket between threads). The I/O thread
        holds it only while nobody waits and gives it up when kicked through the wake pipe;
        a second waiting thread leaves the inbox to the first and waits on its future.
        """
        me = threading.get_ident()
        if threading.current_thread() is self._thread or self._inbox_holder == me:
            return  # re-entrant (a handler waiting): fall back to the plain wait
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._want_lock:
            self._inbox_wanted += 1
        try:
            while fut._state is _PENDING_STATE:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise fut._timeout_error(timeout)
                if self._inbox_lock.acquire(blocking=False) or self._inbox_lock.acquire(timeout=0.002):
                    self._inbox_holder = me
                    try:
                        self._pump(fut, deadline, timeout)
                    finally:
                        self._inbox_holder = None
                        self._inbox_lock.release()
                    hook = self.wait_hook
                    if self.wait_hook_due and hook is not None and hook[0] == me and fut._state is _PENDING_STATE:
                        self._run_wait_hook(hook[1])
                        continue
                    return
                holder = self._inbox_holder
                if holder == self._thread.ident:
                    os.write(self._wake_w, b"i")   # kick the I/O thread out of its poll
                elif holder is not None:
                    fut._wait_briefly(0.01 if left is None else min(0.01, left))
        finally:
            with self._want_lock:
                self._inbox_wanted -= 1
            self._inbox_released_at = time.monotonic()

    def _run_wait_hook(self, fn: Callable[[], None]) -> None:
        """Run the wait hook with the inbox left to the I/O thread (see ``wait_hook``)."""
        self.wait_hook_due = False
        with self._want_lock:
            self._inbox_wanted -= 1
        self._inbox_released_at = time.monotonic()
        try:
            fn()
        finally:
            with self._want_lock:
                self._inbox_wanted += 1

    def _pump(self, fut: Future, deadline, timeout) -> None:
        inbox, opener, dispatch, recv = self.inbox, self.keyring.open, self._dispatch, wire.recv_message
        events, POLLIN, zpoll, poll_in = _EVENTS, _POLLIN, zmq.zmq_poll, [(self.inbox, _POLLIN)]
        if self.nested_work is not None and threading.get_ident() == self.nested_thread:
            return self._pump_nested(fut, deadline, timeout)
        while fut._state is _PENDING_STATE:
            if self.wait_hook_due:
                hook = self.wait_hook
                if hook is not None and hook[0] == threading.get_ident():
                    return
            if not inbox.getsockopt(events) & POLLIN:
                if not zpoll(poll_in, _ms_left(deadline, fut, timeout)):
                    continue
            msg = opener(recv(inbox), "inbox")
            if msg is not None and type(msg) is tuple:
                dispatch(msg)

    def _pump_nested(self, fut: Future, deadline, timeout) -> None:
        """A proc's main thread waiting inside an endpoint: besides its replies, take work
        from its own work inbox (``nested_work``: (socket, handler)), so a sync endpoint can
        call another actor of its own proc without deadlocking."""
        inbox, opener, dispatch, recv = self.inbox, self.keyring.open, self._dispatch, wire.recv_message
        work, handle = self.nested_work
        events, POLLIN = _EVENTS, _POLLIN
        poller = zmq.Poller()
        poller.register(inbox, POLLIN)
        poller.register(work, POLLIN)
        while fut._state is _PENDING_STATE:
            if inbox.getsockopt(events) & POLLIN:
                msg = opener(recv(inbox), "inbox")
                if msg is not None and type(msg) is tuple:
                    dispatch(msg)
                continue
            if work.getsockopt(events) & POLLIN:
                handle(recv(work))
                continue
            poller.poll(_ms_left(deadline, fut, timeout))

    # ----------------------------------------------------------------- agent links (I/O)
    def call_in_io(self, fn: Callable[[], None]) -> None:
        if threading.current_thread() is self._thread:
            fn()
            return
        self._tasks.append(fn)
        os.write(self._wake_w, b"x")

    def agent_request(self, addr: str, key: bytes, op: str, *args, timeout_what: str = "") -> Future:
        """Send ``op`` to the agent at ``addr``; the Future gets its reply."""
        fut = Future(timeout_what or f"agent {op}")

        def go():
            link = self._link(addr, key)
            if link.lost:
                # A silent host answers nothing: fail now, not after the caller's timeout.
                fut.set_exception(HostUnreachableError(link.describe_loss(time.monotonic())))
                return
            req = next(self._ids)
            link.requests[req] = fut
            link.sock.send_multipart(self.pack_to(addr, key, ("req", req, op, args)), copy=False)

        self.call_in_io(go)
        return fut

    def agent_send(self, addr: str, key: bytes, op: str, *args) -> None:
        """Fire-and-forget to an agent (no reply expected)."""
        self.call_in_io(lambda: self._link(addr, key).sock.send_multipart(
            self.pack_to(addr, key, ("req", 0, op, args)), copy=False))

    def watch_agent(self, addr: str, key: bytes, pid: int | None = None, host: str = "") -> None:
        """Heartbeat the agent at ``addr``; ``pid``: its pid when it runs on this machine, so
        its death is seen at once rather than after HOST_TIMEOUT_S of silence."""
        def go():
            link = self._link(addr, key)
            link.watched = True
            link.last_seen = time.monotonic()
            link.pid, link.host = pid, host
            link.os_watch = LocalAgentWatch(pid) if pid else None
        self.call_in_io(go)

    def _link(self, addr: str, key: bytes) -> AgentLink:
        link = self.agents.get(addr)
        if link is None:
            self.keyring.add(key)
            link = self.agents[addr] = AgentLink(self, addr, key)
            self._poller.register(link.sock, zmq.POLLIN)
            self._poller_in.register(link.sock, zmq.POLLIN)
        return link

    def forget_agent(self, addr: str) -> None:
        def go():
            link = self.agents.pop(addr, None)
            if link is not None:
                self._poller.unregister(link.sock)
                self._poller_in.unregister(link.sock)
                link.sock.close(0)
        self.call_in_io(go)

    # ----------------------------------------------------------------- the I/O thread
    def _io_loop(self):
        """Poll agents and the wake pipe always; the inbox only while no user thread waits
        on it (and not within 1 ms of one letting go, so back-to-back calls don't churn)."""
        self._poller = poller = zmq.Poller()           # without the inbox
        self._poller_in = poller_in = zmq.Poller()     # with it
        poller_in.register(self.inbox, zmq.POLLIN)
        for p in (poller, poller_in):
            p.register(self._wake_r, zmq.POLLIN)
        inbox, opener, lock = self.inbox, self.keyring.open, self._inbox_lock
        me = threading.get_ident()
        next_tick = 0.0
        while not self._closing:
            have = False
            if not self._inbox_wanted and time.monotonic() - self._inbox_released_at > 0.001:
                have = lock.acquire(blocking=False)
                if have and self._inbox_wanted:
                    lock.release()
                    have = False
            try:
                if have:
                    self._inbox_holder = me
                events = (poller_in if have else poller).poll(100 if have or not self._inbox_wanted_recently()
                                                              else 2)
            except zmq.ZMQError:
                if have:
                    self._inbox_holder = None
                    lock.release()
                if self._closing:
                    return
                raise
            try:
                for sock, _ in events:
                    if sock is inbox:
                        for _ in range(10_000):
                            if not inbox.getsockopt(_EVENTS) & _POLLIN:
                                break
                            msg = opener(wire.recv_message(inbox), "inbox")
                            if msg is not None and type(msg) is tuple:
                                self._dispatch(msg)
                    elif sock == self._wake_r:
                        try:
                            os.read(self._wake_r, 4096)
                        except BlockingIOError:
                            pass
                        while self._tasks:
                            fn = self._tasks.popleft()
                            try:
                                fn()
                            except Exception:
                                log.exception("I/O task failed")
                    else:
                        self._on_agent_socket(sock)
            finally:
                if have:
                    self._inbox_holder = None
                    lock.release()
            now = time.monotonic()
            if now >= next_tick:
                next_tick = now + HEARTBEAT_S / 2
                self._tick(now)

    def _inbox_wanted_recently(self) -> bool:
        return bool(self._inbox_wanted) or time.monotonic() - self._inbox_released_at <= 0.001

    def _dispatch(self, msg):
        h = self.handlers.get(msg[0]) or extensions.message_handler(msg[0])
        if h is None:
            log.warning("dropped a message of unknown kind %r", msg[0])
            return
        try:
            h(msg)
        except Exception:
            log.exception("handler for %r failed", msg[0])

    def _on_result(self, msg):
        _, call_id, key, ok, value = msg
        p = self._pending.get(call_id)
        if p is None:
            return
        self.outstanding[key] -= 1
        if p.deliver(key, ok, value):
            self._pending.pop(call_id, None)

    def _on_output(self, msg):
        _, rank, stream, text = msg
        self.output(rank, stream, text)

    def _on_died(self, msg):
        _, key, failure = msg
        self.proc_failed(key, failure)

    def _on_replaced(self, msg):
        _, old_key, ref, key = msg
        self.register_procs([ref], key)
        for fn in list(self.replace_listeners):
            fn(old_key, ref)

    def _on_unhandled(self, msg):
        from .supervision import deliver_unhandled, failure_of

        err = msg[1]
        deliver_unhandled(failure_of(err), err, seen=len(msg) > 2 and bool(msg[2]),
                          mesh_id=msg[3] if len(msg) > 3 else None)

    def _on_agent_socket(self, sock):
        link = next((lk for lk in self.agents.values() if lk.sock is sock), None)
        if link is None:
            return
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            msg = self.keyring.open(frames, f"agent {link.addr}")
            if msg is None or type(msg) is not tuple:
                continue
            link.last_seen = time.monotonic()
            link.unanswered = 0
            if link.lost:
                self._host_back(link, link.last_seen)
            if msg[0] == "rep":
                _, req, ok, value = msg
                fut = link.requests.pop(req, None)
                if fut is not None:
                    (fut.set_result if ok else fut.set_exception)(value)
            elif msg[0] == "ev":
                h = self.agent_event_handlers.get(msg[1])
                if h is not None:
                    try:
                        h(link, *msg[2:])
                    except Exception:
                        log.exception("agent event %r failed", msg[1])

    def _on_agent_died(self, link, key, failure):
        self.proc_failed(key, failure)

    def _tick(self, now):
        for link in list(self.agents.values()):
            if not link.watched:
                continue
            if now - link.last_hb_sent >= HEARTBEAT_S:
                # A lost link is heartbeaten too: a host that answers again comes back.
                link.last_hb_sent = now
                link.unanswered += 1
                link.sock.send_multipart(self.pack_to(link.addr, link.key, ("req", 0, "hb", (self.address,))),
                                        copy=False)
            if link.lost:
                continue
            silent = now - link.last_seen
            gone = link.pid is not None and silent > HEARTBEAT_S and not _pid_alive(link.pid)
            # A same-machine agent that wants the CPU is starved, not lost (host_liveness.py).
            load = not gone and silent > HEARTBEAT_S and link.os_watch is not None and \
                link.os_watch.silence_is_load(now, silent)
            # Silence counts only if we really asked: an I/O thread starved of the GIL (a long
            # pickle on the main thread) sent no heartbeats and must not declare a host lost.
            if gone or (silent > HOST_TIMEOUT_S and link.unanswered >= 4 and not load):
                link.lost = True
                link.lost_since = link.last_seen
                self._host_lost(link, now - link.last_seen, gone)

    def mesh_name_of(self, key: str) -> str:
        for st in self.mesh_states.values():
            if any(r.key == key for r in st.procs):
                return st.name
        return "?"

    def _host_lost(self, link: AgentLink, silent_s: float, gone: bool = False):
        why = (f"its agent (pid {link.pid}) is gone" if gone
               else f"its agent {link.addr} was silent for {silent_s:.1f} s")
        log.error("host %s: %s; failing what waits on it", link.host or link.addr, why)
        link.failed_while_lost = []
        for fut in list(link.requests.values()):
            link.failed_while_lost.append(fut._what)
            fut.set_exception(HostUnreachableError(f"host agent {link.addr} is unreachable: {why}"))
        link.requests.clear()
        hint = ("The whole host is gone: stop this mesh and spawn a new one (this_host(name) starts a "
                "new agent)" if gone else
                "Its procs may only be stalled: if the host answers again they come back with their "
                "state; if not, stop the mesh and spawn a new one")
        before = {id(p): p.what for p in self._pending.values()}
        link.lost_errors = {}
        for key, (ref, _) in list(self.procs.items()):
            if ref.agent == link.addr and key not in self.dead:
                self.proc_failed(key, MeshFailure(self.mesh_name_of(key), ref.rank, ref.host, ref.pid,
                                                  f"host lost: {why}", key), hint=hint)
                link.lost_errors[key] = self.dead[key]
        after = {id(p) for p in self._pending.values()}
        link.failed_while_lost.extend(w for i, w in before.items() if i not in after)

    def _host_back(self, link: AgentLink, now: float):
        """A host declared lost answers again: its procs were never dead. Un-fail them, say
        what failed in between, and hello again (the agent may have detached us meanwhile;
        its answer lists the procs that really died)."""
        silent = now - link.lost_since
        link.lost = False
        back = [k for k, err in link.lost_errors.items() if self.dead.get(k) is err]
        for k in back:
            del self.dead[k]
        link.lost_errors = {}
        failed = link.failed_while_lost
        link.failed_while_lost = []
        report = {"agent": link.addr, "host": link.host, "silent_s": round(silent, 1), "procs_back": len(back),
                  "failed": failed}
        self.outages.append(report)
        log.warning("host %s answered again after %.1f s of silence: %d proc(s) back with their state; "
                    "failed meanwhile: %s", link.host or link.addr, silent, len(back),
                    ", ".join(failed) if failed else "nothing")
        fut = Future("hello")
        req = next(self._ids)
        link.requests[req] = fut
        link.sock.send_multipart(self.pack_to(link.addr, link.key, ("req", req, "hello", (self.contact,))),
                                copy=False)

        def died_meanwhile(f):
            if f.exception() is not None:
                return
            for key in f.get().get("dead", {}):
                ref = self.procs.get(key, (None,))[0]
                if ref is not None:
                    self.proc_failed(key, MeshFailure(self.mesh_name_of(key), ref.rank, ref.host, ref.pid,
                                                      "proc died while its host was unreachable", key))
        fut.add_done_callback(died_meanwhile)

    # ----------------------------------------------------------------- shutdown
    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        os.write(self._wake_w, b"x")
        if threading.current_thread() is not self._thread:
            self._thread.join(2)
        self.ctx.destroy(linger=500)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _ms_left(deadline: float | None, fut: Future, timeout) -> int:
    """Milliseconds to poll before ``deadline`` (-1: no deadline); past it, the timeout."""
    if deadline is None:
        return -1
    ms = int((deadline - time.monotonic()) * 1000)
    if ms <= 0:
        raise fut._timeout_error(timeout)
    return ms


_HOST_ID: str | None = None


def host_id() -> str:
    """This machine (boot id) and network namespace: where an abstract ipc name resolves."""
    global _HOST_ID
    if _HOST_ID is None:
        try:
            with open("/proc/sys/kernel/random/boot_id") as f:
                boot = f.read().strip()
            _HOST_ID = f"{boot}:{os.stat('/proc/self/ns/net').st_ino}"
        except OSError:
            _HOST_ID = ""
    return _HOST_ID


_PID_SPACE: str | None = None


def pid_space() -> str:
    """This machine (boot id) and pid namespace: where a pid names the same process."""
    global _PID_SPACE
    if _PID_SPACE is None:
        try:
            with open("/proc/sys/kernel/random/boot_id") as f:
                _PID_SPACE = f"{f.read().strip()}:{os.stat('/proc/self/ns/pid').st_ino}"
        except OSError:
            _PID_SPACE = ""
    return _PID_SPACE


def ipc_name(what: str) -> str:
    return f"ipc://@monarch-kernel-{os.getpid()}-{what}-{uuid.uuid4().hex[:8]}"


def _ignore(msg) -> None:
    pass


def _print_output(rank: int, stream: str, text: str) -> None:
    out = sys.stderr if stream == "stderr" else sys.stdout
    prefix = f"[rank {rank}] "
    out.write("".join(prefix + line + "\n" for line in text.rstrip("\n").split("\n")))
    out.flush()


_LOCAL_ADDRS: dict[str, bool] = {}


def is_local(addr: str) -> bool:
    """Is a zmq address on this host (loopback, ipc, or one of this host's own addresses)?"""
    r = _LOCAL_ADDRS.get(addr)
    if r is None:
        host = addr.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
        if addr.startswith(("ipc://", "inproc://")) or host.startswith("127.") or host in ("localhost", "::1"):
            r = True
        else:
            try:
                import psutil

                r = any(a.address == host for addrs in psutil.net_if_addrs().values() for a in addrs)
            except Exception:
                r = False
        _LOCAL_ADDRS[addr] = r
    return r


_runtime: Runtime | None = None
_FORKS = [0]   # forks this process came from: a forked child makes its own runtime
os.register_at_fork(after_in_child=lambda: _FORKS.__setitem__(0, _FORKS[0] + 1))
_runtime_lock = threading.Lock()


def runtime() -> Runtime:
    """This process's runtime (created on first use; a forked child gets a new one)."""
    global _runtime
    rt = _runtime
    if rt is not None and rt.forks == _FORKS[0]:   # (os.getpid() is a system call, twice a call)
        return rt
    with _runtime_lock:
        if _runtime is None or _runtime.pid != os.getpid():
            _runtime = Runtime()
        return _runtime


def install_runtime(rt: Runtime) -> None:
    global _runtime
    _runtime = rt
