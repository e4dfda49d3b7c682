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
import os
import signal
import sys
import threading
import time
import traceback

import zmq

from monarch_kernel.core import wire
from monarch_kernel.core.context import _CTX, ActorInstance, Context
from monarch_kernel.core.errors import ActorError, MeshFailure, SupervisionError
from monarch_kernel.core.runtime import Runtime, install_runtime, ipc_name
from monarch_kernel.core.shape import Point
from monarch_kernel.core.textsink import TextSink
from monarch_kernel.debug import worker as debugger  # imported here so the zygote pays for pdb
from monarch_kernel.telemetry.worker import ProcTelemetry


class ActorSlot:
    __slots__ = ("obj", "name", "ctx", "async_methods")

    def __init__(self, obj, name, ctx):
        self.obj, self.name, self.ctx = obj, name, ctx
        self.async_methods: dict[str, bool] = {}


class ForwardingStream(TextSink):
    """sys.stdout / sys.stderr of a proc: complete lines go to the controller (the sink),
    tagged with the rank, from the writing thread's own socket; the reply to a call is
    sent after a flush on the same socket, so output always arrives before the result."""

    def __init__(self, worker: ProcWorker, name: str):
        self._worker, self._name = worker, name
        self._buf: list[str] = []
        self._lock = threading.Lock()

    def write(self, s: str) -> int:
        if not isinstance(s, str):
            raise TypeError(f"write() argument must be str, not {type(s).__name__}")
        with self._lock:
            self._buf.append(s)
            if "\n" not in s:
                return len(s)
            text = "".join(self._buf)
            cut = text.rfind("\n") + 1
            self._buf = [text[cut:]] if cut < len(text) else []
        self._worker.emit_output(self._name, text[:cut])
        return len(s)

    def flush(self):
        if not self._buf:
            return
        with self._lock:
            text = "".join(self._buf)
            self._buf = []
        if text:
            self._worker.emit_output(self._name, text)


