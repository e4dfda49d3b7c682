"""JupyterLab's visual debugger on one chosen rank: the kernel's DAP traffic, forwarded.

    %mesh debug dap RANK     the debugger panel (threads, stack, variables, gutter
                             breakpoints in %%on_mesh cells) now drives RANK
    %mesh debug dap off      back to the kernel's own process
    %mesh debug dap          which process the panel drives

How it fits together (this module is the kernel half; dap_worker.py the worker half):
  * worker: ``DapServer`` (an actor spawned on the chosen rank only, as ``__dap_<rank>__``)
    starts ``debugpy.listen`` with the debug adapter in the proc itself (no adapter
    subprocess to orphan) on the proc's bind address. Its ``listen`` endpoint runs on the
    proc's main thread, which is the thread debugpy must trace (cells run there). The
    proc's own threads (I/O, output) are marked ``pydev_do_not_trace`` first, so a stop at
    a breakpoint suspends user threads only, and the proc keeps talking to the controller.
  * kernel: ``MonarchDebugger`` (``MonarchKernel.debugger_class``) is ipykernel's Debugger
    whose debugpy client connects to the rank's port instead of the kernel's own. Every
    ``debug_request`` on the control channel (initialize, attach, setBreakpoints,
    threads, stackTrace, variables, continue, next...) then reaches the rank; its events
    (``stopped``, ``continued``) come back as ``debug_event`` on iopub. Switching while
    the panel is on replays initialize, attach and the breakpoints on the new target.
  * cell names: JupyterLab names a cell's file ``<tmp prefix><murmur2(cell source)>.py``
    (``debugInfo``) and puts gutter breakpoints on that path, at the line in the cell.
    While a rank is selected, ``%%on_mesh`` compiles the body on every rank under that same
    name, with the body's lines where they are in the cell (blank lines for the magic
    line), so gutter breakpoints hit. Only the selected rank runs debugpy.
  * source on other hosts: before ``setBreakpoints`` on a cell file, the kernel sends the
    cell source to the rank (``("dap_src", path, text)`` on its I/O thread), which writes it
    where debugpy expects the file, so breakpoints verify on a host that has no copy.

Threads: ``%mesh debug dap`` runs on the kernel's shell thread; the debugpy client lives
on the control thread (its zmq stream and queues are not thread-safe), so retargeting is
a coroutine run on the control thread's loop.
"""
from __future__ import annotations

import asyncio
import os
import re
import threading
from typing import NamedTuple

from monarch_kernel.core.mesh import state_of, view_of

from .dap_worker import DapServer

try:
    from ipykernel.debugger import Debugger, DebugpyClient, DebugpyMessageQueue
except ImportError:   # a plain script without ipykernel: the worker half still imports
    Debugger = DebugpyClient = DebugpyMessageQueue = object   # type: ignore[misc,assignment]

ANSWER_TIMEOUT_S = 15.0   # a DAP request the rank does not answer in this long fails
WORKER_SKIP_MODULES = ("monarch_kernel", "workers", "zmq", "cloudpickle", "debugpy")


# ============================================================================ kernel side
class RankTarget(NamedTuple):
    rank: int
    host: str
    port: int
    pid: int
    key: str       # the proc's key (dead-rank checks)
    ctrl: str      # the proc's I/O-thread inbox ("dap_src")
    mesh_key: bytes   # the proc mesh's key, which signs messages to its procs


class RankDebugpyClient(DebugpyClient):
    """ipykernel's debugpy client, pointed at a rank's debugpy when one is selected."""

    target: RankTarget | None = None

    def get_host_port(self):
        if self.target is not None:
            return self.target.host, str(self.target.port)
        return super().get_host_port()


