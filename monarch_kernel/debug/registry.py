"""Controller side of the distributed debugger: which ranks are paused, where, and their output.

Ranks paused in ``breakpoint()`` send ``("dbg", rank, proc_key, event, payload)`` to this
controller (see ``worker.py``). ``DebugRegistry.on_message`` runs on whichever thread reads
the inbox (the I/O thread, or a thread blocked in ``Future.get``) and only records: the
text console (``console.py``) and the widget (``widget.py``) show what it holds. Commands
go back as ``("dbg_in", line)`` to the paused proc's ctrl inbox.

A controller that re-attaches to a mesh learns of ranks paused while it was away from
``ProcMesh.states()`` (``refresh``): each paused proc reports a ``debugger`` entry.

No Jupyter imports here: the same registry serves a plain script, whose main thread gets
the console in ``Future.get`` (``Runtime.wait_hook``).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable

from monarch_kernel.core.mesh import state_of

from ..core.mesh_tables import rank_ranges, rank_rows
from ..core.messages import Interrupt
from ..core.runtime import Runtime, runtime
from ..core.shape import MeshView, parse_rank_spec

OUTPUT_KEEP = 200_000   # characters of debugger output kept per paused rank (for the widget)


class PausedSession:
    """One rank in the debugger. ``state``: 'prompt' (waits for a command) or 'running'
    (a command is executing, e.g. ``next``)."""

    def __init__(self, rank: int, key: str):
        self.rank, self.key = rank, key
        self.file, self.line, self.function, self.what = "?", 0, "?", ""
        self.state = "running"
        self.prompts = 0          # prompts seen so far
        self.asked = 0            # ``prompts`` when the last command was sent (done once it grows)
        self.output = ""          # recent output, for the widget's pane
        self.unread: list[str] = []   # not yet shown by the console
        self.since = time.time()

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"

    @property
    def place(self) -> str:
        """Where it is paused, without its rank: ranks paused alike share it."""
        what = f" ({self.what})" if self.what else ""
        return f"{self.where} in {self.function}(){what}"

    def describe(self) -> str:
        return f"rank {self.rank} paused at {self.place}"

    def _update(self, info: dict) -> None:
        self.file = info.get("file", self.file)
        self.line = info.get("line", self.line)
        self.function = info.get("function", self.function)
        self.what = info.get("what", self.what)

    @property
    def answered(self) -> bool:
        """The last command sent is done: the rank prompts again (or left the debugger)."""
        return self.prompts > self.asked or self.state == "resumed"

    def _add_output(self, text: str) -> None:
        self.output = (self.output + text)[-OUTPUT_KEEP:]
        self.unread.append(text)


def table_rows(sessions: list[PausedSession]) -> tuple[list[list[str]], str]:
    """The paused-ranks table (rank, in, where, function, state) for the console and the
    widget: a row per rank, and past ``mesh_tables.BIG_TABLE`` ranks neighbours paused alike
    share a row (256 ranks in one ``breakpoint()`` are one row, not 256), with its note."""
    return rank_rows([s.rank for s in sessions], [{} for _ in sessions],
                     [(s.what or "?", s.where, s.function, s.state) for s in sessions])


class DebugError(ValueError):
    """Bad debugger input (a rank not paused, outside the mesh, an unknown command)."""


class DebugRegistry:
    def __init__(self, rt: Runtime):
        self.rt = rt
        self.sessions: dict[str, PausedSession] = {}   # proc key -> session
        self.cond = threading.Condition()
        self.pauses = 0   # how many sessions ever started (the console opens for new ones)
        self.listeners: list[Callable[[str, PausedSession], None]] = []
        self.quiet = 0    # >0 while a UI command runs: the console must not open then
        self.view_fn: Callable[[], MeshView | None] = lambda: None   # the notebook's mesh
        rt.on_message("dbg", self.on_message, replace=True)   # this runtime's registry takes over

    # ---------------------------------------------------------------- inbox (any thread)
    def on_message(self, msg) -> None:
        _, rank, key, event, payload = msg
        new = False
        with self.cond:
            s = self.sessions.get(key)
            if s is None:
                if event in ("resume", "running"):
                    return
                s = self.sessions[key] = PausedSession(rank, key)
                self.pauses += 1
                new = True
            if event == "out":
                s._add_output(payload)
            elif event == "prompt":
                s._update(payload)
                s.state = "prompt"
                s.prompts += 1
            elif event == "running":
                s.state = "running"
            elif event == "resume":
                s.state = "resumed"
                del self.sessions[key]
            self.cond.notify_all()
        if new:
            self.rt.want_wait_hook()   # a thread blocked in get() opens the console
        for fn in list(self.listeners):
            try:
                fn(event, s)
            except Exception:
                import logging

                logging.getLogger("monarch_kernel").exception("debugger listener failed")

    # ---------------------------------------------------------------- queries
    def paused(self) -> list[PausedSession]:
        with self.cond:
            return sorted(self.sessions.values(), key=lambda s: (s.rank, s.since))

    def by_rank(self, rank: int) -> PausedSession:
        for s in self.paused():
            if s.rank == rank:
                return s
        raise DebugError(f"rank {rank} is not paused in the debugger ({self._paused_note()})")

    def _paused_note(self) -> str:
        ranks = [s.rank for s in self.paused()]
        return f"paused: {rank_ranges(ranks)}" if ranks else "no rank is paused"

    def select(self, spec: str) -> list[PausedSession]:
        """Paused sessions named by Monarch's rank grammar (``3``, ``1,4,6``, ``0:8:2``,
        ``gpus=1:3``, each optionally as ``ranks(...)``). Every named rank must be paused."""
        view = self.view_fn()
        if view is None:
            top = max([s.rank for s in self.paused()], default=-1) + 1
            view = MeshView(("ranks",), (max(top, 1),))
        try:
            ranks = parse_rank_spec(spec, view).ranks
        except (ValueError, TypeError) as e:
            raise DebugError(str(e)) from None
        by_rank = {s.rank: s for s in self.paused()}
        missing = [r for r in ranks if r not in by_rank]
        if missing:
            which = f"{rank_ranges(missing)} {'is' if len(missing) == 1 else 'are'}"
            raise DebugError(f"{which} not paused in the debugger ({self._paused_note()})")
        return [by_rank[r] for r in ranks]

    def wait(self, predicate: Callable[[], bool], timeout: float) -> bool:
        with self.cond:
            return self.cond.wait_for(predicate, timeout)

    # ---------------------------------------------------------------- commands
    def send(self, s: PausedSession, line: str) -> None:
        """Send one pdb command to a paused rank (non-blocking)."""
        found = self.rt.procs.get(s.key)
        if found is None:
            raise DebugError(f"rank {s.rank}: its proc is unknown to this controller")
        ref, key = found
        with self.cond:
            s.state = "running"
            s.asked = s.prompts
            s._add_output(f"(rank {s.rank} pdb) {line}\n")
            s.unread.pop()   # the console echoes its own input
        self.rt.send(ref.ctrl, key, ("dbg_in", line))
        for fn in list(self.listeners):
            try:
                fn("sent", s)
            except Exception:
                pass

    def cast(self, spec: str, line: str) -> list[PausedSession]:
        targets = self.select(spec)
        for s in targets:
            self.send(s, line)
        return targets

    def continue_all(self, spec: str | None = None) -> list[PausedSession]:
        targets = self.select(spec) if spec else self.paused()
        for s in targets:
            self.send(s, "continue")
        return targets

    def interrupt_all(self) -> None:
        """Leave every paused rank's debugger with a KeyboardInterrupt in its code."""
        for s in self.paused():
            found = self.rt.procs.get(s.key)
            if found is not None:
                self.rt.send(found[0].ctrl, found[1], Interrupt.make(None))
                self.rt.send(found[0].ctrl, found[1], ("dbg_in", "continue"))

    def set_post_mortem(self, procs, on: bool) -> None:
        st = state_of(procs)
        for ref in procs.procs():
            if ref.key not in self.rt.dead:
                self.rt.send(ref.ctrl, st.key, ("dbg_pm", on))

    def refresh(self, procs) -> None:
        """Learn of ranks that paused while no controller was attached (``ProcMesh.states``)."""
        self.quiet += 1
        try:
            states = procs.states().values()
        finally:
            self.quiet -= 1
        keys = {ref.key: ref for ref in procs.procs()}
        with self.cond:
            for ref_key, info in zip(keys, states, strict=False):
                dbg = info.get("debugger") if isinstance(info, dict) else None
                s = self.sessions.get(ref_key)
                if dbg is None:
                    continue
                if s is None:
                    s = self.sessions[ref_key] = PausedSession(keys[ref_key].rank, ref_key)
                    self.pauses += 1
                s._update(dbg)
                if "line" in dbg and s.state != "prompt":
                    s.state = "prompt"
                    s.prompts += 1
            self.cond.notify_all()
        for fn in list(self.listeners):
            fn("refresh", None)


_REGISTRY: DebugRegistry | None = None
_lock = threading.Lock()


def registry() -> DebugRegistry:
    """This controller's debugger registry; installs the text console on the main thread."""
    global _REGISTRY
    rt = runtime()
    with _lock:
        if _REGISTRY is None or _REGISTRY.rt is not rt:
            _REGISTRY = DebugRegistry(rt)
            from .console import install_console

            install_console(_REGISTRY)
    return _REGISTRY
