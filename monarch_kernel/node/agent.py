"""The host agent: one per host, the unit of persistence.

  python -m workers.agent --bind 127.0.0.1 [--port 0] [--key-file F] [--name N]
                          [--lease SECONDS] [--persistent] [--conn-file PATH]

It owns a warm zygote (which forks procs) and so every proc of its host; it outlives any
one controller. Single-threaded: one zmq poll loop over its ROUTER and the zygote's pipe.
The controller attaches with ``hello`` and heartbeats; the agent tells it at once when a
proc dies (the zygote reaps it). Without a controller for ``--lease`` seconds a
persistent agent stops its procs and exits; a non-persistent one exits when its
controller is gone. Either way, when the agent dies its zygote and procs die with it.
The key comes from ``--key-file`` or the MONARCH_KERNEL_KEY environment variable (hex).
"""
from __future__ import annotations

if __name__ == "__main__" and "--zygote-fds" not in __import__("sys").argv:
    # Start the zygote before anything else: it imports torch (about a second) while this
    # process imports its own modules and binds its socket. (A job's node starter starts it
    # even earlier and hands it over with --zygote-fds.)
    import os as _os
    import subprocess as _sp
    import sys as _sys

    _EARLY_ZYGOTE = _sp.Popen([_sys.executable, "-m", "monarch_kernel.node.zygote"], stdin=_sp.PIPE, stdout=_sp.PIPE,
                              env={**_os.environ, "MONARCH_KERNEL_AGENT_PID": str(_os.getpid())})   # config.AGENT_PID
else:
    _EARLY_ZYGOTE = None

import argparse
import functools
import json
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid

import zmq

from monarch_kernel import config
from monarch_kernel.core import curve, wire
from monarch_kernel.core.errors import MeshFailure
from monarch_kernel.core.host_liveness import LocalAgentWatch
from monarch_kernel.core.messages import Ev, Rep, Req
from monarch_kernel.core.runtime import HOST_TIMEOUT_S, ProcRef, pid_alive, pid_space
from monarch_kernel.core.transport import SAME_HOST_IPC, ipc_name, remove_ipc_files
from monarch_kernel.node.fanout import FanRelay
from monarch_kernel.telemetry.agent import AgentTelemetry

log = logging.getLogger("monarch_kernel.agent")


def _zygote_end(zygote: subprocess.Popen, procs: int) -> str:
    """Why this host stops when its zygote ends, for its log (the notebook shows that line):
    the zygote forks and reaps every proc here, and they die with it (PR_SET_PDEATHSIG)."""
    code = None   # (one its caller started and reaps, _HandedZygote: its status is not ours to read)
    if isinstance(zygote, subprocess.Popen):
        try:
            code = zygote.wait(1)
        except subprocess.TimeoutExpired:
            pass
    if code is not None and code < 0:
        try:
            how = f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            how = f"was killed by signal {-code}"
        if -code == signal.SIGKILL:
            how += " (kill -9, or the kernel's out-of-memory killer: see `dmesg`)"
    else:
        how = "exited" if code is None else f"exited with code {code}"
    lost = f"; the {procs} procs it forked died with it" if procs else ""
    return f"the zygote (pid {zygote.pid}, the process that forks this host's procs) {how}{lost}"


class Proc:
    __slots__ = ("key", "mesh_id", "mesh_name", "rank", "pid", "ref", "ident", "state", "started")
    # Counts every change of any proc's ``state`` or ``ref``: the fan-out keeps, per member
    # list, which procs a fanned call goes to and how, until this moves (node/fanout.py).
    changes = 0

    def __setattr__(self, name, value):
        object.__setattr__(self, name, value)
        if name == "state" or name == "ref":
            Proc.changes += 1

    def __init__(self, key, mesh_id, mesh_name, rank):
        self.key, self.mesh_id, self.mesh_name, self.rank = key, mesh_id, mesh_name, rank
        self.pid = 0
        self.ref: ProcRef | None = None
        self.ident: bytes | None = None
        self.state = "starting"
        self.started = time.time()


def _preload_failed(failed: dict) -> None:
    for name, why in failed.items():
        log.warning("preload: %s could not be imported in the zygote: %s", name, why)


