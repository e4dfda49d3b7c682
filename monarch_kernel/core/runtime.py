"""The per-process runtime: one object that puts the core's parts together.

Each concern lives in its own module, with a small API between them:
  * transport.py: messages out (signing, packing, per-thread sender sockets, addresses);
  * calls.py: calls in flight and dead procs (replies and deaths answer the same calls);
  * agent_links.py: links to host agents (requests, events, heartbeats, lost hosts);
  * inbox.py: the inbox, the I/O thread, who reads the inbox when, and the one
    concurrency story of the package (every thread is listed there).
``Runtime`` owns one of each and the kind -> handler table of inbox messages; the rest of
the package uses only its public methods. Liveness of procs comes from their host agent
(waitpid), never from Python heartbeats.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import uuid
from typing import Callable

import zmq

from .. import config
from . import extensions, wire
from .agent_links import HEARTBEAT_S, HOST_TIMEOUT_S, AgentLink, AgentLinks
from .calls import Calls, PendingCall
from .future import Future, describe_waits_with
from .inbox import Inbox
from .messages import Died, Output, Replaced, Replies, Reply, Unhandled, Wake
from .transport import (
    PROC_COPY_THRESHOLD,
    SAME_HOST_IPC,
    ProcRef,
    Transport,
    host_id,
    ipc_name,
    is_local,
    pid_alive,
    pid_space,
)

__all__ = ["HEARTBEAT_S", "HOST_TIMEOUT_S", "SAME_HOST_IPC", "AgentLink", "PendingCall", "ProcRef", "Runtime",
           "host_id", "install_runtime", "ipc_name", "is_local", "pid_alive", "pid_space", "runtime"]

log = logging.getLogger("monarch_kernel")


class Runtime:
    """This process's sockets, calls, agent links and handlers (see the module docstring)."""

    def __init__(self, bind_host: str | None = None, role: str = "controller"):
        # Loopback unless asked: a controller driving other hosts must bind where their
        # procs can reach it (MONARCH_KERNEL_BIND=10.0.0.5, or the launcher passes it).
        bind_host = bind_host or config.BIND.get() or "127.0.0.1"
        self.pid = os.getpid()
        self.forks = _FORKS[0]
        self.role = role
        self.ident = uuid.uuid4().hex[:12]
        self.ctx = zmq.Context()
        self.keyring = wire.Keyring()
        self._inbox = inbox = Inbox(self.ctx, self.keyring, bind_host)
        self.host_id = host_id()
        self.transport = transport = Transport(self.ctx, self.keyring, self.host_id, inbox.call_in_io,
                                               PROC_COPY_THRESHOLD if role == "proc" else None)
        self.calls = calls = Calls(inbox.wait_for, inbox.wake_reader)
        self._agents = AgentLinks(self, inbox.watch_socket, inbox.unwatch_socket)
        self.bind_host = bind_host
        self.address, self.ipc_address, self.curve_public = inbox.address, inbox.ipc_address, inbox.curve_public
        self.contact = [self.address, self.ipc_address, self.host_id, self.curve_public]   # how peers reach us
        self.addresses = {self.address}   # every address given as ours (listen_on adds one)
        # The hot paths, bound once (no extra call per message).
        self.send, self.send_frames, self.pack = transport.send, transport.send_frames, transport.pack
        self.pack_to, self.send_plain = transport.pack_to, transport.send_plain
        self.learn_contact = transport.learn_contact
        self.new_call, self.abandon, self.proc_failed = calls.new_call, calls.abandon, calls.proc_failed
        self.new_one = calls.new_one
        self.pending_of, self.answered_so_far = calls.pending_of, calls.answered_so_far
        self.raise_unhandled, self.has_unhandled = calls.raise_unhandled, calls.has_unhandled
        self.wait_for, self.call_in_io = inbox.wait_for, inbox.call_in_io
        self.outstanding, self.dead, self.death_listeners = calls.outstanding, calls.dead, calls.death_listeners
        self.agents, self.outages = self._agents.links, self._agents.outages
        self.agent_event_handlers = self._agents.event_handlers
        self.procs: dict[str, tuple[ProcRef, bytes]] = {}   # every proc this process knows
        self.mesh_states: dict = {}   # proc mesh id -> ProcMeshState known here
        self.handlers: dict[str, Callable] = {   # the core's kinds (messages.py names them all)
            Reply.KIND: calls.on_result, Replies.KIND: calls.on_replies, Output.KIND: self._on_output,
            Died.KIND: self._on_died, Unhandled.KIND: self._on_unhandled, Replaced.KIND: self._on_replaced,
            Wake.KIND: _ignore,
        }
        self.output: Callable[[int, str, str], None] = _print_output
        self.replace_listeners: list[Callable[[str, ProcRef], None]] = []
        self._once: set[str] = set()
        inbox.start(self._dispatch, self._agents, self._wake_self)

    # ----------------------------------------------------------------- handlers
    def on_message(self, kind: str, handler: Callable, *, replace: bool = False) -> None:
        """Handle inbox messages of ``kind`` with ``handler(msg)`` in this runtime (a role's
        own kinds: a proc's "interrupt", a notebook's "display"). Installing the same
        handler again does nothing; another one for a kind already handled is refused
        (``DuplicateRegistration``) unless ``replace`` says this role takes it over."""
        self._install(self.handlers, "message kind", kind, handler, replace)

    def on_agent_event(self, event: str, handler: Callable, *, replace: bool = False) -> None:
        """Handle agent events ``event`` with ``handler(link, *args)`` (I/O thread)."""
        self._install(self.agent_event_handlers, "agent event", event, handler, replace)

    def on_host_change(self, handler: Callable) -> None:
        """Call ``handler(agent address, lost)`` when a host is declared lost (True) or
        answers again (False), on the I/O thread, after its procs' futures were failed."""
        self._agents.host_hooks.append(handler)

    @staticmethod
    def _install(table: dict, what: str, kind: str, handler: Callable, replace: bool) -> None:
        have = table.get(kind)
        if have is not None and have != handler and not replace:
            extensions.refuse_duplicate(what, kind, have)
        table[kind] = handler

    def once(self, what: str) -> bool:
        """True the first time ``what`` is asked of this runtime (one-time set-up by handles)."""
        if what in self._once:
            return False
        self._once.add(what)
        return True

    def _dispatch(self, msg):
        h = self.handlers.get(msg[0]) or extensions.message_handler(msg[0])
        if h is None:
            log.warning("dropped a message of unknown kind %r", msg[0])
            return
        try:
            h(msg)
        except Exception:
            log.exception("handler for %r failed", msg[0])

    def _on_output(self, msg):
        m = Output.of(msg)
        self.output(m.rank, m.stream, m.text)

    def _on_died(self, msg):
        m = Died.of(msg)
        self.proc_failed(m.key, m.failure)

    def _on_replaced(self, msg):
        m = Replaced.of(msg)
        self.register_procs([m.ref], m.mesh_key)
        for fn in list(self.replace_listeners):
            fn(m.old_key, m.ref)

    def _on_unhandled(self, msg):
        from .supervision import deliver_unhandled, failure_of

        m = Unhandled.of(msg)
        deliver_unhandled(failure_of(m.error), m.error, seen=bool(m.seen), mesh_id=m.mesh_id)

    def _wake_self(self) -> None:
        self.send(self.address, self.keyring.any_key(), Wake.make())

    # ----------------------------------------------------------------- procs and peers
    def register_procs(self, refs, key: bytes) -> None:
        self.keyring.add(key)
        for r in refs:
            self.procs[r.key] = (r, key)
            self.transport.learn_proc(r)

    def forget_procs(self, refs) -> None:
        """Procs that were stopped or replaced (see Transport.forget)."""
        for r in refs:
            self.procs.pop(r.key, None)
        self.transport.forget(refs)

    def where(self, keys: set) -> dict[str, tuple[str, int]]:
        """key -> (its mesh's name, its rank) for those of ``keys`` this process knows (one
        pass over the meshes: a call to 256 may wait for 256 of them)."""
        out = {}
        for st in list(self.mesh_states.values()):
            for r in st.procs:
                if r.key in keys:
                    out[r.key] = (st.name, r.rank)
        return out

    def mesh_name_of(self, key: str) -> str:
        for st in self.mesh_states.values():
            if any(r.key == key for r in st.procs):
                return st.name
        return "?"

    def listen_on(self, host: str) -> str:
        """Also accept on ``tcp://host:*`` and give that address to peers from now on.

        A job's launcher calls it with the local address that routes to the job's hosts
        (a notebook's runtime starts on loopback, before any job exists). Procs and agents
        that already know the old address keep using it: it stays bound. Same-host peers
        keep reaching us over ipc or loopback whatever address they are handed later (the
        address carries our CURVE key, by which they know us: Transport.local_by_key).
        """
        if host == self.bind_host:
            return self.address
        addr, pub = self._inbox.bind_also(host)
        self.address, self.bind_host, self.curve_public = addr, host, pub
        self.addresses.add(addr)
        self.contact = [addr, self.ipc_address, self.host_id, pub]
        return addr

    # ----------------------------------------------------------------- unhandled failures
    def queue_unhandled(self, err: BaseException) -> None:
        self.calls.queue_unhandled(err)

    def consume_unhandled(self, err: BaseException) -> None:
        self.calls.consume_unhandled(err)

    def unhandled(self) -> list[BaseException]:
        return self.calls.unhandled()

    # ----------------------------------------------------------------- agents (any thread)
    @staticmethod
    def whoami() -> tuple[str, int]:
        """(pid space, pid): an agent in the same pid space can ask the OS whether this
        controller, when silent, is starved of CPU or gone (node/agent.py _controller_starved)."""
        return pid_space(), os.getpid()

    def agent_request(self, addr: str, key: bytes, op: str, *args, timeout_what: str = "") -> Future:
        """Send ``op`` to the agent at ``addr``; the Future gets its reply."""
        fut = Future(timeout_what or f"agent {op}")
        self.call_in_io(lambda: self._agents.request(addr, key, op, args, fut))
        return fut

    def agent_send(self, addr: str, key: bytes, op: str, *args) -> None:
        """Fire-and-forget to an agent (no reply expected)."""
        self.call_in_io(lambda: self._agents.send(addr, key, op, args))

    def watch_agent(self, addr: str, key: bytes, pid: int | None = None, host: str = "") -> None:
        """Heartbeat the agent at ``addr``; ``pid``: its pid when it runs on this machine, so
        its death is seen at once rather than after HOST_TIMEOUT_S of silence."""
        self.call_in_io(lambda: self._agents.watch(addr, key, pid, host))

    def forget_agent(self, addr: str) -> None:
        self.call_in_io(lambda: self._agents.forget(addr))

    # ----------------------------------------------------------------- waiting (see inbox.py)
    def serve_work_while_waiting(self, work_sock, handler: Callable, also=None, after=None) -> None:
        self._inbox.serve_work_while_waiting(work_sock, handler, also, after)

    @property
    def wait_hook(self):
        """(thread ident, fn) that a thread blocked in Future.get runs when asked, or None."""
        return self._inbox.wait_hook

    def set_wait_hook(self, hook):
        """Set the wait hook (or None); returns the previous one."""
        return self._inbox.set_wait_hook(hook)

    def want_wait_hook(self) -> None:
        self._inbox.want_wait_hook()

    def is_io_thread(self) -> bool:
        return self._inbox.is_io_thread()

    # ----------------------------------------------------------------- shutdown
    def close(self) -> None:
        if self._inbox.close():
            self.ctx.destroy(linger=500)


def _ignore(msg) -> None:
    pass


def _print_output(rank: int, stream: str, text: str) -> None:
    out = sys.stderr if stream == "stderr" else sys.stdout
    prefix = f"[rank {rank}] "
    out.write("".join(prefix + line + "\n" for line in text.rstrip("\n").split("\n")))
    out.flush()


_runtime: Runtime | None = None
_runtime_lock = threading.Lock()
_FORKS = [0]   # forks this process came from: a forked child makes its own runtime
os.register_at_fork(after_in_child=lambda: _FORKS.__setitem__(0, _FORKS[0] + 1))


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


def current_runtime() -> Runtime | None:
    """This process's runtime if one was made here, without making one."""
    rt = _runtime
    return rt if rt is not None and rt.pid == os.getpid() else None


def install_runtime(rt: Runtime) -> None:
    global _runtime
    _runtime = rt


def _waiting_for(fut: Future) -> str:
    """What a timed-out call still waits for (core/future.py puts it in the TimeoutError)."""
    rt = current_runtime()
    return "" if rt is None else rt.calls.waiting_for(fut, rt.where)


describe_waits_with(_waiting_for)
