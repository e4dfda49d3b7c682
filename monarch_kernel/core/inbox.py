"""The inbox and the runtime's one concurrency story.

Every thread that touches the runtime, and what it may do:

  * **the I/O thread** (``monarch-io``, one per process, ``Inbox._io_loop``): owns the
    DEALER links to host agents (agent_links.py: requests, events, heartbeats) and reads
    the inbox (a PULL socket every reply, output line and notice is sent to) while no
    other thread waits on it. It resolves Futures and runs message handlers.
  * **user threads** (the main thread, a notebook's kernel thread, any thread the user
    starts): send (transport.py: a PUSH socket per thread and destination) and wait.
    A thread blocked in ``Future.get`` reads the inbox itself (``wait_for``, leader /
    follower below), so its reply (or a host's fan-in batch) wakes it directly instead of
    through a second thread. Work for the agent links is handed to the I/O thread with
    ``call_in_io`` (a queue and a byte on a wake pipe).
  * **a proc's main thread** (node/proc.py) runs user code; waiting inside an endpoint it
    also serves its own work inbox (``serve_work_while_waiting``), so an actor can call
    another actor of its own proc. A proc's ``monarch-async`` thread runs async
    endpoints; it sends and waits like a user thread.
  * **helper threads** (``monarch-controller-spawn`` for get_or_spawn_controller, the
    kernel's ``monarch-spawn`` / ``monarch-prewarm``): user threads by these rules.
  * **the kernel's asyncio loop** never blocks on the inbox: it learns of results through
    ``Future.add_done_callback`` + ``call_soon_threadsafe``.

Handlers run on whichever thread reads the inbox at that moment: they must not block on
another reply (a handler that must, hands the work to a thread, as controllers.py does).
"""
from __future__ import annotations

import collections
import logging
import os
import threading
import time
from typing import Callable

import zmq

from . import curve, wire
from .future import Future
from .host_liveness import IO_THREAD_NAME, name_this_thread
from .release_timer import open_timer
from .transport import ipc_name

log = logging.getLogger("monarch_kernel")

_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)   # plain ints: the enums cost on the hot path
_NOBLOCK = int(zmq.NOBLOCK)
DRAIN_SLICE_S = 0.05   # the I/O thread reads a burst this long before its heartbeat tick
_get_ident = threading.get_ident
_SHORT_POLL_MS = 10   # the I/O thread's poll while a user thread reads the inbox (or just did): _poll_ms
LONG_HOLD_S = 0.002   # ... unless its last two waits took this long: a loop of such calls (_poll_ms)


