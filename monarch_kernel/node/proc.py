"""The proc worker: runs actor endpoints (and, through built-in actors, notebook cells).

Threads, by design:
  * main thread: the *work inbox* loop. Spawns and sync endpoints run here, one at a
    time, in arrival order, so signals (interrupts) and pdb land in user code.
  * I/O thread (the runtime's): replies to calls this proc makes, interrupts, notices.
  * event-loop thread, started on first use: async endpoints, all on one asyncio loop.
"""
from __future__ import annotations

import asyncio
import collections
import inspect
import os
import pickle
import select
import signal
import sys
import threading
import time
import traceback

import zmq

from monarch_kernel import config
from monarch_kernel.core import context as context_mod
from monarch_kernel.core import curve, wire
from monarch_kernel.core.channels import Port, reply_port
from monarch_kernel.core.context import _CTX, ActorInstance, Context
from monarch_kernel.core.endpoint import EXPLICIT_PORT_MARK
from monarch_kernel.core.errors import ActorError, MeshFailure, SupervisionError
from monarch_kernel.core.messages import (
    AbortActor,
    Call,
    Died,
    Interrupt,
    KillActor,
    LoggingOption,
    Query,
    Reply,
    Spawn,
    StopActor,
    Supervise,
    Unhandled,
)
from monarch_kernel.core.runtime import Runtime, install_runtime, ipc_name
from monarch_kernel.core.shape import Point
from monarch_kernel.core.textsink import TextSink
from monarch_kernel.core.transport import gpu_count
from monarch_kernel.core.wire import PLAIN_TYPES
from monarch_kernel.debug import worker as debugger  # imported here so the zygote pays for pdb
from monarch_kernel.node import fanlink, fanout
from monarch_kernel.node.cells import CellFailure
from monarch_kernel.node.held_replies import HOLD_S, HeldReplies
from monarch_kernel.node.output_batch import OutputBatch
from monarch_kernel.node.output_limit import SKIPPED, OutputLimit, shortened_lines, skipped_text
from monarch_kernel.telemetry.worker import CELL_ACTOR, ProcTelemetry


class ActorSlot:
    __slots__ = ("obj", "name", "ctx", "methods", "owner")

    def __init__(self, obj, name, ctx, owner=None):
        self.obj, self.name, self.ctx = obj, name, ctx
        # method as sent -> [name, is async, takes a response port, "in Actor.name", quick]:
        # worked out on its first call (the method itself is looked up on every call: code sync
        # may replace it); quick: its last call took under QUICK_S (its reply may be held, and
        # it may run while others' replies are held: _hold_reply)
        self.methods: dict[str, list] = {}
        self.owner = owner   # (work address, key, actor id) of the actor that spawned it; None: controller

    def code_changed(self) -> None:
        """Code sync reloaded a module: work each method's entry out again on its next call
        (a method may have become async, or gained a response port)."""
        self.methods.clear()


def _nth_newline(text: str, n: int) -> int:
    """Where the ``n``-th line of ``text`` ends."""
    at = -1
    for _ in range(n):
        at = text.index("\n", at + 1)
    return at


class ForwardingStream(TextSink):
    """sys.stdout / sys.stderr of a proc: complete lines go to the controller (the sink),
    tagged with the rank, from the writing thread's own socket, at once or in a batch while
    they come fast (output_batch.py); the reply to a call is sent after a flush on the same
    socket, so output always arrives before the result."""

    def __init__(self, worker: ProcWorker, name: str, batch: OutputBatch):
        self._worker, self.name, self._batch = worker, name, batch
        self._buf: list[str] = []
        batch.streams.append(self)

    def write(self, s: str) -> int:
        if not isinstance(s, str):
            raise TypeError(f"write() argument must be str, not {type(s).__name__}")
        batch = self._batch
        with batch.lock:
            self._buf.append(s)
            batch.pending = True
            if "\n" in s:
                batch.lines(self)
        return len(s)

    def holds_text(self) -> bool:
        return bool(self._buf)

    def take_lines(self) -> str:
        """The whole lines written so far, taken from the buffer (under the batch's lock)."""
        text = "".join(self._buf)
        cut = text.rfind("\n") + 1
        self._buf = [text[cut:]] if cut < len(text) else []
        return text[:cut]

    def flush(self):
        if not self._buf:
            return
        with self._batch.lock:
            self._batch.flush()
            text = "".join(self._buf)
            self._buf = []
            try:
                if text:
                    self._worker.emit_output(self.name, text, self._worker.busy_call)
            finally:
                self._batch.settle()