class MonarchDebugger(Debugger):
    """ipykernel's Debugger; its DAP traffic goes to the selected rank (``retarget``)."""

    def __init__(self, log, debugpy_stream, event_callback, *args, **kwargs):
        super().__init__(log, debugpy_stream, event_callback, *args, **kwargs)
        self.debugpy_client = RankDebugpyClient(log, debugpy_stream, self._handle_event)
        self._initialize_msg: dict | None = None
        self._attach_msg: dict | None = None

    @property
    def target(self) -> RankTarget | None:
        return self.debugpy_client.target

    # ------------------------------------------------------------------ start / requests
    def start(self):
        if self.target is None:
            return super().start()
        from ipykernel.compiler import get_tmp_directory
        from IPython.core.getipython import get_ipython
        from IPython.core.inputtransformer2 import leading_empty_lines

        os.makedirs(get_tmp_directory(), mode=0o700, exist_ok=True)   # where dumpCell writes
        cleanup = get_ipython().input_transformer_manager.cleanup_transforms
        if leading_empty_lines in cleanup:   # keep cell lines where the gutter shows them
            index = cleanup.index(leading_empty_lines)
            self._removed_cleanup[index] = cleanup.pop(index)
        self.debugpy_client.connect_tcp_socket()
        return True

    async def process_request(self, message):
        command = message.get("command")
        if command == "initialize":
            self._initialize_msg = dict(message)
        elif command == "attach":
            self._attach_msg = {**message, "arguments": dict(message.get("arguments") or {})}
        elif command in ("disconnect", "terminate") and self.target is not None:
            if command == "terminate":   # the proc holds the rank's state: never end it from here
                return {"type": "response", "request_seq": message.get("seq", 0), "success": False,
                        "command": command, "message": "a rank is not terminated from the debugger; "
                        "`%mesh stop` ends the mesh"}
            message.setdefault("arguments", {})["terminateDebuggee"] = False
        if command == "disconnect":
            self._initialize_msg = self._attach_msg = None
        return await super().process_request(message)

    async def attach(self, message):
        t = self.target
        if t is None:
            return await super().attach(message)
        args = message.setdefault("arguments", {})
        args["connect"] = {"host": t.host, "port": t.port}
        args["rules"] = [{"module": m, "include": False} for m in WORKER_SKIP_MODULES] + [
            {"path": p, "include": False} for p in self.kernel_modules]
        if not self.just_my_code:
            args["debugOptions"] = ["DebugStdLib"]
        return await self._forward_message(message)

    async def setBreakpoints(self, message):
        t = self.target
        path = message.get("arguments", {}).get("source", {}).get("path", "")
        if t is not None and path and os.path.isfile(path):
            try:   # the rank's host may have no copy of the dumped cell
                with open(path, encoding="utf-8") as f:
                    text = f.read()
                from ..core.runtime import runtime

                runtime().send(t.ctrl, t.mesh_key, ("dap_src", path, text))
            except Exception as e:
                self.log.warning("sending %s to rank %s failed: %s", path, t.rank, e)
        return await super().setBreakpoints(message)

    async def _forward_message(self, msg):
        t = self.target
        if t is None:
            return await super()._forward_message(msg)
        try:
            return await asyncio.wait_for(super()._forward_message(msg), ANSWER_TIMEOUT_S)
        except asyncio.TimeoutError:
            why = "its proc is dead" if _dead(t) else f"no answer within {ANSWER_TIMEOUT_S:g} s"
            return {"type": "response", "seq": msg.get("seq", 0), "request_seq": msg.get("seq", 0),
                    "success": False, "command": msg.get("command"),
                    "message": f"rank {t.rank} ({why}); `%mesh debug dap off` returns the debugger "
                               "to the kernel"}

    # ------------------------------------------------------------------ switching targets
    async def retarget(self, target: RankTarget | None) -> None:
        """Point the client at ``target`` (None: the kernel). If the panel is on, replay
        its initialize, attach and breakpoints there, so it carries on as if attached."""
        client = self.debugpy_client
        started = self.is_started
        if started:   # the old debuggee drops its breakpoints and runs on (none is left paused)
            await self._forward_message({"type": "request", "seq": 999_999, "command": "disconnect",
                                         "arguments": {"restart": False, "terminateDebuggee": False}})
            client.disconnect_tcp_socket()
        client.target = target
        client.message_queue = DebugpyMessageQueue(client._forward_event, self.log)
        self.stopped_threads = set()
        if not started:
            return
        self.start()
        if self._initialize_msg is not None:
            await self._forward_message(dict(self._initialize_msg))
        if self._attach_msg is not None:
            await self.attach({**self._attach_msg, "arguments": dict(self._attach_msg["arguments"])})
        seq = 1_000_000
        for source, bps in list(self.breakpoint_list.items()):
            seq += 1
            await self.setBreakpoints({"type": "request", "seq": seq, "command": "setBreakpoints",
                                       "arguments": {"source": {"path": source}, "breakpoints": bps}})


def _dead(t: RankTarget) -> bool:
    from ..core.runtime import runtime

    return t.key in runtime().dead


# ============================================================================ %mesh debug dap
def _kernel_debugger():
    from IPython.core.getipython import get_ipython

    kernel = getattr(get_ipython(), "kernel", None)
    dbg = getattr(kernel, "debugger", None)
    if not isinstance(dbg, MonarchDebugger):
        from .registry import DebugError

        raise DebugError("the JupyterLab debugger can drive a rank only in the Monarch kernel "
                         "(pick the 'Monarch' kernel); here use `%mesh debug` or breakpoint()")
    return kernel, dbg