class Inbox:
    """The PULL socket peers send to, the I/O thread, and who reads the socket when."""

    def __init__(self, ctx: zmq.Context, keyring: wire.Keyring, bind_host: str):
        self.ctx = ctx
        self.keyring = keyring
        self.sock = ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.HANDSHAKE_IVL, 5000)   # peers that never greet are dropped
        self.curve_public = curve.process_keys()[0].decode() if curve.wanted(bind_host) else ""
        # tcp: CURVE, and frames capped before any handshake (curve.py); senders cut large ones.
        self.address = curve.with_key(curve.bind(self.sock, f"tcp://{bind_host}:*",
                                                 curve.process_keys()[1] if self.curve_public else None,
                                                 curve.MAX_FRAME),
                                      self.curve_public)
        # Peers on this host reach the inbox over ipc (a socket file in a directory only this
        # user enters, transport.ipc_dir), 5-30 us quicker a round trip than tcp here.
        self.ipc_address = ipc_name("inbox")
        self.sock.bind(self.ipc_address)
        keyring.accept("inbox", wire.dest_id(self.address), wire.dest_id(self.ipc_address))
        self._tasks: collections.deque = collections.deque()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._closing = False
        # Hand-off (see wait_for): whoever holds _lock reads the inbox.
        self._lock = threading.Lock()
        self._holder: int | None = None      # thread ident of the reader
        self._wanted = 0                     # user threads that want to read it
        self._want_lock = threading.Lock()
        self._released_at = 0.0
        self._wanted_since = 0.0             # when _wanted last went from 0 to 1
        self._long_holds = 0                 # how many of the last of those lasted LONG_HOLD_S or more, in a row
        self._long_poll = False              # the I/O thread sleeps past 2 ms: wake it after a release
        # ... through this timer, unless the inbox is wanted again first (release_timer.py; None: a kick)
        self._release_timer = open_timer(_SHORT_POLL_MS / 1000)
        self._timer_armed = False
        # Set by a proc worker: (work socket, handler) its main thread serves while it waits.
        self._nested_work: tuple | None = None
        self._nested_thread: int | None = None
        # The debugger's console (issue 5): a thread blocked in Future.get() runs hook() when
        # it is that hook's thread and someone called want_wait_hook(). It runs inside get(),
        # with the inbox handed back to the I/O thread, so it may block (input()) and wait on
        # other futures.
        self._wait_hook: tuple[int, Callable[[], None]] | None = None
        self._wait_hook_due = False
        self._dispatch: Callable = _ignore
        self._wake_self: Callable[[], None] = _noop
        self._agents = None
        self._thread: threading.Thread | None = None
        self._io_ident: int | None = None

    def start(self, dispatch: Callable, agents, wake_self: Callable[[], None]) -> None:
        """Start the I/O thread. ``dispatch(msg)`` handles an inbox message; ``agents``: the
        AgentLinks it polls and ticks; ``wake_self()`` sends this inbox a message."""
        self._dispatch, self._agents, self._wake_self = dispatch, agents, wake_self
        self._poller = zmq.Poller()       # without the inbox
        self._poller_in = zmq.Poller()    # with it
        self._poller_in.register(self.sock, zmq.POLLIN)
        for p in (self._poller, self._poller_in):
            p.register(self._wake_r, zmq.POLLIN)
            if self._release_timer is not None:
                p.register(self._release_timer.fd, zmq.POLLIN)
        self._thread = threading.Thread(target=self._io_loop, name="monarch-io", daemon=True)
        self._thread.start()
        self._io_ident = self._thread.ident

    def is_io_thread(self) -> bool:
        return threading.current_thread() is self._thread

    # ----------------------------------------------------------------- work for the I/O thread
    def call_in_io(self, fn: Callable[[], None]) -> None:
        if threading.current_thread() is self._thread:
            fn()
            return
        self._tasks.append(fn)
        os.write(self._wake_w, b"x")

    def watch_socket(self, sock) -> None:
        """(I/O thread) Poll ``sock`` too (an agent link)."""
        self._poller.register(sock, zmq.POLLIN)
        self._poller_in.register(sock, zmq.POLLIN)

    def unwatch_socket(self, sock) -> None:
        self._poller.unregister(sock)
        self._poller_in.unregister(sock)

    # ----------------------------------------------------------------- the I/O thread
    def _io_loop(self):
        name_this_thread(IO_THREAD_NAME)   # what an agent watching us sees (host_liveness.py)
        try:
            self._serve()
        finally:
            if self._closing:
                self._agents.close()   # (the links' pidfds; the context's destroy closes their sockets)
                if self._release_timer is not None:
                    self._release_timer.close()

    def _serve(self):
        """Poll agents and the wake pipe always; the inbox only while no user thread waits
        on it (and not within 1 ms of one letting go, so back-to-back calls don't churn)."""
        from .agent_links import HEARTBEAT_S

        poller, poller_in, agents = self._poller, self._poller_in, self._agents
        inbox, opener, lock, dispatch = self.sock, self.keyring.open, self._lock, self._dispatch
        me = threading.get_ident()
        timer = self._release_timer
        timer_fd = timer.fd if timer is not None else None
        next_tick = 0.0
        while not self._closing:
            have = heard = False
            if not self._wanted and time.monotonic() - self._released_at > 0.001:
                have = lock.acquire(blocking=False)
                if have and self._wanted:
                    lock.release()
                    have = False
            try:
                if have:
                    self._holder = me
                timeout = self._poll_ms(have, next_tick)
                events = (poller_in if have else poller).poll(timeout)
                self._long_poll = False
            except zmq.ZMQError:
                if have:
                    self._holder = None
                    lock.release()
                if self._closing:
                    return
                raise
            try:
                for sock, _ in events:
                    if sock is inbox:
                        self._drain(inbox, opener, dispatch)
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
                    elif sock == timer_fd:   # a user thread let the inbox go a while ago: take it (above)
                        timer.clear()
                    else:
                        link = agents.owns(sock)
                        if link is not None:
                            agents.on_socket(link)
                            heard = True
            finally:
                if have:
                    self._holder = None
                    lock.release()
            now = time.monotonic()
            if heard:   # every agent answered: no tick before the next heartbeat is due
                next_tick = max(next_tick, agents.answered_until())
            if now >= next_tick:
                agents.tick(now)
                # Half a period while an agent has a heartbeat unanswered, else (answered, or
                # calls stand for them: AgentLinks.tick) the next one due.
                next_tick = max(now + HEARTBEAT_S / 2, agents.answered_until())

    @staticmethod
    def _drain(inbox, opener, dispatch) -> None:
        """(I/O thread) What the inbox holds, after poll said it holds something. After the
        first message, whether more waits is asked with EVENTS: a wake often brings one
        message (a fan-in batch), and the recv that fails to end a burst raises zmq.Again
        (3x EVENTS' cost quiet; ~50 µs on a loaded 2-core VM). A burst (pipelined replies)
        is then read until that failed recv, one per burst rather than EVENTS per message.

        A burst that does not end (256 ranks printing as fast as they can: fan-in batches of
        output, ~10 ms each to route) is read for DRAIN_SLICE_S at most, then the loop goes
        round: heartbeats are due. Unbounded, one drain ran 5.3 s, the agents heard no
        heartbeat for 3 s and detached from the controller mid-cell, and their procs' lines
        went to the host's stderr instead of the notebook."""
        recv = wire.recv_message
        clock = time.monotonic
        until = clock() + DRAIN_SLICE_S
        for i in range(10_000):
            try:
                frames = recv(inbox, _NOBLOCK)
            except zmq.Again:
                return
            msg = opener(frames, "inbox")
            if msg is not None and type(msg) is tuple:
                dispatch(msg)
            if not i and not inbox.getsockopt(_EVENTS) & _POLLIN:
                return
            if not i & 7 and clock() > until:
                return

    def _wanted_recently(self) -> bool:
        return bool(self._wanted) or time.monotonic() - self._released_at <= 0.001

    def _poll_ms(self, have: bool, next_tick: float) -> int:
        """How long the I/O thread may sleep in poll. While a user thread has read the inbox
        for over 10 ms (a long call), it sleeps up to the next heartbeat tick instead of waking
        to see whether the inbox came back: the waiter arms the release timer when it lets go
        (``_unwant``), and the next wait, in a loop of calls, disarms it: the I/O thread sleeps
        through the loop. So does a wait that follows two of LONG_HOLD_S or more (a loop of
        calls to 64 procs, ~5 ms each, woke it every 10 ms: ~35 µs a call; arming and disarming
        the timer is ~5; two, so that a call_one held up once on a loaded machine does not
        make the next ones arm it). (A wake costs ~50-200 µs of CPU on this VM: a 50 ms cap woke it 20
        times a second through a 5 s ``call_one``.) Shorter waits keep _SHORT_POLL_MS polls, so
        back-to-back small calls cost no kick; after the last of them, what nobody waits for
        (output, a callback's reply) is read within that time. 10 ms rather than 2: a
        ``call_one`` loop woke the I/O thread (and took the GIL from the caller) every 2 ms,
        2-3 µs of CPU a call."""
        if have:
            # Nothing to do before the next heartbeat tick (a waiter kicks us through the wake
            # pipe to take the inbox): with none (a proc), sleep until a message or a kick. 256 procs woke 10 times
            # a second each for nothing: 0.3 of a CPU on a 2-core host (issue 11).
            if not self._agents.heartbeating():
                return -1
            return max(1, int((next_tick - time.monotonic()) * 1000) + 1)
        if not self._wanted_recently():
            return 100
        now = time.monotonic()
        if not self._wanted or (now - self._wanted_since < 0.01
                                and (self._long_holds < 2 or self._release_timer is None)):
            return _SHORT_POLL_MS
        self._long_poll = True
        if not self._wanted:   # let go meanwhile (it saw no long poll to wake): stay short
            self._long_poll = False
            return _SHORT_POLL_MS
        return max(2, int((next_tick - now) * 1000) + 1)

    def _want(self) -> None:
        with self._want_lock:
            if not self._wanted:
                self._wanted_since = time.monotonic()
                if self._timer_armed:   # wanted again before the I/O thread took it back
                    self._timer_armed = False
                    self._release_timer.disarm()
            self._wanted += 1

    def _unwant(self, got: bool = True) -> None:
        """Let the inbox go. ``got``: the waiter got what it waited for (a loop of calls waits
        again at once). A wait that gave up instead (a timeout: a kernel's cell goes on waiting
        from its asyncio loop, through the I/O thread) hands the inbox back at once: kicked, the
        I/O thread would otherwise see a release under 1 ms old and poll 10 ms more first."""
        with self._want_lock:
            self._wanted -= 1
            self._released_at = now = time.monotonic()
            if self._wanted:
                return
            self._long_holds = self._long_holds + 1 if now - self._wanted_since >= LONG_HOLD_S else 0
            if not got:
                self._released_at = 0.0
                os.write(self._wake_w, b"i")
                return
            if self._long_poll:   # the I/O thread sleeps until its next tick
                if self._release_timer is None:
                    os.write(self._wake_w, b"i")   # it takes the inbox back now
                elif not self._closing:   # it takes it back in _SHORT_POLL_MS, unless wanted again
                    self._timer_armed = True
                    self._release_timer.arm()

    def wake_reader(self) -> None:
        """A user thread blocked on the inbox in wait_for must re-check its future."""
        holder = self._holder
        if holder is not None and holder != threading.get_ident():
            self._wake_self()

    # ----------------------------------------------------------------- waiting on the inbox
    def wait_for(self, fut: Future, timeout: float | None) -> None:
        """Called by ``Future.get`` on a pending future: read the inbox in this thread until
        ``fut`` is done, so its reply wakes this thread directly. A call fanned out through
        host agents too (its hosts' batches, core/fanout.py), however long: it used to be left
        to the I/O thread past 10 ms (it read the batch, then woke this thread: two wakes, and
        the GIL passed between them, ~0.25 ms more CPU a call to all 256 procs here); with the
        release timer the I/O thread sleeps through a loop of such calls.

        Leader/follower: the inbox is read by whoever holds ``_lock`` (a mutex is the full
        memory barrier zmq asks for to move a socket between threads). The I/O thread holds
        it only while nobody waits and gives it up when kicked through the wake pipe; a
        second waiting thread leaves the inbox to the first and waits on its future.
        """
        me = _get_ident()
        if me == self._io_ident or self._holder == me:
            return  # re-entrant (a handler waiting): fall back to the plain wait
        deadline = None if timeout is None else time.monotonic() + timeout
        done = fut.done
        self._want()
        try:
            while not done():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise fut.timeout_error(timeout)
                if self._lock.acquire(blocking=False) or self._lock.acquire(timeout=0.002):
                    self._holder = me
                    try:
                        self._pump(fut, deadline, timeout)
                    finally:
                        self._holder = None
                        self._lock.release()
                    hook = self._wait_hook
                    if self._wait_hook_due and hook is not None and hook[0] == me and not done():
                        self._run_wait_hook(hook[1])
                        continue
                    return
                holder = self._holder
                if holder == self._thread.ident:
                    os.write(self._wake_w, b"i")   # kick the I/O thread out of its poll
                elif holder is not None:
                    fut.wait_briefly(0.01 if left is None else min(0.01, left))
        finally:
            self._unwant(done())

    def _pump(self, fut: Future, deadline, timeout) -> None:
        if self._nested_work is not None and _get_ident() == self._nested_thread:
            try:
                return self._pump_nested(fut, deadline, timeout)
            finally:
                after = self._nested_work[3]
                if after is not None:
                    after()
        inbox, opener, dispatch, recv = self.sock, self.keyring.open, self._dispatch, wire.recv_message
        done = fut.done
        if deadline is None:
            # No deadline (the usual get()): a blocking recv (what a poll without timeout waited
            # for anyway, at a few system calls less); whoever resolves fut otherwise sends us a
            # "wake".
            while not done():
                if self._wait_hook_due:
                    hook = self._wait_hook
                    if hook is not None and hook[0] == _get_ident():
                        return
                msg = opener(recv(inbox), "inbox")
                if msg is not None and type(msg) is tuple:
                    dispatch(msg)
            return
        events, POLLIN, zpoll, poll_in = _EVENTS, _POLLIN, zmq.zmq_poll, [(self.sock, _POLLIN)]
        while not done():
            if self._wait_hook_due:
                hook = self._wait_hook
                if hook is not None and hook[0] == _get_ident():
                    return
            if not inbox.getsockopt(events) & POLLIN:
                if not zpoll(poll_in, _ms_left(deadline, fut, timeout)):
                    continue
            msg = opener(recv(inbox), "inbox")
            if msg is not None and type(msg) is tuple:
                dispatch(msg)

    def _pump_nested(self, fut: Future, deadline, timeout) -> None:
        """A proc's main thread waiting inside an endpoint: besides its replies, take work
        from its own work inbox, so a sync endpoint can call another actor of its own proc
        without deadlocking."""
        inbox, opener, dispatch, recv = self.sock, self.keyring.open, self._dispatch, wire.recv_message
        work, handle, also, _ = self._nested_work
        events, POLLIN = _EVENTS, _POLLIN
        poller = zmq.Poller()
        poller.register(inbox, POLLIN)
        poller.register(work, POLLIN)
        if also is not None:
            poller.register(also[0], POLLIN)
        done = fut.done
        while not done():
            if inbox.getsockopt(events) & POLLIN:
                msg = opener(recv(inbox), "inbox")
                if msg is not None and type(msg) is tuple:
                    dispatch(msg)
                continue
            if work.getsockopt(events) & POLLIN:
                handle(recv(work))
                continue
            ready = poller.poll(_ms_left(deadline, fut, timeout))
            if also is not None and any(s == also[0] for s, _ in ready):
                also[1]()

    def serve_work_while_waiting(self, work_sock, handler: Callable,
                                 also: tuple[int, Callable[[], None]] | None = None,
                                 after: Callable[[], None] | None = None) -> None:
        """(a proc's main thread) While it waits on a future, also pass what arrives on
        ``work_sock`` to ``handler(frames)``; ``also``: (fd, fn), another inbox of its own (a
        proc's fan link, node/fanlink.py), fn() reads it when fd is readable; ``after()`` runs
        when such a wait ends (it may have left messages in ``work_sock`` that its ZMQ_FD will
        not signal again: a caller that waits on that FD must then read it until empty)."""
        self._nested_work = (work_sock, handler, also, after)
        self._nested_thread = threading.get_ident()

    # ----------------------------------------------------------------- the wait hook
    def set_wait_hook(self, hook: tuple[int, Callable[[], None]] | None):
        """``hook``: (thread ident, fn) or None; returns the previous one."""
        old, self._wait_hook = self._wait_hook, hook
        return old

    @property
    def wait_hook(self):
        return self._wait_hook

    def want_wait_hook(self) -> None:
        """Make the hook's thread run it as soon as it waits in Future.get (or now, if it does)."""
        self._wait_hook_due = True

    def _run_wait_hook(self, fn: Callable[[], None]) -> None:
        """Run the wait hook with the inbox left to the I/O thread."""
        self._wait_hook_due = False
        self._unwant()
        try:
            fn()
        finally:
            self._want()

    # ----------------------------------------------------------------- binding and closing
    def bind_also(self, host: str) -> tuple[str, str]:
        """Also accept on ``tcp://host:*``; returns (address, CURVE public key or ""). The
        socket is taken over as ``wait_for`` does, so no other thread touches it meanwhile."""
        self._want()
        try:
            while not self._lock.acquire(timeout=0.002):
                if self._holder == self._thread.ident:
                    os.write(self._wake_w, b"i")
            try:
                pub = curve.process_keys()[0].decode() if curve.wanted(host) else ""
                addr = curve.with_key(curve.bind(self.sock, f"tcp://{host}:*", curve.process_keys()[1] if pub
                                                 else None, curve.MAX_FRAME), pub)
                self.keyring.accept("inbox", wire.dest_id(addr))
            finally:
                self._lock.release()
        finally:
            self._unwant()
        return addr, pub

    def close(self) -> bool:
        """Stop the I/O thread (joined unless called from it). False if already closing."""
        if self._closing:
            return False
        self._closing = True
        os.write(self._wake_w, b"x")
        if self._thread is not None and threading.current_thread() is not self._thread:
            self._thread.join(2)
        return True


def _ms_left(deadline: float | None, fut: Future, timeout) -> int:
    """Milliseconds to poll before ``deadline`` (-1: no deadline); past it, the timeout."""
    if deadline is None:
        return -1
    ms = int((deadline - time.monotonic()) * 1000)
    if ms <= 0:
        raise fut.timeout_error(timeout)
    return ms


def _ignore(msg) -> None:
    pass


def _noop() -> None:
    pass