class ProcWorker:
    def __init__(self, rt: Runtime, cfg: dict):
        self.rt = rt
        self.key = bytes.fromhex(cfg["key"])
        rt.keyring.add(self.key)
        self.proc_key = cfg["proc_key"]
        self.rank = cfg["rank"]
        self.host = cfg["host"]
        self.mesh_name = cfg["mesh_name"]
        self.agent = cfg["agent"]   # the agent's address: how the mesh names this proc's host
        self.agent_link = cfg.get("agent_ipc") or self.agent   # how this proc talks to it (ipc on its host)
        self.gather = cfg.get("gather")   # the agent's gather inbox: replies of fanned calls (fanout.py)
        self.link_path = cfg.get("fan_link")   # where its agent takes fan links (fanlink.py)
        self.link: fanlink.ProcLink | None = None   # fanned calls, their replies and output
        self.sink = (rt.learn_contact(cfg["sink"]), self.key) if cfg.get("sink") else None
        self.away_sink = None   # (addr, key) of the controller our agent detached (silent), until it is back
        self.actors: dict[str, ActorSlot] = {}
        self.failed: dict[str, tuple] = {}   # actor id -> (name, why it is gone, its error or None)
        # Calls that overtook their actor's spawn (another way here: a spawn through the agent,
        # a call_one straight to this proc): actor id -> [first seen, [messages]] (_wait_spawn)
        self.unborn: dict[str, list] = {}
        self.never_born: collections.OrderedDict = collections.OrderedDict()   # waited for in vain
        self.interrupting = None           # the call our interrupt is aimed at (a KeyboardInterrupt there is ours)
        self.stream_to_client = True       # ProcMesh.logging_option(stream_to_client=...)
        self._kill_exc: dict = {}          # actor id -> what its async endpoint raised, until it is stopped
        self.owned: dict[str, tuple[str, set]] = {}   # child actor mesh id -> (owner id, proc keys)
        self.work = rt.ctx.socket(zmq.PULL)
        self.work.setsockopt(zmq.RCVHWM, 0)
        self.work.setsockopt(zmq.LINGER, 0)
        self.work.setsockopt(zmq.HANDSHAKE_IVL, 5000)   # peers that never greet are dropped
        self.work_addr = curve.with_key(curve.bind(self.work, f"tcp://{cfg['bind']}:*",
                                                   curve.process_keys()[1] if rt.curve_public else None,
                                                   curve.MAX_FRAME), rt.curve_public)
        self.work_ipc = ipc_name("work")
        self.work.bind(self.work_ipc)
        rt.keyring.accept("work inbox", wire.dest_id(self.work_addr), wire.dest_id(self.work_ipc))
        self.drain_work = True   # the inbox may hold work its ZMQ_FD will not signal (_serve_linked)
        self.busy_call = None   # (reply_to, call_id) of what the main thread runs now
        self.active: list[str] = []                 # actors running sync code on the main thread
        self.deferred: collections.deque = collections.deque()   # their messages, kept for later
        self.deferred_for: collections.Counter = collections.Counter()
        self.state = "idle"
        self.async_calls: dict = {}   # call id -> [concurrent future, "Actor.method"] awaiting on the loop
        self.main_ident = threading.get_ident()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.running = True
        rt.on_message("interrupt", self._on_interrupt)
        rt.on_message("died", self._on_died_notice, replace=True)   # a proc's own death notices
        rt.on_message("query", self._on_query)
        rt.on_message("logopt", self._on_logging_option)
        context_mod.SELF_CONTROL = self
        rt.on_agent_event("sink", self._on_sink)
        rt.on_agent_event("died", lambda link, key, failure: self._peer_died(key, failure), replace=True)
        rt.death_listeners.append(self._supervise_owned)
        self.output_batch = OutputBatch(   # both streams: one order
            self.emit_output, lambda: self.busy_call,
            lambda call: self.link is not None and call is not None and fanout.fanned(self.gather, call[0]))
        self.stdout = ForwardingStream(self, "stdout", self.output_batch)
        self.stderr = ForwardingStream(self, "stderr", self.output_batch)
        self.telemetry = ProcTelemetry(self, cfg)   # log file, call and cell records
        self.output_limit = OutputLimit()   # past it, output goes to the log file only
        self.line_chars = config.OUTPUT_LINE_CHARS.get()   # longer lines are cut (the log has them)
        # Replies held by the main thread while more calls wait in the work inbox (_hold_reply).
        self.held = HeldReplies(rt.send_plain, self.key, self.proc_key, lambda: self.running)
        self._held, self.send_held_replies = self.held.items, self.held.send

    # ---------------------------------------------------------------- output
    def emit_output(self, stream: str, text: str, busy) -> None:
        """``busy``: the call that printed ``text`` (output goes its way)."""
        if self._held and threading.get_ident() == self.main_ident:
            self.send_held_replies()   # earlier calls' replies before this call's output
        if self.telemetry.log is not None:   # kept on the host too, attached or not
            self.telemetry.log.write(stream, text)
        sink = self.sink
        if sink is None or not self.stream_to_client:
            if sink is None and self.away_sink is not None and self.stream_to_client:
                # Our agent detached the controller after a silence (a stall either side): the
                # line is in the log; its count goes with the first line or reply once it is back.
                self.output_limit.keep_back(text.count("\n") or 1)
            (sys.__stderr__ if stream == "stderr" else sys.__stdout__).write(
                "".join(f"[rank {self.rank}] {line}\n" for line in text.rstrip("\n").split("\n")))
            return
        lines = text.count("\n") or 1
        n = self.output_limit.admit(lines, busy)
        if n < lines:   # the rest in the log file only; the count goes with the next line or reply
            if not n:
                return
            text = text[:_nth_newline(text, n) + 1]
        if len(text) > self.line_chars and self.line_chars:
            text = shortened_lines(text, self.line_chars)
        self._send_skipped(sink, busy)
        self._send_output(sink, busy, ("out", self.rank, stream, text))

    def _send_output(self, sink, busy, msg) -> None:
        """messages.Output as a literal, in field order: plain values, so it takes the replies'
        lean path (one C pickle, signed in one pass), through the agent when the call was
        fanned (as its reply will: the count of lines kept back too, or it could come after
        the reply and miss the cell's count)."""
        try:
            route = fanout.output_route(self.gather, busy, sink[0])
            if route is not None:
                if self.link is not None:
                    self.link.send_output(sink[0], busy[1], msg)
                    return
                if not self.rt.transport.send_plain_routed(self.gather, route, sink[1], msg):
                    frames = self.rt.keyring.stamp(self.rt.pack(sink[1], msg), wire.dest_id(self.gather))
                    self.rt.send_frames(self.gather, [route, *frames])
                return
            self.rt.send_plain(sink[0], sink[1], msg)
        except (zmq.ZMQError, OSError):   # (its agent gone: this proc goes with it)
            pass

    def _send_skipped(self, sink, busy) -> None:
        if sink is None:
            # Detached (our agent stopped hearing the controller) while a call of its runs: the
            # count goes before that call's reply, which goes to it detached or not, so the cell
            # waiting on it can say these lines. Taken only when sent: else the next line or
            # reply once the controller is back carries it.
            sink = self.away_sink if busy is not None else None
            if sink is None:
                return
        n = self.output_limit.take_skipped()
        if n:
            self._send_output(sink, busy, ("out", self.rank, SKIPPED, skipped_text(self.rank, n)))

    def flush_output(self):
        with self.output_batch.lock:   # (after a batch the timer thread is sending)
            self.stdout.flush()   # (each sends the other's waiting lines first)
            self.stderr.flush()
            self._send_skipped(self.sink, self.busy_call)

    # ---------------------------------------------------------------- I/O-thread notices
    def _on_sink(self, link, addr, key):
        """The agent attached a controller (``addr``, its contact) or detached it (None).
        Lines written while detached are counted for the same controller when it comes back
        (the cell it is waiting on says how many it did not get); another one is not told."""
        if addr:
            sink = (self.rt.learn_contact(addr), key)   # (its tcp address first)
            if self.away_sink is not None and sink[0] != self.away_sink[0]:
                self.output_limit.take_skipped()
            self.sink = sink   # (before the away sink is let go: a line meanwhile goes to one of them)
            self.away_sink = None
        else:
            if self.sink is not None:
                self.away_sink = self.sink
            self.sink = None

    def _on_interrupt(self, msg):
        """Interrupt what runs now: KeyboardInterrupt in sync code on the main thread, and
        CancelledError in the async endpoints awaiting on the event loop."""
        call_id = Interrupt.of(msg).call
        busy = self.busy_call
        if busy is not None and (call_id is None or busy[1] == call_id):
            self.interrupting = busy
            signal.pthread_kill(self.main_ident, signal.SIGINT)
        for cid, (fut, _) in list(self.async_calls.items()):
            if fut is not None and (call_id is None or cid == call_id):
                fut.cancel()   # thread-safe: the loop cancels the task, CancelledError inside it

    def _on_logging_option(self, msg):
        """ProcMesh.logging_option: where output goes and the root logger's level."""
        m = LoggingOption.of(msg)
        import logging

        self.stream_to_client = m.stream_to_client
        root = logging.getLogger()
        root.setLevel(m.level)
        if not root.handlers:   # records at the level reach the output (and so the controller)
            root.addHandler(logging.StreamHandler(sys.stderr))
        self.rt.send(m.reply_to, self.key, Reply.make(m.call_id, self.proc_key, True, None))

    def _on_query(self, msg):
        """Answered on the I/O thread, so it works while the main thread runs user code."""
        m = Query.of(msg)
        state = self.state
        if state == "idle" and self.async_calls:
            state = "awaiting " + ", ".join(sorted({w for _, w in self.async_calls.values()}))
        info = {"state": state, "pid": os.getpid(), "host": self.host, "rank": self.rank,
                "actors": sorted({s.name for s in self.actors.values()}), **self.query_extra()}
        if state != "idle":
            info["where"] = main_thread_at()
        self.rt.send(m.reply_to, self.key, Reply.make(m.call_id, self.proc_key, True, info))

    def query_extra(self) -> dict:
        """Hook for features that add to a proc's status (debugger, RDMA buffers)."""
        out = {}
        for fn in QUERY_EXTRAS:
            try:
                out.update(fn(self))
            except Exception as e:
                out.setdefault("errors", []).append(repr(e))
        return out

    def _on_died_notice(self, msg):
        m = Died.of(msg)
        self._peer_died(m.key, m.failure)

    def _peer_died(self, key, failure):
        self.rt.proc_failed(key, failure)

    def _supervise_owned(self, key, err: SupervisionError):
        for child, (owner, keys) in list(self.owned.items()):
            if key in keys:
                failure = err.failure or MeshFailure(child, None, "", None, str(err), key)
                self.rt.send(self.work_addr, self.key, Supervise.make(owner, failure, child))

    # ---------------------------------------------------------------- the main loop
    def serve(self) -> int:
        opener, work, recv = self.rt.keyring.open, self.work, wire.recv_message
        if self.link_path:   # before "ready": every fanned call then comes on the link
            try:
                self.link = fanlink.ProcLink(self.link_path, self.rt.keyring, self.key, self.proc_key)
            except OSError as e:
                print(f"[rank {self.rank}] no fan link ({e}): fanned calls come over zmq", file=sys.__stderr__)
        self.rt.agent_send(self.agent_link, self.key, "ready", self.proc_key, os.getpid(), self.work_addr,
                           self.rt.address, self.work_ipc, self.rt.ipc_address, self.rt.host_id,
                           self.rt.curve_public)
        if self.link is not None:
            self.rt.serve_work_while_waiting(work, self._nested_work, (self.link.fd, self._nested_link), self._pumped)
            return self._serve_linked()
        self.rt.serve_work_while_waiting(work, self._nested_work)
        deferred, held, clock = self.deferred, self._held, time.perf_counter
        while self.running:
            if deferred:
                self._run_deferred()
                continue
            try:
                if held:   # replies held: take the next message only if it is already here
                    try:
                        frames = recv(work, _NOBLOCK)
                    except zmq.Again:
                        self.send_held_replies()
                        continue
                    queued = True
                else:
                    if self.unborn:
                        waiting = work.poll(self._unborn_timeout_ms())
                        if self._give_up_unborn() or not waiting:
                            continue
                    t0 = clock()
                    frames = recv(work)
                    # Back at once: more calls were queued (a pipeline), so this call's reply may
                    # wait for the next ones' (one signed message for several, _hold_reply).
                    queued = clock() - t0 < _QUEUED_S
            except KeyboardInterrupt:
                continue  # an interrupt that arrived after its call finished
            self._take(opener(frames, "work inbox"), queued)
        if held:
            self.send_held_replies()
        return 0

    def _serve_linked(self) -> int:
        """``serve``'s loop for a proc with a fan link: it waits on the link and the work inbox
        at once and takes each message as the zmq-only loop does.

        The wait is one poll(2) over the link's socket and the inbox's ZMQ_FD, not zmq_poll:
        zmq_poll asks libzmq for the inbox's events before and after every wait, which cost
        ~12-15 us per proc per fanned call at 256 procs (53 against 41 us in a bare A/B on
        2 cores), and a fanned call never needs the inbox. ZMQ_FD is edge-triggered: it fires
        when the inbox gets work after a read found it empty. So once it fires the loop reads
        the inbox until ZMQ_EVENTS says it is empty (``self.drain_work``), and again after a
        nested wait inside an endpoint, which may have read the inbox's signal and left work in
        it (``_pumped``)."""
        opener, work, recv, link = self.rt.keyring.open, self.work, wire.recv_message, self.link
        deferred, held, clock = self.deferred, self._held, time.perf_counter
        lfd = link.fd
        poller = select.poll()
        poller.register(lfd, select.POLLIN)
        poller.register(work.getsockopt(zmq.FD), select.POLLIN)
        wait, linked_call = poller.poll, self._linked_call
        queued, fired = True, False
        while self.running:
            if deferred:
                self._run_deferred()
                continue
            try:
                if self.drain_work or held:
                    # Work may wait in the inbox (its FD fired), or replies are held (a pipeline
                    # of direct calls): take what is there; the link is looked at when the inbox
                    # is empty. Asked through ZMQ_EVENTS, not a recv that may raise zmq.Again:
                    # pyzmq builds that exception in Python (an import and a strerror), ~30 us
                    # a direct call per proc on cold caches.
                    # Just after the FD fired, work is there: read it without asking first.
                    if fired or work.getsockopt(_EVENTS) & _POLLIN:
                        fired = False
                        try:
                            frames = recv(work, _NOBLOCK)
                        except zmq.Again:   # (it fired for libzmq's own commands: rare)
                            continue
                        self._take(opener(frames, "work inbox"), queued)
                        queued = True
                        continue
                    self.drain_work = False
                    if not held:
                        continue
                    ready = wait(0)
                    if not ready:
                        self.send_held_replies()
                        continue
                    queued = True
                else:
                    t0 = clock()
                    ready = wait(-1 if not self.unborn else self._unborn_timeout_ms())
                    if self.unborn and self._give_up_unborn():
                        continue   # (what is ready stays ready)
                    queued = False   # (a fanned call's reply is never held: no clock for it)
                for fd, _ in ready:
                    if fd != lfd:
                        # Back at once: work was waiting (a pipeline), so its replies may be held.
                        queued = queued or clock() - t0 < _QUEUED_S
                        self.drain_work = fired = True
                        continue
                    try:
                        linked_call(queued)
                    except EOFError:   # the agent is gone (its procs die with it)
                        return 0
            except KeyboardInterrupt:
                continue  # an interrupt that arrived after its call finished
        if held:
            self.send_held_replies()
        return 0

    def _pumped(self) -> None:
        """A nested wait (an endpoint waiting on a future) ended: it may have read the work
        inbox's FD signal and left work in the inbox; _serve_linked reads it until empty."""
        self.drain_work = True

    def _run_deferred(self) -> None:
        """The oldest message kept for later (it came while an actor it was for ran below)."""
        if self._held:
            self.send_held_replies()
        msg = self.deferred.popleft()
        if msg[0] == "call":
            self.deferred_for[msg[1]] -= 1
        self._dispatch_work(msg)

    def _take(self, msg, queued: bool) -> None:
        """A message from the work inbox (or the fan link), opened: run it."""
        if msg is None or type(msg) is not tuple:
            self._answer_load_failure(msg)
            return   # dropped (logged by the opener)
        if msg[0] == "call":   # (the usual message: no getattr by name)
            try:
                self.do_call(msg, queued)
            except KeyboardInterrupt:
                pass
            return
        if self._held:
            self.send_held_replies()
        self._dispatch_work(msg)

    def _dispatch_work(self, msg) -> None:
        try:
            getattr(self, "do_" + msg[0])(msg)
        except KeyboardInterrupt:
            pass

    def _nested_link(self) -> None:
        """``_nested_work`` for the fan link: it is readable while this thread waits."""
        try:
            msg = self.link.read()
        except EOFError:
            self.running = False
            return
        if msg is not None:
            self._nested_msg(msg)

    def _nested_work(self, frames) -> None:
        """Work that arrives while this main thread waits in get() inside an endpoint: run it
        now, unless it is for an actor already running below us on this thread (it waits, in
        order, for the main loop), so a sync endpoint may call actors of its own proc."""
        self._nested_msg(self.rt.keyring.open(frames, "work inbox"))

    def _nested_msg(self, msg) -> None:
        if msg is None or type(msg) is not tuple:
            self._answer_load_failure(msg)
            return
        kind = msg[0]
        if kind == "exit" or (kind in ("call", "stop_actor") and (msg[1] in self.active
                                                                   or self.deferred_for[msg[1]])):
            self.deferred.append(msg)
            if kind == "call":
                self.deferred_for[msg[1]] += 1
            return
        saved = (self.busy_call, self.state)
        try:
            self._dispatch_work(msg)
        finally:
            self.busy_call, self.state = saved

    def _answer_load_failure(self, failure) -> None:
        """A verified call whose arguments cannot be unpickled here (a module the workers
        lack): fail it at the caller rather than leave the caller waiting."""
        m = getattr(failure, "partial", None)
        if type(m) is not tuple or len(m) < 7 or m[0] != "call":
            return
        m = Call.of(m)
        slot = self.actors.get(m.actor_id)
        e = failure.error
        if isinstance(e, (ImportError, AttributeError)):
            fix = ("Make the module importable on the workers (install it, or sync your code), or send "
                   "plain data")
        else:
            fix = ("Unpickling one of them raised here (e.g. its __setstate__ or __reduce__): fix that, or "
                   "send plain data")
        method = str(m.method).removeprefix(EXPLICIT_PORT_MARK)
        self._reply(m.reply_to, m.call_id, False, ActorError(
            f"its arguments could not be unpickled on this worker: {e!r}. {fix}", rank=self.rank,
            host=self.host, exc_type=type(e).__name__, actor=f"{slot.name if slot else m.actor_id}.{method}"))

    def do_exit(self, msg):
        self.running = False

    def do_spawn(self, msg):
        _, aid, name, body, view, reply_to, call_id, owner = Spawn.of(msg)
        try:
            cls, args, kwargs, _src = wire.loads(body)
        except BaseException as e:
            self._init_failed(aid, name, owner, reply_to, call_id, self._error(e, f"{name} (unpickling its class)"))
            return
        idx = view.ranks.index(self.rank)
        inst = ActorInstance(Point(idx, view.extent), aid, name, self.proc_key, self.rank, self.host)
        ctx = Context(inst)
        token = _CTX.set(ctx)
        self.busy_call, self.state = (reply_to, call_id), f"in {name}.__init__"
        try:
            obj = cls(*args, **kwargs)
        except BaseException as e:
            self._init_failed(aid, name, owner, reply_to, call_id, self._error(e, f"{name}.__init__"))
            return
        finally:
            _CTX.reset(token)
            self.busy_call, self.state = None, "idle"
        self.actors[aid] = ActorSlot(obj, name, ctx, owner)
        self._reply(reply_to, call_id, True, None)
        if self.unborn:
            self._born(aid)

    def _wait_spawn(self, aid: str, msg) -> bool:
        """A call for an actor this proc never had: its spawn may still be on its way (the
        two went different ways: a spawn of many procs through the agent's fan link, a
        call_one over zmq; each sender's order holds only on one way). Keep the call until
        the spawn has run (_born), at most UNBORN_WAIT_S; False: answer it as gone now."""
        if aid in self.never_born:
            return False
        w = self.unborn.get(aid)
        if w is None:
            if len(self.unborn) >= 1000:
                return False
            w = self.unborn[aid] = [time.monotonic(), []]
        w[1].append(msg)
        return True

    def _born(self, aid: str) -> None:
        """``aid``'s spawn ran (or failed): the calls that waited for it run next, in order."""
        w = self.unborn.pop(aid, None)
        if w is None:
            return
        for msg in reversed(w[1]):
            self.deferred.appendleft(msg)
            self.deferred_for[msg[1]] += 1

    def _unborn_timeout_ms(self) -> int:
        """How long the work loop may block: until the oldest waiting call gives up (-1: none)."""
        if not self.unborn:
            return -1
        oldest = min(w[0] for w in self.unborn.values())
        return max(1, int((oldest + UNBORN_WAIT_S - time.monotonic()) * 1000) + 1)

    def _give_up_unborn(self) -> bool:
        """Calls that waited UNBORN_WAIT_S for their spawn are answered (gone); True if any."""
        now = time.monotonic()
        late = [a for a, w in self.unborn.items() if now - w[0] >= UNBORN_WAIT_S]
        for aid in late:
            self.never_born[aid] = None
            if len(self.never_born) > 1000:
                self.never_born.popitem(last=False)
            self._born(aid)
        return bool(late)

    def _init_failed(self, aid, name, owner, reply_to, call_id, err: ActorError) -> None:
        """The spawner's future fails (the controller reports it from there); a spawning
        actor's ``__supervise__`` hears of it too."""
        self._gone(aid, name, f"its __init__ failed: {err.message}", err)
        self._reply(reply_to, call_id, False, err)
        if self.unborn:
            self._born(aid)
        if owner is not None:
            self._tell_owner(owner, aid, self._failure(name, f"actor failed to start: {err.message}"), err)

    def _gone(self, aid, name, why, err) -> None:
        """Remember why an actor is gone, so later calls say so (the last 1000)."""
        self.failed[aid] = (name, why, err)
        if len(self.failed) > 1000:
            del self.failed[next(iter(self.failed))]

    def _failure(self, name: str, reason: str) -> MeshFailure:
        return MeshFailure(name, self.rank, self.host, os.getpid(), reason, self.proc_key)

    def do_call(self, msg, queued: bool = False):
        """Run a call. ``queued`` (the main loop): more work was waiting when it arrived, so a
        quick call's plain reply may be held for the next ones' (_hold_reply)."""
        _, aid, method, args, kwargs, reply_to, call_id, _src = msg   # messages.Call, in field order (hot path)
        slot = self.actors.get(aid)
        if slot is None:
            if aid not in self.failed and self._wait_spawn(aid, msg):
                return
            name, why, cause = self.failed.get(aid, (aid, "it was stopped, or failed to start", None))
            err = ActorError(f"actor mesh '{name}' is gone from this proc: {why}", rank=self.rank, host=self.host,
                             actor=f"{name}.{method.lstrip(EXPLICIT_PORT_MARK)}",
                             remote_traceback=getattr(cause, "remote_traceback", ""),
                             exc_type=getattr(cause, "exc_type", ""))
            self._reply(reply_to, call_id, False, err)
            return
        entry = slot.methods.get(method)
        if entry is None:
            entry = slot.methods[method] = _method_entry(slot, method)
        method, is_async, explicit, state, quick = entry
        held = self._held
        if held and not (queued and quick and time.perf_counter() - self.held.since < HOLD_S):
            self.send_held_replies()   # not after a call that may take long, nor for long
        if explicit:
            args = (self._response_port(reply_to, call_id), *args)
        if is_async:
            self._run_async(slot, aid, method, args, kwargs, reply_to, call_id, explicit)
            return
        value, ok, exc, ours, took = self._invoke(slot, aid, method, state, args, kwargs, (reply_to, call_id))
        entry[4] = quick = took < QUICK_S
        tel = self.telemetry
        if tel.enabled:
            tel.record_call(slot.name, method, args, _time() - took, took, ok, value)
        if exc is None and not explicit and type(call_id) is int and call_id:
            # (a fanned call on the fan link usually went _linked_call's way)
            if queued and quick and type(value) in PLAIN_TYPES and type(reply_to) is str:
                self._hold_reply(reply_to, call_id, ok, value)
                return
            self._reply(reply_to, call_id, ok, value)   # (what _finish_call does for this case)
            return
        self._finish_call(aid, reply_to, call_id, ok, value, explicit, exc, ours)

    def _invoke(self, slot: ActorSlot, aid: str, method: str, state: str, args, kwargs, busy: tuple) -> tuple:
        """Run a sync endpoint on this main thread: (value, ok, what it raised or None, whether
        that was our own interrupt, seconds). A raise is made into its ActorError here (the
        post-mortem debugger stops while the call is still the busy one)."""
        token = _CTX.set(slot.ctx)
        self.busy_call, self.state = busy, state
        active = self.active
        active.append(aid)
        t0 = _clock()
        try:
            return getattr(slot.obj, method)(*args, **kwargs), True, None, False, _clock() - t0
        except BaseException as e:
            value = self._error(e, f"{slot.name}.{method}")
            return value, False, e, self.interrupting is not None and self.interrupting == self.busy_call, _clock() - t0
        finally:
            active.pop()
            _CTX.reset(token)
            self.busy_call, self.state, self.interrupting = None, "idle", None

    def _linked_call(self, queued: bool) -> None:
        """The fan link is readable: take its record. The usual one, a call fanned through the
        agent to a sync endpoint already seen, is read, run and answered on the link here,
        with the fan link's ``read`` and ``do_call``'s dispatch inline: at 256 procs on 2
        cores each proc runs each call on cold caches, where a Python line costs ~0.5 us and a
        function call more (issue 11). Anything else goes the general way once read: a record
        that is not a whole call to ``ProcLink.opened``, another message to ``_take``; an
        actor or method not seen yet, an async or port endpoint, held replies, a broadcast (no
        call id) to ``do_call``; a raise, a value that is not plain, or output waiting, to
        ``_finish_call``. EOFError when the agent is gone."""
        link = self.link
        msg = None
        if link.parts is None:
            n = link.sock.recv_into(link.scratch)
            if n and link.scratch[0] == _LINK_CALL:
                try:
                    msg = _loads(link.scratch[1:n])   # copies what it keeps: the scratch is reused
                    link.received += 1
                except Exception:
                    pass   # (opened makes it the load failure _take answers)
            if msg is None:
                msg = link.opened(n)
        else:   # the rest of a message in several records
            msg = link.read()
        if type(msg) is not tuple or not msg or msg[0] != "call":
            if msg is not None:   # (None: more records of it to come)
                self._take(msg, queued)
            return
        _, aid, method, args, kwargs, reply_to, call_id, _src = msg   # messages.Call, in field order
        slot = self.actors.get(aid)
        entry = slot.methods.get(method) if slot is not None else None
        if (entry is None or entry[1] or entry[2] or self._held or type(call_id) is not int or not call_id
                or not reply_to.startswith(_FAN_PREFIX)):
            return self.do_call(msg)
        name = entry[0]
        value, ok, exc, ours, took = self._invoke(slot, aid, name, entry[3], args, kwargs, (reply_to, call_id))
        tel = self.telemetry
        if tel.enabled:   # record_call's rows, made here (a function call less a proc a call: ~5 us at 256)
            if slot.name != CELL_ACTOR:
                tel.calls.append((_time() - took, tel.mesh, tel.rank, slot.name, name, took, ok))
            elif name == "run" and len(args) > 1:   # a cell: run(code, filename, ...); a raise: a CellFailure
                tel.cells.append((_time() - took, tel.mesh, tel.rank, args[1] if type(args[1]) is str else "", took,
                                  ok and type(value) is not CellFailure))
        if ok and type(value) in PLAIN_TYPES and not (self.output_batch.pending or self.output_limit.skipped):
            link.send_reply(reply_to, call_id, True, _NONE_PICKLED if value is None else _dumps(value, 5))
            return
        self._finish_call(aid, reply_to, call_id, ok, value, False, exc, ours)

    def _response_port(self, reply_to, call_id):
        """What an explicit-response endpoint answers through: the Port given to send(), a
        port to this call's caller, or None under broadcast (nobody waits)."""
        if isinstance(call_id, Port):
            return call_id
        return reply_port(fanout.real_address(reply_to), self.key, call_id, self.proc_key) if call_id else None

    def _finish_call(self, aid, reply_to, call_id, ok, value, explicit, exc, interrupted=False):
        """Reply, unless the endpoint answers through its port. Monarch's supervision: a
        BaseException (other than our own interrupt), or any raise under broadcast, fails
        the actor (it is stopped and its owner is told); an Exception with a caller waiting
        only fails the call."""
        fatal = _fails_the_actor(exc, call_id, interrupted)
        if not (ok and explicit):
            if call_id or not fatal:
                slot = self.actors.get(aid)
                self._reply(reply_to, call_id, ok, value, slot.ctx.actor_instance.rank.rank if slot else None)
        else:
            self.flush_output()
        if fatal:
            self._kill(aid, value, exc, seen=bool(call_id))

    def _kill(self, aid, err: ActorError, exc, seen: bool = False) -> None:
        slot = self.actors.pop(aid, None)
        if slot is None:
            return
        self._gone(aid, slot.name, f"it failed: {err.message}", err)
        self._cleanup(slot, exc if isinstance(exc, Exception) else None)
        failure = self._failure(slot.name, f"actor failed: {err.message}")
        self._tell_owner(slot.owner, aid, failure, err, seen)

    def _tell_owner(self, owner, aid, failure: MeshFailure, err, seen: bool = False) -> None:
        """Deliver a failure of actor ``aid`` to the actor that spawned it, or to the
        controller (its unhandled_fault_hook) when the controller did. ``seen``: a caller
        got this error as its reply already."""
        if owner is None:
            if self.sink is not None:
                self.rt.send(self.sink[0], self.sink[1], Unhandled.make(err, seen, aid))
            return
        addr, key, owner_aid = owner
        self.rt.send(addr, key, Supervise.make(owner_aid, failure, aid))

    def _cleanup(self, slot: ActorSlot, exc) -> None:
        """``__cleanup__(exc)`` (Monarch's signature; an old ``__cleanup__(self)`` still
        works), awaited on the proc's event loop when it is ``async def``."""
        fn = getattr(slot.obj, "__cleanup__", None)
        if fn is None:
            return
        token = _CTX.set(slot.ctx)
        try:
            try:
                takes_exc = len(inspect.signature(fn).parameters) >= 1
            except (TypeError, ValueError):
                takes_exc = True
            res = fn(exc) if takes_exc else fn()
            if inspect.isawaitable(res):
                asyncio.run_coroutine_threadsafe(_awaited(res), self._event_loop()).result(CLEANUP_TIMEOUT_S)
        except Exception:
            traceback.print_exc()
        finally:
            _CTX.reset(token)

    def do_stop_actor(self, msg):
        m = StopActor.of(msg)
        aid, reason = m.actor_id, m.reason
        slot = self.actors.pop(aid, None)
        self.owned.pop(aid, None)
        if slot is not None:
            self._gone(aid, slot.name, f"it was stopped ({reason})", None)
            self._cleanup(slot, None)
        if m.call_id:
            self._reply(m.reply_to, m.call_id, True, None)

    def do_abort_actor(self, msg):
        _, aid, reason = AbortActor.of(msg)
        slot = self.actors.get(aid)
        if slot is not None:
            err = ActorError(f"aborted: {reason}", rank=self.rank, host=self.host, exc_type="Abort",
                             actor=slot.name)
            self._kill(aid, err, None)

    def do_kill_actor(self, msg):
        """An async endpoint failed its actor: stopped here, on the main thread."""
        _, aid, err, seen = KillActor.of(msg)
        self._kill(aid, err, self._kill_exc.pop(aid, None), seen)

    # called by context().actor_instance.stop()/abort() (any thread): after the current message
    def stop_actor(self, aid: str, reason: str) -> None:
        self.rt.send(self.work_addr, self.key, StopActor.make(aid, reason))

    def abort_actor(self, aid: str, reason: str) -> None:
        self.rt.send(self.work_addr, self.key, AbortActor.make(aid, reason))

    def do_supervise(self, msg):
        _, owner, failure, child = Supervise.of(msg)
        slot = self.actors.get(owner)
        if slot is None or not hasattr(slot.obj, "__supervise__"):
            self._unhandled(slot, failure, owner)
            return
        token = _CTX.set(slot.ctx)
        try:
            res = slot.obj.__supervise__(failure)
        except BaseException:
            traceback.print_exc()
            res = False
        finally:
            _CTX.reset(token)
        if inspect.isawaitable(res):   # async def __supervise__: awaited on the event loop
            def done(f):
                try:
                    handled = bool(f.result())
                except BaseException:
                    traceback.print_exc()
                    handled = False
                if not handled:
                    self._unhandled(slot, failure, owner)

            asyncio.run_coroutine_threadsafe(_awaited(res, slot.ctx), self._event_loop()).add_done_callback(done)
            return
        if not res:
            self._unhandled(slot, failure, owner)

    def _unhandled(self, slot, failure, aid) -> None:
        """A failure the supervising actor ``aid`` did not handle goes up to its own owner
        (Monarch's supervision tree); from the top, to the controller's unhandled_fault_hook."""
        if slot is not None and slot.owner is not None:
            addr, key, owner_aid = slot.owner
            self.rt.send(addr, key, Supervise.make(owner_aid, failure, aid))
            return
        if self.sink is not None:
            err = SupervisionError(failure, f"unhandled by {slot.name if slot else 'its owner'} "
                                            "(no __supervise__, or it returned a falsy value)")
            self.rt.send(self.sink[0], self.sink[1], Unhandled.make(err))

    # ---------------------------------------------------------------- replies and errors
    def _hold_reply(self, reply_to: str, call_id: int, ok: bool, value) -> None:
        """(main thread) Keep a quick call's plain reply while more calls wait in the work inbox,
        and send the replies of the run as one signed message (messages.Replies): one
        signature, one send here and one check and one wake-up at the caller for up to
        HOLD_MAX calls. A reply is held at most HOLD_S, and never while a call that is not
        known to be quick runs (do_call), nor behind output or another message (they send
        what is held first), so a pipeline's replies come back as before, a little grouped.
        Replies to the agent (fanned calls) and values that are not plain go as before."""
        held = self._held
        if held and reply_to != self.held.to or self.output_batch.pending or self.output_limit.skipped \
                or reply_to.startswith(_FAN_PREFIX):
            self._reply(reply_to, call_id, ok, value)
            return
        self.held.add(reply_to, call_id, ok, value)

    def _reply(self, reply_to, call_id, ok, value, rank=None):
        if self._held and threading.get_ident() == self.main_ident:
            self.send_held_replies()   # in the order the calls ran
        if self.output_batch.pending or self.output_limit.skipped:
            # Output goes before the reply it belongs to, the same way (the call is over: the
            # busy call is this one again while its output is flushed; a batch the timer is
            # sending is waited for).
            saved, self.busy_call = self.busy_call, (reply_to, call_id)
            try:
                self.flush_output()
            finally:
                self.busy_call = saved
        if (type(call_id) is int and call_id and type(value) in PLAIN_TYPES and type(reply_to) is str
                and not reply_to.startswith(_FAN_PREFIX)):
            # The usual reply (a plain value to a direct call): pickled in one C call and signed in
            # one pass. messages.Reply as a literal, in field order.
            self.rt.send_plain(reply_to, self.key, ("r", call_id, self.proc_key, ok, value))
            return
        if isinstance(call_id, Port):   # send(endpoint, ..., port=p): the result goes to the port
            try:
                call_id._post(ok, value, rank)
            except Exception:
                traceback.print_exc()
            return
        if not call_id:   # broadcast: fire and forget; failures still reach the controller
            if not ok and self.sink is not None:
                self.rt.send(self.sink[0], self.sink[1], Unhandled.make(value))
            return
        if fanout.fanned(self.gather, reply_to):   # back through the agent, batched per host
            fanout.send_fanned_reply(self.rt, self.gather, self.key, reply_to, call_id, self.proc_key, ok, value,
                                     lambda e: self._unsendable(value, e), self.link)
            return
        reply_to = fanout.real_address(reply_to)
        try:
            # messages.Reply as a literal, in field order: the hot path of every call
            frames = self.rt.pack(self.key, ("r", call_id, self.proc_key, ok, value), (reply_to,))
        except Exception as e:
            frames = self.rt.pack(self.key, Reply.make(call_id, self.proc_key, False, self._unsendable(value, e)))
        self.rt.send_frames(reply_to, frames)

    def _unsendable(self, value, e: BaseException) -> ActorError:
        return ActorError(f"the result ({type(value).__name__}) could not be sent back: {e}",
                          rank=self.rank, host=self.host, exc_type="PicklingError")

    def _error(self, e: BaseException, where: str) -> ActorError:
        debugger.post_mortem(e)   # stops here first when `%mesh debug --post-mortem on`
        tb = e.__traceback__.tb_next if e.__traceback__ is not None else None
        text = "".join(traceback.format_exception(type(e), e, tb))
        err = ActorError(f"{type(e).__name__}: {e}", rank=self.rank, host=self.host,
                         exc_type=type(e).__name__, remote_traceback=text, actor=where)
        try:
            wire.dumps(e)
            err.__cause__ = e
        except Exception:
            pass
        return err

    # ---------------------------------------------------------------- async endpoints
    def _event_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            threading.Thread(target=self._loop.run_forever, name="monarch-async", daemon=True).start()
        return self._loop

    def _run_async(self, slot, aid, method, args, kwargs, reply_to, call_id, explicit):
        where = f"{slot.name}.{method}"
        key = call_id or object()   # a broadcast has no call id; it can still be interrupted

        async def run():
            _CTX.set(slot.ctx)
            exc = None
            started, t0 = time.time(), time.perf_counter()
            try:
                value, ok = await getattr(slot.obj, method)(*args, **kwargs), True
            except asyncio.CancelledError as e:   # an interrupt: the call fails, the actor lives on
                value, ok = self._error(e, where), False
                value.message = f"interrupted: {where} was cancelled (CancelledError raised in it)"
            except BaseException as e:
                value, ok, exc = self._error(e, where), False, e
            finally:
                self.async_calls.pop(key, None)
            self.telemetry.record_call(slot.name, method, args, started, time.perf_counter() - t0, ok, value)
            # a CancelledError is what interrupting an async endpoint raises in it: not fatal
            interrupted = isinstance(exc, asyncio.CancelledError)
            if _fails_the_actor(exc, call_id, interrupted):   # stopped on the main thread, after the reply
                self._kill_exc[aid] = exc
                self._finish_call(aid, reply_to, call_id, ok, value, explicit, None)
                self.rt.send(self.work_addr, self.key, KillActor.make(aid, value, bool(call_id)))
            else:
                self._finish_call(aid, reply_to, call_id, ok, value, explicit, exc, interrupted)

        holder = self.async_calls[key] = [None, where]   # before it runs: it removes itself when done
        holder[0] = asyncio.run_coroutine_threadsafe(run(), self._event_loop())


