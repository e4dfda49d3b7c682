"""Links to host agents: requests and their replies, events, heartbeats, lost hosts.

Everything here runs on the runtime's I/O thread (inbox.py): other threads reach it
through ``Runtime.agent_request`` / ``agent_send`` / ``watch_agent`` / ``forget_agent``,
which queue the work with ``call_in_io``. Liveness of procs comes from their agent
(waitpid), never from Python heartbeats; agents are heartbeaten every ``HEARTBEAT_S`` and
a host silent past ``HOST_TIMEOUT_S`` is declared lost (its procs' futures fail), until it
answers again (its procs come back with their state).
"""
from __future__ import annotations

import itertools
import logging
import os
import select
import time
from typing import TYPE_CHECKING, Callable

import zmq

from .. import config
from . import curve, wire
from .errors import HOST_GONE_HINT, HOST_LOST, HostUnreachableError, MeshFailure, SupervisionError
from .future import Future
from .host_liveness import LocalAgentWatch
from .messages import Ev, Rep, Req
from .transport import pid_alive

if TYPE_CHECKING:
    from .runtime import Runtime

log = logging.getLogger("monarch_kernel")

HEARTBEAT_S = config.HEARTBEAT_S.get()
HOST_TIMEOUT_S = config.HOST_TIMEOUT_S.get()


class AgentLink:
    """The I/O thread's DEALER to one host agent, with request ids and heartbeats."""

    def __init__(self, ctx: zmq.Context, addr: str, key: bytes):
        self.addr = addr
        self.key = key
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.ident = wire.new_identity()   # the agent's replies are addressed to it (wire.dest_of_identity)
        self.sock.setsockopt(zmq.ROUTING_ID, self.ident)
        curve.connect(self.sock, addr, curve.agent_keys(key)[0] if curve.wanted(addr) else None)
        self.requests: dict[int, Future] = {}
        self.last_seen = time.monotonic()
        self.last_hb_sent = 0.0
        self.unanswered = 0    # heartbeats sent since the agent was last heard
        self.watched = False   # heartbeat it and declare it lost on silence
        self.lost = False      # silent past HOST_TIMEOUT_S; heartbeats go on, so it can come back
        self.gone = False      # lost because its process exited (an agent of this machine): for good
        self.lost_since = 0.0
        self.lost_errors: dict[str, SupervisionError] = {}   # procs failed because of the silence
        self.failed_while_lost: list[str] = []   # what failed because of it (calls, requests)
        self.pid: int | None = None   # the agent's pid when it runs on this machine
        self._pidfd: tuple | None = None   # then (pidfd, its poll object), where the system has them
        self.os_watch: LocalAgentWatch | None = None   # then: is its silence load? (host_liveness.py)
        self.host = ""
        # Calls fanned out through it (core/fanout.py) stand for heartbeats while they flow both
        # ways (``tick``): plain values any thread may set (a user thread sends and reads batches).
        self.fan_heartbeats = False   # it counts our fanned messages as heartbeats (fan_version 3)
        self.fan_sent = 0.0           # when we last sent it a fanned call
        self.fan_seen = 0.0           # when we last read a batch of its procs' replies

    def post(self, frames) -> bool:
        """Queue ``frames`` to the agent without blocking the I/O thread: False when the
        link's queue is full (an agent that reads nothing: gone, cut off or frozen).

        A DEALER blocks in send once SNDHWM messages wait for a peer, and a lost host is
        heartbeaten for as long as the process lives: a blocking send here stopped the I/O
        thread, and with it every reply and agent of the process, some minutes after a host
        was lost."""
        try:
            self.sock.send_multipart(curve.chunked(frames), zmq.NOBLOCK, copy=False)   # agents cap frames
            return True
        except zmq.Again:
            return False

    def watch_pid(self, pid: int | None) -> None:
        self.close_pid()
        self.pid = pid
        if pid:
            try:
                fd = os.pidfd_open(pid)
            except (AttributeError, OSError):   # an older system (or it is gone already): pid_alive
                return
            poll = select.poll()
            poll.register(fd, select.POLLIN)
            self._pidfd = (fd, poll)

    def close_pid(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd[0])
            self._pidfd = None

    def exited(self) -> bool:
        """Has the agent's process ended (a zombie counts)? Its pidfd is readable then: one
        system call, where pid_alive's read of /proc/PID/stat took nine, and milliseconds
        while the agent's memory map was busy (it is asked on every heartbeat tick)."""
        if self._pidfd is None:
            return not pid_alive(self.pid)
        return bool(self._pidfd[1].poll(0))

    def describe_loss(self, now: float) -> str:
        if self.pid and not pid_alive(self.pid):
            return f"the agent of host {self.host or self.addr} (pid {self.pid}) is gone"
        return (f"host {self.host or self.addr} has not answered for {now - self.lost_since:.1f} s; "
                "requests to it fail until it answers again")