class HostAgent:
    def __init__(self, a, zygote: subprocess.Popen | None = None):
        self.name = a.name or f"agent-{os.getpid()}"
        self.host = config.HOST_NAME.get() or socket.gethostname()
        self.bind_host = a.bind
        self.key = _load_key(a)
        self.keyring = wire.Keyring()
        self.keyring.add(self.key)
        self.persistent = a.persistent
        self.lease = a.lease
        self.conn_file = a.conn_file
        self.id = uuid.uuid4().hex[:8]
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        # Before any MAC is checked: a frame over MONARCH_KERNEL_AGENT_MAX_MESSAGE drops its connection
        # instead of being allocated, and a connection that does not finish the ZMTP
        # handshake within 2 s is closed (idle unauthenticated sockets do not pile up).
        self.router.setsockopt(zmq.MAXMSGSIZE, max(config.AGENT_MAX_MESSAGE.get(), curve.MAX_FRAME) + 4096)
        self.router.setsockopt(zmq.HANDSHAKE_IVL, 2000)
        _raise_fd_limit()
        # Off this host, the link is CurveZMQ too (keys derived from the mesh key, curve.py).
        secret = curve.agent_keys(self.key)[1] if curve.wanted(a.bind) else None
        if a.bind in _WILDCARDS and a.bind != "::" and a.bind != "[::]":
            # Each address in the mode its peers expect (a peer on this host may dial 127.0.0.1).
            self.addr = curve.bind_every_interface(self.router, a.port or "*", curve.agent_keys(self.key)[1])
            self.addr = f"tcp://{a.bind}:{self.addr.rsplit(':', 1)[1]}"
        else:
            self.addr = curve.bind(self.router, f"tcp://{a.bind}:{a.port or '*'}", secret)
        if a.bind in _WILDCARDS:
            # Bound to every interface (as a pod's agent may be): tell peers, and bind our
            # procs to, an address they can reach, never 0.0.0.0.
            self.bind_host = _reachable_ip()
            self.addr = self.addr.replace(f"//{a.bind}:", f"//{self.bind_host}:", 1)
        # Its own procs reach it over ipc: no CURVE handshake per proc (a spawn of 256 spent
        # ~0.1 s of the agent's CPU, and as much of the procs', in them; issue 11).
        self.ipc_addr = ipc_name("agent") if SAME_HOST_IPC else ""
        if self.ipc_addr:
            self.router.bind(self.ipc_addr)
        self.keyring.accept("agent router", wire.dest_id(self.addr),   # requests name this port
                            *([wire.dest_id(self.ipc_addr)] if self.ipc_addr else []))
        self.procs: dict[str, Proc] = {}
        self.by_pid: dict[int, Proc] = {}
        self.spawns: dict[str, dict] = {}        # spawn id -> {ident, req, keys}
        self.registry: dict[str, dict] = {}      # mesh id -> what a re-attaching controller needs
        self.controller: bytes | None = None
        self.controller_addr: str | None = None
        self.controller_seen = time.monotonic()
        self.had_controller = False
        self.controller_watch: LocalAgentWatch | None = None   # a controller on this machine (op_hello)
        self.started = time.monotonic()
        self.counter = 0
        self.stopping = False
        self.parent_pid = a.parent_pid
        self.zygote = zygote or subprocess.Popen(
            [sys.executable, "-m", "monarch_kernel.node.zygote"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            env={**os.environ, config.AGENT_PID.env: str(os.getpid())}, cwd=os.getcwd())
        self.zygote_ready = False
        self.zygote_pending = b""   # commands the zygote's stdin pipe has not taken yet
        self.zygote_buf = b""
        self.queued_forks: list[dict] = []
        self.preloads_due: dict[int, tuple] = {}   # op_preload's requests the zygote has not answered
        self.sync_receiver = None   # code sync (monarch_kernel/sync/receiver.py), made on first use
        self.ps_procs: dict = {}    # pid -> psutil.Process, kept between status calls (CPU %)
        self.sync_setup = None      # what a new proc needs from code sync (its sys.path, cwd)
        # Sync ops run on one thread of their own, in order (a plan or commit of 50,000 files
        # takes seconds): this loop keeps answering heartbeats and reaping procs meanwhile.
        self.sync_jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.sync_done: queue.SimpleQueue = queue.SimpleQueue()
        self.sync_wake_r, self.sync_wake_w = os.pipe()
        os.set_blocking(self.sync_wake_r, False)
        self.sync_thread: threading.Thread | None = None
        self._load_sync_setup()
        self.telemetry = AgentTelemetry(self)   # samples, proc events, logs (ops tel_*; see its module)
        self.fanout = FanRelay(self)   # one message per host for calls to many procs (node/fanout.py)

    # ---------------------------------------------------------------- messaging
    def send(self, ident: bytes, msg) -> None:
        try:
            self.router.send_multipart([ident, *self.keyring.sign(self.key, wire.dumps(msg),
                                                                   wire.dest_of_identity(ident))], copy=False)
        except zmq.ZMQError as e:
            log.warning("could not send to %r: %s", ident, e)

    def reply(self, ident, req, ok, value) -> None:
        if req:
            self.send(ident, Rep.make(req, ok, value))

    def proc_changes(self) -> int:
        """Moves whenever a proc's state or ref changes (FanRelay's routes are kept until then)."""
        return Proc.changes

    def event(self, name, *args) -> None:
        if self.controller is not None:
            self.send(self.controller, Ev.make(name) + args)

    # ---------------------------------------------------------------- main loop
    def serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        zfd = self.zygote.stdout.fileno()
        os.set_blocking(zfd, False)
        poller.register(zfd, zmq.POLLIN)
        poller.register(self.sync_wake_r, zmq.POLLIN)
        fan_socks = self.fanout.sockets()
        for s in fan_socks:
            poller.register(s, zmq.POLLIN)
        while not self.stopping:
            for sock, _ in poller.poll(5 if self.zygote_pending else self.fanout.timeout_ms(100)):
                if sock is self.router:
                    self._drain_router()
                elif sock == zfd:
                    self._read_zygote(zfd)
                elif sock == self.sync_wake_r:
                    self._send_sync_replies()
                elif sock in fan_socks:
                    self.fanout.on_readable(sock)
            if self.zygote_pending:
                self._flush_zygote()
            self.fanout.tick()
            self._check_liveness()
            self.telemetry.tick(time.monotonic())
        self.shutdown()

    def _drain_router(self):
        while True:
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            ident = frames[0].bytes
            msg = self.keyring.open(curve.joined(frames[1:]), "agent router")   # large ones come in pieces
            if not isinstance(msg, tuple) or len(msg) != len(Req._fields) or msg[0] != Req.KIND:
                continue
            _, req, op, args = Req.of(msg)
            handler = getattr(self, "op_" + op, None)
            if handler is None and op.startswith("sync_"):
                self._queue_sync_op(ident, req, op, args)
                continue
            if handler is None and op.startswith("tel_"):
                handler = functools.partial(self.telemetry.handle, op)
            if handler is None:
                self.reply(ident, req, False, ValueError(f"unknown agent op {op!r}"))
                continue
            try:
                handler(ident, req, *args)
            except Exception as e:
                log.exception("op %s failed", op)
                self.reply(ident, req, False, e)

    def _read_zygote(self, fd):
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return
        if not chunk:
            log.error("%s; stopping", _zygote_end(self.zygote, len(self.procs)))
            self.stopping = True
            return
        self.zygote_buf += chunk
        while b"\n" in self.zygote_buf:
            line, self.zygote_buf = self.zygote_buf.split(b"\n", 1)
            ev = json.loads(line)
            if ev["op"] == "ready":
                self.zygote_ready = True
                log.info("zygote ready (preload %.2f s)", ev.get("preload_s", 0))
                _preload_failed(ev.get("failed") or {})
                for cfg in self.queued_forks:
                    self._write_zygote({"op": "fork", "cfg": cfg})
                self.queued_forks.clear()
            elif ev["op"] == "forked":
                p = self.procs.get(ev["key"])
                if p is not None:
                    p.pid = ev["pid"]
                    self.by_pid[p.pid] = p
                    if p.state == "stopping":   # its spawn failed meanwhile: it must not live
                        _kill(p.pid, signal.SIGKILL)
            elif ev["op"] == "exit":
                self._proc_exited(ev["pid"], ev["code"])
            elif ev["op"] == "imported":
                ident, req = self.preloads_due.pop(ev["req"], (None, 0))
                _preload_failed(ev["failed"])
                self.reply(ident, req, True, {"host": self.host, "seconds": ev["seconds"], "failed": ev["failed"]})

    def _write_zygote(self, cmd):
        """Queue a command and write what the pipe takes now. Never blocks: 256 fork commands
        (~1 KB each) overflow the 64 KB pipe while the zygote forks, and a loop blocked in
        write() answers no heartbeat (the controller then declared the host lost)."""
        self.zygote_pending += (json.dumps(cmd) + "\n").encode()
        self._flush_zygote()

    def _flush_zygote(self, block: bool = False) -> None:
        fd = self.zygote.stdin.fileno()
        os.set_blocking(fd, block)
        while self.zygote_pending:
            try:
                n = os.write(fd, self.zygote_pending)
            except BlockingIOError:
                return
            self.zygote_pending = self.zygote_pending[n:]

    def _check_liveness(self):
        now = time.monotonic()
        if self.parent_pid and os.getppid() != self.parent_pid:
            log.warning("the controller process %d that started this agent is gone: stopping",
                        self.parent_pid)
            self.stopping = True
        silent = now - self.controller_seen
        if self.controller is not None and silent > HOST_TIMEOUT_S and not self._controller_starved(now, silent):
            log.warning("controller %s silent for %.1f s: detached", self.controller_addr, silent)
            self._detach()
        if self.controller is None:
            # A silent controller may only be busy (holding its GIL): it gets the lease to come
            # back. A private agent's controller that is really gone is caught above by pid.
            idle_since = self.controller_seen if self.had_controller else self.started
            if self.lease is not None and now - idle_since > self.lease:
                log.warning("no controller for %.0f s: the lease is over, stopping", now - idle_since)
                self.stopping = True

    def _controller_starved(self, now: float, silent: float) -> bool:
        """A controller on this machine that wants the CPU is starved, not gone: the look it
        takes at a silent agent (core/host_liveness.py), up to STARVED_HOST_TIMEOUT_S. 256
        procs flooding output on 2 cores kept a kernel's I/O thread from the CPU (and the
        GIL) for 6 s; detached, the procs' lines went to this agent's stderr mid-cell."""
        w = self.controller_watch
        return w is not None and w.silence_is_load(now, silent)

    def _detach(self):
        self.controller = None
        self.controller_addr = None
        self.controller_seen = time.monotonic()
        for p in self.procs.values():
            if p.ident is not None and p.state == "alive":
                self.send(p.ident, Ev.make("sink") + (None, None))

    # ---------------------------------------------------------------- procs
    def _fork(self, mesh_id, mesh_name, rank, labels, sizes, sink, local_index):
        self.counter += 1
        key = f"{self.id}.{self.counter}"
        p = Proc(key, mesh_id, mesh_name, rank)
        self.procs[key] = p
        cfg = {"proc_key": key, "rank": rank, "mesh_id": mesh_id, "mesh_name": mesh_name,
               "labels": labels, "sizes": sizes, "key": self.key.hex(), "agent": self.addr, "agent_ipc": self.ipc_addr,
               "bind": self.bind_host, "host": self.host, "sink": sink, "local_index": local_index,
               "sync": self.sync_setup, **self.telemetry.proc_config(mesh_name, rank), **self.fanout.proc_config()}
        if self.zygote_ready:
            self._write_zygote({"op": "fork", "cfg": cfg})
        else:
            self.queued_forks.append(cfg)
        return key

    def _proc_exited(self, pid, code):
        remove_ipc_files(pid)   # its socket files, if it died without closing them
        p = self.by_pid.pop(pid, None)
        if p is None:
            return
        was = p.state
        p.state = "dead"
        how = f"killed by signal {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        self.telemetry.proc_exited(p, pid, how, stopping=was == "stopping")
        self.fanout.forget_proc(p)
        replied = self.fanout.replied_calls(p.key)
        if was == "stopping":
            self.procs.pop(p.key, None)
            return
        failure = MeshFailure(p.mesh_name, p.rank, self.host, pid, f"proc {how}", p.key)
        log.warning("proc %s (rank %s, pid %s) %s", p.key, p.rank, pid, how)
        for sid, sp in list(self.spawns.items()):
            if p.key in sp["keys"]:
                del self.spawns[sid]
                self.reply(sp["ident"], sp["req"], False,
                           RuntimeError(f"proc rank {p.rank} on {self.host} {how} while starting; the other "
                                        f"procs of this spawn were stopped"))
                self._cancel_spawn(sp["keys"])
        self.fanout.flush_all()   # what it sent before dying arrives before its death
        if replied:   # ... unless it goes up a tree: the controller then waits for those replies
            self.event("replied", p.key, replied)
        self.event("died", p.key, failure)
        for q in self.procs.values():
            if q.state == "alive" and q.ident is not None:
                self.send(q.ident, Ev.make("died") + (p.key, failure))

    def _stop_procs(self, procs, grace=1.0):
        for p in procs:
            if p.state in ("alive", "starting") and p.pid:
                p.state = "stopping"
                _kill(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        pending = [p for p in procs if p.state == "stopping" and p.pid]
        while pending and time.monotonic() < deadline:
            time.sleep(0.02)
            pending = [p for p in pending if pid_alive(p.pid)]
        for p in pending:
            _kill(p.pid, signal.SIGKILL)
        for p in procs:
            if p.state == "dead":
                self.procs.pop(p.key, None)

    # ---------------------------------------------------------------- code sync
    def _load_sync_setup(self):
        """At start: what earlier syncs set up for new procs (read once, before any op)."""
        from monarch_kernel.sync.receiver import SyncReceiver, base_dir

        self.sync_receiver = SyncReceiver(base_dir(self.name), self.host, self.addr)
        self.sync_setup = self.sync_receiver.proc_setup()

    def _queue_sync_op(self, ident, req, op, args):
        """Ops named ``sync_*`` run on the sync thread, one at a time in arrival order; their
        replies come back through ``sync_done`` and are sent from this loop (the ROUTER is
        this thread's alone)."""
        if self.sync_thread is None:
            self.sync_thread = threading.Thread(target=self._sync_worker, name="agent-sync", daemon=True)
            self.sync_thread.start()
        self.sync_jobs.put((ident, req, op, args))

    def _sync_worker(self):
        while True:
            job = self.sync_jobs.get()
            if job is None:
                return
            ident, req, op, args = job
            try:
                value, ok = self.sync_receiver.handle(op, args), True
                self.sync_setup = self.sync_receiver.proc_setup()
            except Exception as e:
                log.exception("sync op %s failed", op)
                value, ok = e, False
            self.sync_done.put((ident, req, ok, value))
            os.write(self.sync_wake_w, b"x")

    def _send_sync_replies(self):
        try:
            os.read(self.sync_wake_r, 4096)
        except BlockingIOError:
            pass
        while True:
            try:
                ident, req, ok, value = self.sync_done.get_nowait()
            except queue.Empty:
                return
            self.reply(ident, req, ok, value)

    # ---------------------------------------------------------------- ops (controller)
    def op_hello(self, ident, req, controller_addr, whoami=None):
        """``whoami``: the controller's (pid space, pid) (Runtime.whoami)."""
        if self.controller not in (None, ident):
            log.warning("controller %s replaced by %s", self.controller_addr, controller_addr)
            self.send(self.controller, Ev.make("superseded") + (controller_addr,))
        self._attach(ident, controller_addr)
        local = type(whoami) in (tuple, list) and len(whoami) == 2 and whoami[0] == pid_space()
        self.controller_watch = LocalAgentWatch(int(whoami[1]), "controller") if local else None
        self.reply(ident, req, True, self.describe())

    def _attach(self, ident, controller_addr):
        self.controller, self.controller_addr = ident, controller_addr
        self.controller_seen = time.monotonic()
        self.had_controller = True
        for p in self.procs.values():
            if p.ident is not None and p.state == "alive":
                self.send(p.ident, Ev.make("sink") + (controller_addr, self.key))

    def describe(self):
        return {"name": self.name, "host": self.host, "pid": os.getpid(), "pid_space": pid_space(),
                "addr": self.addr,
                "persistent": self.persistent, "lease": self.lease, "registry": self.registry,
                "dead": {k: p.rank for k, p in self.procs.items() if p.state == "dead"}, **self.fanout.describe()}

    def op_reroute(self, ident, req, dest, lost_parent, calls=None):
        """A controller lost a parent agent of our fan-in tree: send it our part directly."""
        self.reply(ident, req, True, self.fanout.reroute(dest, lost_parent, calls))

    def op_hb(self, ident, req, controller_addr=None):
        if ident != self.controller and self.controller is None and controller_addr:
            # We detached it after a silence (ours, or its: a stall either side); it is back.
            log.warning("controller %s answered again: attached", controller_addr)
            self._attach(ident, controller_addr)
        if ident == self.controller:
            self.controller_seen = time.monotonic()
            self.send(ident, Ev.make("hb"))

    def op_detach(self, ident, req):
        if ident == self.controller:
            self._detach()
        self.reply(ident, req, True, None)

    def op_lease(self, ident, req, seconds):
        """Change the lease (a kernel prewarms with a short one, then keeps the mesh)."""
        self.lease = None if seconds is None else float(seconds)
        self.reply(ident, req, True, None)

    def _cancel_spawn(self, keys):
        """A spawn that failed: stop what started, and kill what is still being forked."""
        procs = [self.procs[k] for k in keys if k in self.procs]
        for p in procs:
            if p.state == "starting" and not p.pid:
                p.state = "stopping"   # killed as soon as the zygote says it forked
        self._stop_procs([p for p in procs if p.pid])

    def check_capacity(self, n: int) -> None:
        """Refuse a spawn this host cannot hold, before forking anything: a cap on procs per
        host (MONARCH_KERNEL_MAX_PROCS) and the memory a proc needs
        (MONARCH_KERNEL_PROC_MEM_MB, against what the host has available now)."""
        import psutil

        running = sum(1 for p in self.procs.values() if p.state in ("starting", "alive"))
        cap = config.MAX_PROCS.get() or max(256, 8 * (os.cpu_count() or 1))
        if running + n > cap:
            raise ValueError(f"cannot start {n} proc(s) on host {self.host}: it runs {running} and holds at most "
                             f"{cap} (MONARCH_KERNEL_MAX_PROCS on the agent). Ask for fewer per host, or raise "
                             "the cap if the host really has room")
        per_mb = config.PROC_MEM_MB.get()
        avail_mb = psutil.virtual_memory().available / 2**20
        if n * per_mb > avail_mb:
            raise ValueError(f"cannot start {n} proc(s) on host {self.host}: they need about {n * per_mb:,.0f} MB "
                             f"({per_mb:.0f} MB each, MONARCH_KERNEL_PROC_MEM_MB) and {avail_mb:,.0f} MB are "
                             f"available; room for about {int(avail_mb // per_mb)}. Ask for fewer per host")

    def op_spawn(self, ident, req, mesh_id, mesh_name, ranks, labels, sizes, sink):
        self.check_capacity(len(ranks))
        keys = [self._fork(mesh_id, mesh_name, r, labels, sizes, sink, i) for i, r in enumerate(ranks)]
        self.spawns[uuid.uuid4().hex] = {"ident": ident, "req": req, "keys": keys}

    def op_abort_spawn(self, ident, req, mesh_id):
        """The controller gave up on spawning ``mesh_id`` (another host refused, or it timed
        out): stop this host's share, including procs still being forked."""
        for sid, sp in list(self.spawns.items()):
            if any(k in self.procs and self.procs[k].mesh_id == mesh_id for k in sp["keys"]):
                del self.spawns[sid]
        self._cancel_spawn([k for k, p in self.procs.items() if p.mesh_id == mesh_id])
        self.reply(ident, req, True, None)

    def op_respawn(self, ident, req, old_keys, sink):
        self.check_capacity(len(old_keys))
        keys = []
        for old in old_keys:
            p = self.procs.get(old)
            if p is None or p.state != "dead":
                raise ValueError(f"proc {old} is not dead here; only dead procs are respawned")
            self.procs.pop(old)
            keys.append(self._fork(p.mesh_id, p.mesh_name, p.rank, None, None, sink, p.rank))
        self.telemetry.expect_respawn(keys)
        self.spawns[uuid.uuid4().hex] = {"ident": ident, "req": req, "keys": keys, "old": old_keys}

    def op_ready(self, ident, req, key, pid, work, ctrl, work_ipc="", ctrl_ipc="", host_id="", curve_pub=""):
        """A proc reports it is up (sent from the proc's own agent link)."""
        p = self.procs.get(key)
        if p is None or p.state == "stopping":
            _kill(pid, signal.SIGKILL)   # its spawn failed or was stopped while it started
            return
        p.ident, p.state, p.pid = ident, "alive", pid
        self.by_pid[pid] = p
        p.ref = ProcRef(key, p.rank, self.host, pid, work, ctrl, self.addr, work_ipc, ctrl_ipc, host_id, curve_pub)
        self.telemetry.proc_ready(p)
        for sid, sp in list(self.spawns.items()):
            if all(self.procs[k].state == "alive" for k in sp["keys"] if k in self.procs):
                del self.spawns[sid]
                self.reply(sp["ident"], sp["req"], True, [self.procs[k].ref for k in sp["keys"]])

    def op_register(self, ident, req, mesh_id, record):
        if record is None:
            self.registry.pop(mesh_id, None)
        else:
            self.registry.setdefault(mesh_id, {}).update(record)
        self.reply(ident, req, True, None)

    def op_register_actor(self, ident, req, mesh_id, actor_id, record):
        m = self.registry.get(mesh_id)
        if m is not None and record is None:
            m.get("actors", {}).pop(actor_id, None)   # stopped: gone for later controllers too
        elif m is not None:
            m.setdefault("actors", {})[actor_id] = record
        self.reply(ident, req, True, None)

    def op_stop(self, ident, req, keys):
        self._stop_procs([self.procs[k] for k in keys if k in self.procs])
        self.reply(ident, req, True, None)

    def op_status(self, ident, req):
        import psutil

        # One psutil.Process per pid, kept between calls: cpu_percent() measures since the
        # previous call on the same object (a fresh one always says 0.0). Procs seen for the
        # first time get one short common window instead.
        known, self.ps_procs = self.ps_procs, {}
        fresh = False
        for p in self.procs.values():
            if p.state == "alive" and p.pid:
                ps = known.get(p.pid)
                if ps is None:
                    try:
                        ps = psutil.Process(p.pid)
                        ps.cpu_percent(interval=None)
                        fresh = True
                    except psutil.Error:
                        continue
                self.ps_procs[p.pid] = ps
        if fresh:
            time.sleep(0.1)
        rows = []
        for p in self.procs.values():
            row = {"key": p.key, "mesh": p.mesh_name, "rank": p.rank, "pid": p.pid, "state": p.state,
                   "host": self.host, "cpu": None, "rss": None}
            ps = self.ps_procs.get(p.pid) if p.state == "alive" else None
            if ps is not None:
                try:
                    row["cpu"] = ps.cpu_percent(interval=None)
                    row["rss"] = ps.memory_info().rss
                except psutil.Error:
                    pass
            rows.append(row)
        self.reply(ident, req, True, rows)

    def op_proc_states(self, ident, req, keys):
        """The OS's word for each of these procs (psutil's status: running, sleeping, stopped,
        tracing-stop, disk-sleep, zombie): why one that does not answer does not
        (core/silent_procs.py)."""
        import psutil

        out = {}
        for k in keys if isinstance(keys, list) else ():
            p = self.procs.get(k) if isinstance(k, str) else None
            if p is not None and p.state == "alive" and p.pid:
                try:
                    out[k] = psutil.Process(p.pid).status()
                except psutil.Error:
                    out[k] = "gone"
        self.reply(ident, req, True, out)

    def op_preload(self, ident, req, modules):
        """Have the zygote import ``modules`` (HostMesh.preload): every proc forked after it has
        them loaded. Answered when it has, with what failed (named, the rest loaded)."""
        modules = config.module_names(modules)
        self.counter += 1
        self.preloads_due[self.counter] = (ident, req)
        self._write_zygote({"op": "import", "req": self.counter, "modules": modules,
                            "sys_path": (self.sync_setup or {}).get("sys_path") or []})

    def op_zygote_state(self, ident, req):
        """The zygote's pid and the OS's word for it (as ``proc_states``): a spawn that does not
        finish may wait on a zygote stopped by a signal or held by a debugger."""
        import psutil

        try:
            state = psutil.Process(self.zygote.pid).status()
        except psutil.Error:
            state = "gone"
        self.reply(ident, req, True, (self.zygote.pid, state))

    def op_shutdown(self, ident, req):
        self._stop_procs(list(self.procs.values()))
        self.reply(ident, req, True, None)
        self.stopping = True

    def shutdown(self):
        self._stop_procs(list(self.procs.values()), grace=0.5)
        self.telemetry.shutdown()
        if self.sync_thread is not None:
            self.sync_jobs.put(None)
            self.sync_thread.join(5)
        try:
            self.zygote_pending += b'{"op": "exit"}\n'
            self._flush_zygote(block=True)
        except (BrokenPipeError, ValueError, OSError):
            pass
        try:
            self.zygote.wait(2)
        except subprocess.TimeoutExpired:
            self.zygote.kill()
            self.zygote.wait()
        if self.conn_file:
            try:
                os.unlink(self.conn_file)
            except FileNotFoundError:
                pass
        self.fanout.close()
        self.router.close(0)
        self.ctx.term()


# Agent messages are small (a sync batch is ~1 MiB; a plan of 100,000 files ~10 MiB).


def _raise_fd_limit():
    """Use the hard fd limit: many connections (procs, controllers, strays) must not starve
    the agent of the fds it needs to fork and sync."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 1 << 20), hard))
        except (ValueError, OSError):
            pass


_WILDCARDS = ("0.0.0.0", "*", "::", "[::]")


def _reachable_ip() -> str:
    """This host's address for peers: $POD_IP (Kubernetes' downward API), else what the
    host name resolves to, else the first non-loopback IPv4 address of an interface."""
    ip = os.environ.get("POD_IP") or config.ADVERTISE.get()
    if ip:
        return ip
    try:
        ip = socket.gethostbyname(socket.gethostname())
        if not ip.startswith("127."):
            return ip
    except OSError:
        pass
    import psutil

    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address
    return "127.0.0.1"


def _kill(pid, sig):
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _load_key(a) -> bytes:
    if a.key_file:
        with open(a.key_file) as f:
            return bytes.fromhex(f.read().strip())
    try:
        key = config.KEY.get()
    except config.ConfigError as e:
        sys.exit(f"workers.agent: {e}")
    finally:
        os.environ.pop(config.KEY.env, None)   # its procs do not inherit the key
    if not key:
        sys.exit("workers.agent: no key: pass --key-file FILE (hex, mode 0600) or set MONARCH_KERNEL_KEY")
    return bytes.fromhex(key)


class _HandedZygote:
    """The part of ``Popen`` the agent uses, for a zygote its caller started (and reaps):
    its pipes arrive as inherited fds. It still ends when the agent closes its stdin."""

    def __init__(self, spec: str):
        w, r, self.pid = (int(x) for x in spec.split(","))
        self.stdin, self.stdout = os.fdopen(w, "wb", 0), os.fdopen(r, "rb", 0)

    def poll(self):
        return None if pid_alive(self.pid) else 0

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while pid_alive(self.pid):   # a zombie its parent has not reaped yet counts as gone
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired("zygote", timeout)
            time.sleep(0.01)
        return 0

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m workers.agent", description=__doc__.split("\n")[0])
    p.add_argument("--bind", default="127.0.0.1", help="address to listen on (default loopback)")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--key-file")
    p.add_argument("--name")
    p.add_argument("--lease", type=float, default=None,
                   help="seconds without a controller before stopping (default: never for --persistent)")
    p.add_argument("--persistent", action="store_true")
    p.add_argument("--conn-file", help="connection file to write once listening (0600) and remove on exit")
    p.add_argument("--parent-pid", type=int, default=0, help="die with this parent (non-persistent)")
    p.add_argument("--zygote-fds", metavar="W,R,PID", help="a zygote the caller started: its stdin and stdout "
                   "pipes (inherited fds) and pid (monarch_kernel.job.node starts it before this agent)")
    a = p.parse_args(argv)
    bad = config.problems("agent", "proc", "any")   # its procs inherit its environment
    if bad:
        sys.exit("workers.agent: cannot start: " + " ".join(bad))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s agent %(levelname)s %(message)s")
    if not a.persistent and a.lease is None:
        a.lease = 30.0  # a non-persistent agent nobody attaches to does not wait forever
    zygote = _HandedZygote(a.zygote_fds) if a.zygote_fds else sys.modules["__main__"].__dict__.get("_EARLY_ZYGOTE")
    agent = HostAgent(a, zygote=zygote)
    signal.signal(signal.SIGTERM, lambda *_: setattr(agent, "stopping", True))
    if a.conn_file:
        from monarch_kernel.core.connection import write_connection_file

        write_connection_file(a.conn_file, {"name": agent.name, "key": agent.key.hex(),
                                            "agents": [{"addr": agent.addr, "host": agent.host,
                                                        "pid": os.getpid()}],
                                            "persistent": a.persistent, "lease": a.lease})
    sys.stdout.write(f"MONARCH_AGENT_READY {agent.addr}\n")
    sys.stdout.flush()
    log.info("agent pid %d ready at %s", os.getpid(), agent.addr)   # (launch.local.last_words reads from here)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(2, 1) if not os.isatty(2) else os.dup2(devnull, 1)
    os.close(devnull)
    agent.serve()


if __name__ == "__main__":
    main()