_FAN_PREFIX = fanout.FAN_PREFIX
_dumps, _loads = pickle.dumps, pickle.loads
_NONE_PICKLED = pickle.dumps(None, 5)   # the usual value of a call made for its effect
_LINK_CALL = fanlink.CALL   # a fan link record's kind: a whole call
_clock, _time = time.perf_counter, time.time
_NOBLOCK = int(zmq.NOBLOCK)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_QUEUED_S = 20e-6  # a blocking recv back within this: the message was already waiting
QUICK_S = 100e-6   # a call this quick may have its reply held, and run while others' are held
UNBORN_WAIT_S = 5.0   # a call for an actor this proc never had waits this long for its spawn


def main_thread_at(frames: int = 3) -> str:
    """Where this proc's main thread is now, innermost last: ``file:line function`` of its
    last few Python frames (a rank blocked in native code shows the Python call it is in),
    for a state query asked while it is busy."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    at = []
    while frame is not None and len(at) < frames:   # (no source read: `%mesh top` asks every second)
        code = frame.f_code
        at.append(f"{os.path.basename(code.co_filename)}:{frame.f_lineno} {code.co_name}")
        frame = frame.f_back
    return " > ".join(reversed(at))


def _method_entry(slot: ActorSlot, method: str) -> tuple:
    """(name, is async, takes a response port, state while it runs) of ``method`` as sent."""
    explicit = method.startswith(EXPLICIT_PORT_MARK)
    if explicit:
        method = method[len(EXPLICIT_PORT_MARK):]
    fn = getattr(type(slot.obj), method, None)
    explicit = explicit or bool(getattr(fn, "_monarch_explicit_port", False))
    return [method, asyncio.iscoroutinefunction(fn), explicit, f"in {slot.name}.{method}", False]


def _fails_the_actor(exc, call_id, interrupted: bool) -> bool:
    """Monarch's rule: a BaseException, or any raise nobody waits on (broadcast), fails the
    actor; an Exception with a caller fails only the call; our own interrupt never does."""
    return exc is not None and not interrupted and (not isinstance(exc, Exception) or not call_id)


async def _awaited(awaitable, ctx=None):
    if ctx is not None:
        _CTX.set(ctx)
    return await awaitable


CLEANUP_TIMEOUT_S = 30.0


def main(cfg: dict) -> int:
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.environ["RANK"] = str(cfg["rank"])
    os.environ["LOCAL_RANK"] = str(cfg.get("local_index", 0))
    os.environ[config.PROC.env] = cfg["proc_key"]
    gpus = gpu_count()
    if gpus and not config.KEEP_CUDA_VISIBLE.get():
        os.environ["CUDA_VISIBLE_DEVICES"] = str(cfg.get("local_index", 0) % gpus)
    rt = Runtime(bind_host=cfg["bind"], role="proc")
    install_runtime(rt)
    worker = ProcWorker(rt, cfg)
    if cfg.get("sync"):   # synced code on this host: its folders on sys.path, the cwd
        from monarch_kernel.sync.reload import setup_proc

        setup_proc(cfg["sync"])
    global WORKER
    WORKER = worker
    context_mod.set_proc_worker(worker)
    debugger.install(worker)   # breakpoint() / pdb.set_trace() talk to the controller
    from monarch_kernel.node.rich_output import use_on_this_rank

    use_on_this_rank()   # display() and plt.show() reach the notebook, not the kernel's backend
    sys.stdout, sys.stderr = worker.stdout, worker.stderr
    try:
        return worker.serve()
    finally:
        worker.flush_output()
        time.sleep(0.05)


WORKER: ProcWorker | None = None
QUERY_EXTRAS: list = []   # functions (worker) -> dict merged into a proc's query answer