class ProcWorker:
    def __init__(self, rt: Runtime, cfg: dict):
        self.rt = rt
        self.key = bytes.fromhex(cfg["key"])
        rt.keyring.add(self.key)
        self.proc_key = cfg["proc_key"]
        self.rank = cfg["rank"]
        self.host = cfg["host"]
        self.mesh_name = cfg["mesh_name"]
        self.agent = cfg["agent"]
        self.sink = (rt.learn_contact(cfg["sink"]), self.key) if cfg.get("sink") else None
        self.actors: dict[str, ActorSlot] = {}
        self.owned: dict[str, tuple[str, set]] = {}   # child actor mesh id -> (owner id, proc keys)
        self.work = rt.ctx.socket(zmq.PULL)
        self.work.setsockopt(zmq.RCVHWM, 0)
        self.work.setsockopt(zmq.LINGER, 0)
        self.work.bind(f"tcp://{cfg['bind']}:*")
        self.work_addr = self.work.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.work_ipc = ipc_name("work")
        self.work.bind(self.work_ipc)
        self.busy_call = None   # (reply_to, call_id) of what the main thread runs now
        self.active: list[str] = []                 # actors running sync code on the main thread
        self.deferred: collections.deque = collections.deque()   # their messages, kept for later
        self.deferred_for: collections.Counter = collections.Counter()
        self.state = "idle"
        self.main_ident = threading.get_ident()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.running = True
        rt.handlers["interrupt"] = self._on_interrupt
        rt.handlers["died"] = self._on_died_notice
        rt.handlers["query"] = self._on_query
        rt.agent_event_handlers["sink"] = self._on_sink
        rt.agent_event_handlers["died"] = lambda link, key, failure: self._peer_died(key, failure)
        rt.death_listeners.append(self._supervise_owned)
        self.stdout = ForwardingStream(self, "stdout")
        self.stderr = ForwardingStream(self, "stderr")
        self.telemetry = ProcTelemetry(self, cfg)   # log file, call and cell records

    # ---------------------------------------------------------------- output
    def emit_output(self, stream: str, text: str) -> None:
        if self.telemetry.log is not None:   # kept on the host too, attached or not
            self.telemetry.log.write(stream, text)
        sink = self.sink
        if sink is None:
            (sys.__stderr__ if stream == "stderr" else sys.__stdout__).write(
                "".join(f"[rank {self.rank}] {line}\n" for line in text.rstrip("\n").split("\n")))
            return
        try:
            self.rt.send(sink[0], sink[1], ("out", self.rank, stream, text))
        except zmq.ZMQError:
            pass

    def flush_output(self):
        self.stdout.flush()
        self.stderr.flush()

    # ---------------------------------------------------------------- I/O-thread notices
    def _on_sink(self, link, addr, key):
        self.sink = (self.rt.learn_contact(addr), key) if addr else None

    def _on_interrupt(self, msg):
        _, call_id = msg
        busy = self.busy_call
        if busy is not None and (call_id is None or busy[1] == call_id):
            signal.pthread_kill(self.main_ident, signal.SIGINT)

    def _on_query(self, msg):
        """Answered on the I/O thread, so it works while the main thread runs user code."""
        _, reply_to, call_id = msg
        info = {"state": self.state, "pid": os.getpid(), "host": self.host, "rank": self.rank,
                "actors": sorted({s.name for s in self.actors.values()}), **self.query_extra()}
        self.rt.send(reply_to, self.key, ("r", call_id, self.proc_key, True, info))

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
        _, key, failure = msg
        self._peer_died(key, failure)

    def _peer_died(self, key, failure):
        self.rt.proc_failed(key, failure)

    def _supervise_owned(self, key, err: SupervisionError):
        for child, (owner, keys) in list(self.owned.items()):
            if key in keys:
                failure = err.failure or MeshFailure(child, None, "", None, str(err), key)
                self.rt.send(self.work_addr, self.key, ("supervise", owner, failure, child))

    # ---------------------------------------------------------------- the main loop
    def serve(self) -> int:
        opener, work, recv = self.rt.keyring.open, self.work, wire.recv_message
        self.rt.agent_send(self.agent, self.key, "ready", self.proc_key, os.getpid(), self.work_addr,
                           self.rt.address, self.work_ipc, self.rt.ipc_address, self.rt.host_id)
        self.rt.nested_work = (work, self._nested_work)
        self.rt.nested_thread = threading.get_ident()
        deferred = self.deferred
        while self.running:
            if deferred:
                msg = deferred.popleft()
                if msg[0] == "call":
                    self.deferred_for[msg[1]] -= 1
                self._dispatch_work(msg)
                continue
            try:
                frames = recv(work)
            except KeyboardInterrupt:
                continue  # an interrupt that arrived after its call finished
            msg = opener(frames, "work inbox")
            if msg is None or type(msg) is not tuple:
                self._answer_load_failure(msg)
                continue  # dropped (logged by the opener)
            self._dispatch_work(msg)
        return 0

    def _dispatch_work(self, msg) -> None:
        try:
            getattr(self, "do_" + msg[0])(msg)
        except KeyboardInterrupt:
            pass

    def _nested_work(self, frames) -> None:
        """Work that arrives while this main thread waits in get() inside an endpoint: run it
        now, unless it is for an actor already running below us on this thread (it waits, in
        order, for the main loop), so a sync endpoint may call actors of its own proc."""
        msg = self.rt.keyring.open(frames, "work inbox")
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
        slot = self.actors.get(m[1])
        e = failure.error
        self._reply(m[5], m[6], False, ActorError(
            f"its arguments could not be unpickled on this worker: {e!r}. Make the module importable on "
            "the workers (install it, or sync your code), or send plain data", rank=self.rank, host=self.host,
            exc_type=type(e).__name__, actor=f"{slot.name if slot else m[1]}.{m[2]}"))

    def do_exit(self, msg):
        self.running = False

    def do_spawn(self, msg):
        _, aid, name, body, view, reply_to, call_id = msg
        try:
            cls, args, kwargs, _src = wire.loads(body)
        except BaseException as e:
            self._reply(reply_to, call_id, False, self._error(e, f"{name} (unpickling its class)"))
            return
        idx = view.ranks.index(self.rank)
        inst = ActorInstance(Point(idx, view.extent), aid, name, self.proc_key, self.rank, self.host)
        ctx = Context(inst)
        token = _CTX.set(ctx)
        self.busy_call, self.state = (reply_to, call_id), f"in {name}.__init__"
        try:
            obj = cls(*args, **kwargs)
        except BaseException as e:
            self._reply(reply_to, call_id, False, self._error(e, f"{name}.__init__"))
            return
        finally:
            _CTX.reset(token)
            self.busy_call, self.state = None, "idle"
        self.actors[aid] = ActorSlot(obj, name, ctx)
        self._reply(reply_to, call_id, True, None)

    def do_call(self, msg):
        _, aid, method, args, kwargs, reply_to, call_id, _src = msg
        slot = self.actors.get(aid)
        if slot is None:
            err = ActorError(f"no actor {aid} on this proc (it was stopped, or failed to start)",
                             rank=self.rank, host=self.host)
            self._reply(reply_to, call_id, False, err)
            return
        is_async = slot.async_methods.get(method)
        if is_async is None:
            fn = getattr(type(slot.obj), method, None)
            is_async = slot.async_methods[method] = asyncio.iscoroutinefunction(fn)
        if is_async:
            self._run_async(slot, method, args, kwargs, reply_to, call_id)
            return
        token = _CTX.set(slot.ctx)
        self.busy_call, self.state = (reply_to, call_id), f"in {slot.name}.{method}"
        self.active.append(aid)
        started, t0 = time.time(), time.perf_counter()
        try:
            value, ok = getattr(slot.obj, method)(*args, **kwargs), True
        except BaseException as e:
            value, ok = self._error(e, f"{slot.name}.{method}"), False
        finally:
            self.active.pop()
            _CTX.reset(token)
            self.busy_call, self.state = None, "idle"
        self.telemetry.record_call(slot.name, method, args, started, time.perf_counter() - t0, ok, value)
        self._reply(reply_to, call_id, ok, value)

    def do_stop_actor(self, msg):
        slot = self.actors.pop(msg[1], None)
        self.owned.pop(msg[1], None)
        if slot is not None and hasattr(slot.obj, "__cleanup__"):
            try:
                slot.obj.__cleanup__()
            except Exception:
                traceback.print_exc()

    def do_supervise(self, msg):
        _, owner, failure, child = msg
        slot = self.actors.get(owner)
        handled = False
        if slot is not None and hasattr(slot.obj, "__supervise__"):
            token = _CTX.set(slot.ctx)
            try:
                handled = bool(slot.obj.__supervise__(failure))
            except BaseException:
                traceback.print_exc()
            finally:
                _CTX.reset(token)
        if not handled and self.sink is not None:
            err = SupervisionError(failure, f"unhandled by {slot.name if slot else 'its owner'} "
                                            "(no __supervise__, or it returned a falsy value)")
            self.rt.send(self.sink[0], self.sink[1], ("unhandled", err))

    # ---------------------------------------------------------------- replies and errors
    def _reply(self, reply_to, call_id, ok, value):
        self.flush_output()
        if not call_id:   # broadcast: fire and forget; failures still reach the controller
            if not ok and self.sink is not None:
                self.rt.send(self.sink[0], self.sink[1], ("unhandled", value))
            return
        try:
            frames = self.rt.pack(self.key, ("r", call_id, self.proc_key, ok, value), (reply_to,))
        except Exception as e:
            err = ActorError(f"the result ({type(value).__name__}) could not be sent back: {e}",
                             rank=self.rank, host=self.host, exc_type="PicklingError")
            frames = self.rt.pack(self.key, ("r", call_id, self.proc_key, False, err))
        self.rt.send_frames(reply_to, frames)

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

    def _run_async(self, slot, method, args, kwargs, reply_to, call_id):
        async def run():
            _CTX.set(slot.ctx)
            started, t0 = time.time(), time.perf_counter()
            try:
                value, ok = await getattr(slot.obj, method)(*args, **kwargs), True
            except BaseException as e:
                value, ok = self._error(e, f"{slot.name}.{method}"), False
            self.telemetry.record_call(slot.name, method, args, started, time.perf_counter() - t0, ok, value)
            self._reply(reply_to, call_id, ok, value)

        asyncio.run_coroutine_threadsafe(run(), self._event_loop())


