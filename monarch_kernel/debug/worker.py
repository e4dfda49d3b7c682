"""Worker side of the distributed debugger: ``breakpoint()`` on a proc talks to the controller.

``install(worker)`` runs once per proc (``monarch_kernel/node/proc.py``). It points ``sys.breakpointhook``
and ``pdb.set_trace`` at ``MeshPdb``, a pdb (pdb++ when installed) whose streams are remote:

  * output: ``("dbg", rank, proc_key, "out", text)`` to the controller's sink;
  * each prompt: ``("dbg", rank, proc_key, "prompt", info)`` where ``info`` names the file,
    line, function and what the proc was running (a cell or ``Actor.endpoint``);
  * a step in flight (``next``, ``step``...): ``"running"``; leaving the debugger
    (``continue``, ``quit``): ``"resume"``.
  * input: ``("dbg_in", line)`` on the proc's ctrl inbox. The runtime's I/O thread puts it
    in a queue that the paused thread reads, so the I/O thread keeps answering
    ``ProcMesh.states()`` (``state: "paused in debugger at FILE:LINE"`` plus a
    ``debugger`` entry) and the ranks that did not stop keep running.

Threads: the paused thread is the one that called ``breakpoint()`` (the main thread for
cells and sync endpoints). One session per proc at a time; a second thread that breaks
waits for the first to leave. A SIGINT (the kernel's interrupt) while waiting for input
leaves the debugger and raises KeyboardInterrupt in the user's code, so an interrupt
never leaves a rank paused.

Post-mortem: ``("dbg_pm", True)`` makes ``post_mortem(exc)`` (called by the proc before
an endpoint's or cell's error is sent back) stop in the debugger at the raise.
"""
from __future__ import annotations

import bdb
import contextlib
import os
import pdb
import queue
import sys
import threading

from monarch_kernel.core.textsink import TextSink

_PDBPP = hasattr(pdb, "DefaultConfig")
SKIP = ["monarch_kernel.*", "workers.*", "asyncio.*"]   # module patterns pdb never stops in


_INTERNAL = ("monarch_kernel.", "workers.", "runpy", "threading", "asyncio.", "concurrent.futures.")


def _internal(frame) -> bool:
    name = frame.f_globals.get("__name__", "")
    return name in ("__main__", "runpy", "threading") or name.startswith(_INTERNAL) or \
        frame.f_code.co_filename.startswith("<frozen ")


class _Config(pdb.DefaultConfig if _PDBPP else object):
    """No colours or terminal tricks: the output goes to a notebook, not a tty."""

    highlight = False
    use_pygments = False
    sticky_by_default = False
    prompt = "(Pdb++) "


class _RemoteOut(TextSink):
    """The debugger's stdout: whole lines (and whatever is left at a prompt) to the controller."""

    def __init__(self, dbg: RemoteDebugger):
        self._dbg = dbg
        self._buf: list[str] = []
        self.prompt = ""

    def write(self, s: str) -> int:
        if s == self.prompt:   # the prompt is the controller's to show
            return len(s)
        self._buf.append(s)
        if "\n" in s and sum(map(len, self._buf)) > 4096:
            self.flush()
        return len(s)

    def flush(self):
        text = "".join(self._buf)
        self._buf = []
        if text:
            self._dbg.send("out", text)


class _RemoteIn:
    """The debugger's stdin: ``readline`` tells the controller it waits, then blocks."""

    def __init__(self, dbg: RemoteDebugger):
        self._dbg = dbg
        self.pdb: MeshPdb | None = None

    def readline(self) -> str:
        return self._dbg.read_line(self.pdb)


class MeshPdb(pdb.Pdb):
    """pdb (pdb++) with remote streams; one per stop."""

    def __init__(self, dbg: RemoteDebugger, **kwargs):
        stdin, stdout = _RemoteIn(dbg), _RemoteOut(dbg)
        if _PDBPP:
            kwargs["Config"] = _Config
        # Stepping out of user code goes on to the next user frame, not into the proc's loop.
        super().__init__(stdin=stdin, stdout=stdout, nosigint=True, skip=SKIP, **kwargs)
        self.use_rawinput = False
        stdin.pdb = self
        stdout.prompt = self.prompt
        self.dbg = dbg
        self.left = False          # continue/quit: the rank runs freely again
        self.interrupted = False   # SIGINT at the prompt: leave, then raise KeyboardInterrupt

    def get_stack(self, f, t):
        """The stack without our own machinery below the user's code (runpy, the zygote,
        the proc loop, the cell runner): ``where`` starts at the cell or endpoint, and
        ``up`` stops there."""
        stack, idx = super().get_stack(f, t)
        k = 0
        while k < idx and _internal(stack[k][0]):
            k += 1
        return stack[k:], idx - k

    def _custom_completer(self):
        """pdb++ sets up tab completion (fancycompleter, which imports pyrepl and curses: 12
        ms of a rank's first pause, 3 s of CPU when 256 ranks pause at once) and swaps the
        process's readline completer around each prompt; input here comes from the
        notebook, where nothing completes, so neither is done."""
        return contextlib.nullcontext()

    def set_continue(self):
        self.left = True
        super().set_continue()

    def set_quit(self):
        self.left = True
        super().set_quit()

    def interaction(self, frame, tb):
        with self.dbg.lock:
            self.dbg.enter(self)
            try:
                super().interaction(frame, tb)
            finally:
                self.stdout.flush()
                self.dbg.leave(self, left=self.left or self.interrupted)
        if self.interrupted:
            self.interrupted = False
            self.set_continue()
            sys.settrace(None)
            raise KeyboardInterrupt("interrupted while paused in the debugger")