def _run_on_control(kernel, coro) -> None:
    loop = kernel.control_thread.io_loop.asyncio_loop
    asyncio.run_coroutine_threadsafe(coro, loop).result(ANSWER_TIMEOUT_S * 4)


def dap_command(rest: list[str]) -> str:
    """``%mesh debug dap [RANK|off]``: returns the line to print."""
    from .registry import DebugError

    kernel, dbg = _kernel_debugger()
    if not rest:
        t = dbg.target
        return ("JupyterLab's debugger drives the kernel's own process" if t is None else
                f"JupyterLab's debugger drives rank {t.rank} (pid {t.pid}, debugpy at {t.host}:{t.port})")
    if len(rest) != 1:
        raise DebugError("dap takes one rank or `off`, e.g. `%mesh debug dap 1`")
    if rest[0] == "off":
        if dbg.target is None:
            return "JupyterLab's debugger already drives the kernel's own process"
        if dbg.is_started and not dbg.debugpy_initialized:   # the kernel's debugpy never started
            import debugpy

            host, port = DebugpyClient.get_host_port(dbg.debugpy_client)
            debugpy.listen((host, int(port)))
            dbg.debugpy_initialized = True
        _run_on_control(kernel, dbg.retarget(None))
        return "JupyterLab's debugger drives the kernel's own process again"
    target = _listen_on(rest[0])
    _run_on_control(kernel, dbg.retarget(target))
    return (f"JupyterLab's debugger now drives rank {target.rank} (pid {target.pid}): turn the debugger "
            "on in the notebook's toolbar, set breakpoints in the gutter of %%on_mesh cells, and run them")


def _listen_on(spec: str) -> RankTarget:
    from ..core.mesh import ProcMesh
    from ..core.runtime import runtime
    from ..core.shape import parse_rank_spec
    from ..jupyter.session import session
    from .registry import DebugError

    procs, _ = session().require()
    view = view_of(procs)
    try:
        one = parse_rank_spec(spec, view)
    except (ValueError, TypeError) as e:
        raise DebugError(f"dap: {e}") from None
    if len(one.ranks) != 1:
        raise DebugError(f"dap takes one rank; {spec!r} names {len(one.ranks)}")
    rank = one.ranks[0]
    ref = state_of(procs).procs[rank]
    rt = runtime()
    if ref.key in rt.dead:
        raise DebugError(f"rank {rank} is dead ({rt.dead[ref.key]}); `mesh.respawn()` replaces it, "
                         "or pick another rank")
    name = f"__dap_{rank}__"
    one_proc = ProcMesh(state_of(procs), one)
    try:
        server = one_proc.actor_mesh(name)
    except KeyError:
        server = one_proc.spawn(name, DapServer)
    host = _host_of(ref.ctrl)
    try:
        port = server.listen.call_one(host).get(ANSWER_TIMEOUT_S)
    except TimeoutError:
        raise DebugError(f"rank {rank} is busy (a cell or endpoint runs on it); the debugger attaches "
                         "between cells: wait for it, or interrupt it") from None
    return RankTarget(rank, host, int(port), ref.pid, ref.key, ref.ctrl, state_of(procs).key)


def _host_of(address: str) -> str:
    m = re.match(r"tcp://\[?([^\]]+?)\]?:\d+$", address)
    return m.group(1) if m else "127.0.0.1"


# ============================================================================ cell names
_RAW = threading.local()


def _pre_run_cell(info) -> None:
    _RAW.cell = getattr(info, "raw_cell", None)


def cell_name(body: str) -> tuple[str, int] | None:
    """on_mesh.CELL_NAMERS entry: while a rank is selected, the name JupyterLab gives this
    cell (its dumped file) and how many lines precede the body in it."""
    try:
        _, dbg = _kernel_debugger()
    except Exception:
        return None
    if dbg.target is None:
        return None
    raw = getattr(_RAW, "cell", None)
    if not raw:
        return None
    at = raw.find("%%on_mesh")
    end = raw.find("\n", at)
    if at < 0 or end < 0 or raw[end + 1:] != body:
        return None
    from ipykernel.compiler import get_file_name

    return get_file_name(raw), raw[:end + 1].count("\n")


def install(shell) -> None:
    """Record each cell's raw source (the text JupyterLab hashes) and name cells by it."""
    from ..jupyter import on_mesh

    if _pre_run_cell not in shell.events.callbacks["pre_run_cell"]:
        shell.events.register("pre_run_cell", _pre_run_cell)
    if cell_name not in on_mesh.CELL_NAMERS:
        on_mesh.CELL_NAMERS.append(cell_name)