class AgentLinks:
    """Every agent link of one runtime (I/O thread only), by agent address."""

    def __init__(self, rt: Runtime, watch_socket: Callable, unwatch_socket: Callable):
        self.rt = rt
        self.links: dict[str, AgentLink] = {}
        self.outages: list[dict] = []   # hosts that were silent and came back (see _host_back)
        self.event_handlers: dict[str, Callable] = {"died": self._on_agent_died}
        self.host_hooks: list[Callable] = []   # f(agent address, lost): Runtime.on_host_change
        self._ids = itertools.count(1)
        self._watch_socket, self._unwatch_socket = watch_socket, unwatch_socket

    # ----------------------------------------------------------------- requests (I/O thread)
    def link(self, addr: str, key: bytes) -> AgentLink:
        link = self.links.get(addr)
        if link is None:
            self.rt.keyring.add(key)
            link = self.links[addr] = AgentLink(self.rt.ctx, addr, key)
            if self.rt.transport.copy_threshold:   # a proc (transport.PROC_COPY_THRESHOLD)
                link.sock.copy_threshold = self.rt.transport.copy_threshold
            self.rt.keyring.accept(f"agent {addr}", wire.dest_of_identity(link.ident))
            self._watch_socket(link.sock)
        return link

    def request(self, addr: str, key: bytes, op: str, args: tuple, fut: Future) -> None:
        link = self.link(addr, key)
        if link.lost:
            # A silent host answers nothing: fail now, not after the caller's timeout.
            fut.set_exception(HostUnreachableError(link.describe_loss(time.monotonic())))
            return
        req = next(self._ids)
        link.requests[req] = fut
        if not link.post(self.rt.pack_to(addr, key, Req.make(req, op, args))):
            link.requests.pop(req, None)
            fut.set_exception(HostUnreachableError(_full(link, op)))

    def send(self, addr: str, key: bytes, op: str, args: tuple) -> None:
        link = self.link(addr, key)
        if not link.post(self.rt.pack_to(addr, key, Req.make(0, op, args))):
            log.warning("%s", _full(link, op))

    def watch(self, addr: str, key: bytes, pid: int | None, host: str) -> None:
        link = self.link(addr, key)
        link.watched = True
        link.last_seen = time.monotonic()
        link.watch_pid(pid)
        link.host = host
        link.os_watch = LocalAgentWatch(pid) if pid else None

    def forget(self, addr: str) -> None:
        link = self.links.pop(addr, None)
        if link is not None:
            self._unwatch_socket(link.sock)
            link.sock.close(0)
            link.close_pid()

    def close(self) -> None:
        """(I/O thread, as the runtime closes) Close what the links hold besides their sockets
        (which the context's destroy closes): their agents' pidfds."""
        for link in self.links.values():
            link.close_pid()

    # ----------------------------------------------------------------- what agents send
    def owns(self, sock) -> AgentLink | None:
        return next((lk for lk in self.links.values() if lk.sock is sock), None)

    def on_socket(self, link: AgentLink) -> None:
        sock, opener = link.sock, self.rt.keyring.open
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            msg = opener(frames, f"agent {link.addr}")
            if msg is None or type(msg) is not tuple:
                continue
            link.last_seen = time.monotonic()
            link.unanswered = 0
            if link.lost:
                self._host_back(link, link.last_seen)
            if msg[0] == Rep.KIND:
                _, req, ok, value = Rep.of(msg)
                fut = link.requests.pop(req, None)
                if fut is not None:
                    (fut.set_result if ok else fut.set_exception)(value)
            elif msg[0] == Ev.KIND:   # ("ev", name, *args): the args are the event's own
                h = self.event_handlers.get(msg[1])
                if h is not None:
                    try:
                        h(link, *msg[2:])
                    except Exception:
                        log.exception("agent event %r failed", msg[1])

    def _on_agent_died(self, link, key, failure):
        self.rt.proc_failed(key, failure)

    # ----------------------------------------------------------------- heartbeats
    def heartbeating(self) -> bool:
        """Whether ``tick`` has work: a link it heartbeats (a proc's I/O thread, with none,
        sleeps until something arrives instead of waking to tick)."""
        return any(link.watched for link in self.links.values())

    def answered_until(self) -> float:
        """When the next heartbeat is due, if every watched agent answered its last one: the
        tick half-way between two heartbeats has nothing to do then (silence counts past
        HEARTBEAT_S), and each wake of the I/O thread costs ~50 µs of CPU here. 0.0 while one
        has not answered (its silence is looked at every half period, as before)."""
        due = 0.0
        for link in self.links.values():
            if link.watched:
                if link.unanswered or link.lost:
                    return 0.0
                at = link.last_hb_sent + HEARTBEAT_S
                due = at if not due or at < due else due
        return due

    def tick(self, now: float) -> None:
        for link in list(self.links.values()):
            if not link.watched:
                continue
            if link.fan_heartbeats and not link.lost and now - link.fan_sent < HEARTBEAT_S \
                    and now - link.fan_seen < HEARTBEAT_S:
                # Calls flow both ways: the agent counts our fanned calls as heartbeats, we count
                # its batches as its answers. No heartbeat and no answer (two wakes of this thread
                # and of the agent's a heartbeat, ~0.2 ms each on a loaded 2-core host). When
                # either stops for HEARTBEAT_S, heartbeats resume and silence counts from its
                # last batch.
                link.last_hb_sent = now
                link.last_seen = max(link.last_seen, link.fan_seen)
                link.unanswered = 0
                continue
            if now - link.last_hb_sent >= HEARTBEAT_S:
                # A lost link is heartbeaten too: a host that answers again comes back.
                link.last_hb_sent = now
                link.unanswered += 1
                link.post(self.rt.pack_to(link.addr, link.key, Req.make(0, "hb", (self.rt.address,))))
            if link.lost:
                continue
            silent = now - link.last_seen
            gone = link.pid is not None and silent > HEARTBEAT_S and link.exited()
            # A same-machine agent that wants the CPU is starved, not lost (host_liveness.py).
            # Looked at (a dozen /proc files, ~0.3 ms here) only once a heartbeat went
            # unanswered for a period: the tick that sends one finds the answer to the one
            # before HEARTBEAT_S old, which is no silence (it looked twice a second for
            # nothing, ~0.1 ms of a call to all 256 procs). What it finds counts only past
            # HOST_TIMEOUT_S, several looks later.
            load = not gone and silent > HEARTBEAT_S and link.unanswered >= 2 and link.os_watch is not None \
                and link.os_watch.silence_is_load(now, silent)
            # Silence counts only if we really asked: an I/O thread starved of the GIL (a long
            # pickle on the main thread) sent no heartbeats and must not declare a host lost.
            if gone or (silent > HOST_TIMEOUT_S and link.unanswered >= 4 and not load):
                link.lost, link.gone = True, gone
                link.lost_since = link.last_seen
                self._host_lost(link, now - link.last_seen, gone)

    def _host_lost(self, link: AgentLink, silent_s: float, gone: bool = False):
        rt = self.rt
        why = (f"its agent (pid {link.pid}) is gone" if gone
               else f"its agent {link.addr} was silent for {silent_s:.1f} s")
        log.error("host %s: %s; failing what waits on it", link.host or link.addr, why)
        link.failed_while_lost = []
        for fut in list(link.requests.values()):
            link.failed_while_lost.append(fut.what)
            fut.set_exception(HostUnreachableError(f"host {link.host or link.addr} is unreachable: {why}"))
        link.requests.clear()
        hint = (HOST_GONE_HINT if gone else
                "Its procs may only be stalled: if the host answers again they come back with their "
                "state; if not, stop the mesh and spawn a new one")
        before = rt.calls.whats_pending()
        link.lost_errors = {}
        for key, (ref, _) in list(rt.procs.items()):
            if ref.agent == link.addr and key not in rt.dead:
                rt.proc_failed(key, MeshFailure(rt.mesh_name_of(key), ref.rank, ref.host, ref.pid,
                                                f"{HOST_LOST}: {why}", key), hint=hint)
                link.lost_errors[key] = rt.dead[key]
        after = rt.calls.whats_pending()
        link.failed_while_lost.extend(w for i, w in before.items() if i not in after)
        self._tell_hooks(link.addr, True)

    def _tell_hooks(self, addr: str, lost: bool) -> None:
        for hook in self.host_hooks:
            try:
                hook(addr, lost)
            except Exception:
                log.exception("host change hook failed")

    def _host_back(self, link: AgentLink, now: float):
        """A host declared lost answers again: its procs were never dead. Un-fail them, say
        what failed in between, and hello again (the agent may have detached us meanwhile;
        its answer lists the procs that really died)."""
        rt = self.rt
        silent = now - link.lost_since
        link.lost = link.gone = False
        self._tell_hooks(link.addr, False)
        back = [k for k, err in link.lost_errors.items() if rt.dead.get(k) is err]
        for k in back:
            del rt.dead[k]
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
        if not link.post(rt.pack_to(link.addr, link.key, Req.make(req, "hello", (rt.contact, rt.whoami())))):
            link.requests.pop(req, None)
            fut.set_exception(HostUnreachableError(_full(link, "hello")))

        def died_meanwhile(f):
            if f.exception() is not None:
                return
            for key in f.get().get("dead", {}):
                ref = rt.procs.get(key, (None,))[0]
                if ref is not None:
                    rt.proc_failed(key, MeshFailure(rt.mesh_name_of(key), ref.rank, ref.host, ref.pid,
                                                    "proc died while its host was unreachable", key))
        fut.add_done_callback(died_meanwhile)


def _full(link: AgentLink, op: str) -> str:
    return (f"could not send {op!r} to the host agent at {link.addr}{f' ({link.host})' if link.host else ''}: "
            "its queue is full, the agent has read nothing for a long time (gone, cut off or frozen); "
            "check it with `%mesh status`, or start a new one")