class RemoteDebugger:
    """This proc's debugger state: input queue, the session in front, post-mortem flag."""

    def __init__(self, worker):
        self.worker = worker
        self.lines: queue.SimpleQueue = queue.SimpleQueue()
        self.lock = threading.RLock()
        self.current: MeshPdb | None = None
        self.info: dict | None = None   # where the paused session is (None: not paused)
        self.saved_state: str | None = None
        self.post_mortem_on = False
        self.what = ""
        rt = worker.rt
        rt.on_message("dbg_in", self._on_input, replace=True)
        rt.on_message("dbg_pm", self._on_post_mortem, replace=True)

    # ------------------------------------------------------------ I/O thread
    def _on_input(self, msg) -> None:
        self.lines.put(msg[1])

    def _on_post_mortem(self, msg) -> None:
        self.post_mortem_on = bool(msg[1])

    # ------------------------------------------------------------ to the controller
    def send(self, event: str, payload) -> None:
        w = self.worker
        sink = w.sink
        if sink is None:   # no controller attached: the session waits for one (states())
            return
        try:
            w.rt.send(sink[0], sink[1], ("dbg", w.rank, w.proc_key, event, payload))
        except Exception:
            pass

    # ------------------------------------------------------------ the paused thread
    def enter(self, p: MeshPdb) -> None:
        w = self.worker
        w.flush_output()   # what the user printed before breakpoint() comes first
        if self.current is None:
            self.saved_state = w.state
            self.what = _what(w.state)
            while True:   # input sent for an earlier session is stale
                try:
                    self.lines.get_nowait()
                except queue.Empty:
                    break
        self.current = p

    def leave(self, p: MeshPdb, left: bool) -> None:
        w = self.worker
        self.info = None
        if left:
            self.current = None
            w.state = self.saved_state or "idle"
            self.send("resume", {})
        else:
            w.state = f"stepping in debugger ({self.what})"
            self.send("running", {})

    def read_line(self, p: MeshPdb | None) -> str:
        if p is not None:
            p.stdout.flush()
            frame = p.curframe
            code = frame.f_code if frame is not None else None
            self.info = {"file": code.co_filename if code else "?", "line": frame.f_lineno if frame else 0,
                         "function": code.co_name if code else "?", "what": self.what,
                         "thread": threading.current_thread().name, "pid": os.getpid()}
            self.worker.state = f"paused in debugger at {self.info['file']}:{self.info['line']}"
            self.send("prompt", self.info)
        while True:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                continue
            except KeyboardInterrupt:
                if p is None:
                    raise
                p.interrupted = True
                return "continue\n"
            return line if line.endswith("\n") else line + "\n"

    def query_extra(self, worker) -> dict:
        info = self.info
        if self.current is None:
            return {}
        return {"debugger": dict(info) if info else {"what": self.what, "stepping": True}}

    # ------------------------------------------------------------ entry points
    def set_trace(self, frame=None) -> None:
        p = MeshPdb(self, **_fresh())
        p.set_trace(frame or sys._getframe().f_back)

    def post_mortem(self, exc: BaseException) -> None:
        """Stop at the raise of ``exc`` when post-mortem is on (not for interrupts)."""
        if not self.post_mortem_on or isinstance(exc, (KeyboardInterrupt, SystemExit, bdb.BdbQuit)):
            return
        tb = exc.__traceback__
        if tb is None:
            return
        p = MeshPdb(self, **_fresh())
        p.reset()
        self.worker.flush_output()
        p.message(f"post-mortem: {type(exc).__name__}: {exc}")
        try:
            p.interaction(None, tb)
        except KeyboardInterrupt:
            pass


def _fresh() -> dict:
    """pdb++ reuses one global instance by default; each stop here gets its own."""
    return {"use_global_pdb": False} if _PDBPP else {}


def _what(state: str) -> str:
    """'in __cells__.run' -> 'cell'; 'in trainers.step' -> 'trainers.step'."""
    s = state[3:] if state.startswith("in ") else state
    return "cell" if s.startswith("__cells__.") else s


DEBUGGER: RemoteDebugger | None = None


def install(worker) -> RemoteDebugger:
    """Route ``breakpoint()`` and ``pdb.set_trace()`` of this proc to the controller."""
    global DEBUGGER
    from monarch_kernel.node import proc as proc_mod

    dbg = DEBUGGER = RemoteDebugger(worker)

    def breakpointhook(*args, **kwargs):
        dbg.set_trace(sys._getframe().f_back)

    def set_trace(*, header=None, frame=None, **kwargs):
        if header is not None:
            dbg.send("out", header + "\n")
        dbg.set_trace(frame or sys._getframe().f_back)

    sys.breakpointhook = breakpointhook
    pdb.set_trace = set_trace
    proc_mod.QUERY_EXTRAS.append(dbg.query_extra)
    return dbg


def post_mortem(exc: BaseException) -> None:
    """Called by the proc on a failing endpoint or cell, on the raising thread."""
    if DEBUGGER is not None:
        try:
            DEBUGGER.post_mortem(exc)
        except Exception:   # the debugger must never turn an error into a dead proc
            import traceback

            traceback.print_exc()