def main(cfg: dict) -> int:
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.environ["RANK"] = str(cfg["rank"])
    os.environ["LOCAL_RANK"] = str(cfg.get("local_index", 0))
    os.environ["MONARCH_KERNEL_PROC"] = cfg["proc_key"]
    gpus = _gpu_count()
    if gpus and "MONARCH_KERNEL_KEEP_CUDA_VISIBLE" not in os.environ:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(cfg.get("local_index", 0) % gpus)
    rt = Runtime(bind_host=cfg["bind"], role="proc")
    install_runtime(rt)
    worker = ProcWorker(rt, cfg)
    if cfg.get("sync"):   # synced code on this host: its folders on sys.path, the cwd
        from monarch_kernel.sync.reload import setup_proc

        setup_proc(cfg["sync"])
    global WORKER
    WORKER = worker
    debugger.install(worker)   # breakpoint() / pdb.set_trace() talk to the controller
    from monarch_kernel.jupyter.display_worker import use_on_this_rank

    use_on_this_rank()   # display() and plt.show() reach the notebook, not the kernel's backend
    sys.stdout, sys.stderr = worker.stdout, worker.stderr
    try:
        return worker.serve()
    finally:
        worker.flush_output()
        time.sleep(0.05)


WORKER: ProcWorker | None = None
QUERY_EXTRAS: list = []   # functions (worker) -> dict merged into a proc's query answer


def _gpu_count() -> int:
    """GPUs on this host, without initialising CUDA (this runs in a forked child)."""
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0
