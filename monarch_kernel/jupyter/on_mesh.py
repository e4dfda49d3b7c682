"""Running ``%%on_mesh`` cells from the controller: select ranks, call, wait, report.

Waiting has two forms sharing one loop body (``_Run.tick``):
  * async (the kernel's path): the cell magic is rewritten to ``await`` (see magics.py),
    so the kernel's event loop keeps dispatching comm messages while ranks run, and the
    kernel's interrupt arrives as ``asyncio.CancelledError``;
  * sync (``%on_mesh`` line form, or autoawait off): ``Future.get`` in short slices, the
    interrupt arrives as ``KeyboardInterrupt``.
Either way an interrupt, or ``--timeout``, calls ``ProcMesh.interrupt()`` (re-sent every
0.2 s, since a rank may not have started the cell yet) and waits up to ``STOP_GRACE_S``
for every rank to report back; the mesh stays usable.

``WAIT_HOOKS``: callables ``hook(run)`` called on every tick (about 10 per second) while a
cell runs, on the kernel's main thread, where blocking ``input()`` works. The debugger
(issue 5) uses it to notice ranks paused in ``breakpoint()`` and open its console;
``DONE_HOOKS`` are called when the cell ends, before its reply (the debugger widget opened
under the cell becomes text there).
"""
from __future__ import annotations

import asyncio
import itertools
import re
import time
from collections.abc import Callable

from monarch_kernel import config

from ..core import silent_procs
from ..core.errors import HOST_GONE_HINT, HOST_LOST, ActorError, SupervisionError
from ..core.mesh import ActorMesh, ProcMesh, state_of, view_of
from ..core.mesh_tables import ranges
from ..core.shape import MeshView, parse_rank_spec
from ..node.cells import CellFailure
from .cell_progress import CellProgress
from .display import CellInterrupted, CellValues, cell_error
from .fast_path import call_sent
from .session import session
from .text_output import OutputOptions

TICK_S = 0.1
STOP_GRACE_S = 2.0
_NATIVE = "a rank may be stuck in native code"   # why a rank did not stop, when its host names no cause
WAIT_HOOKS: list[Callable[[_Run], None]] = []
DONE_HOOKS: list[Callable[[_Run], None]] = []   # hook(run) when the cell ended, still in it
# CELL_NAMERS: ``namer(body) -> (filename, lines_before_body) | None``; the first answer names
# the cell's code on the ranks (debug/dap.py: the file JupyterLab's debugger knows the cell by).
CELL_NAMERS: list[Callable[[str], tuple[str, int] | None]] = []
_cell_counter = itertools.count(1)


def select(cells: ActorMesh, ranks: str | None, slice_: str | None) -> ActorMesh:
    """Apply ``--slice`` (named dims) then ``--ranks`` (the rank grammar) to the mesh.
    A bad spec raises ValueError naming the valid range."""
    view: MeshView = view_of(cells)
    if slice_:
        if "=" not in slice_:
            raise ValueError(f"--slice {slice_!r}: name a dimension, e.g. --slice gpus=0:2 "
                             f"(dims: {', '.join(view.labels) or 'none'})")
        view = parse_rank_spec(slice_, view)
    if ranks:
        view = parse_rank_spec(ranks, view)
    return ActorMesh(state_of(cells), view)


def output_options(cells: ActorMesh, args) -> OutputOptions:
    """``--group-outputs``, ``--show-ranks``, ``--quiet-ranks`` (specs in the mesh's ranks)."""
    def ranks(spec):
        return parse_rank_spec(spec, view_of(cells)).ranks if spec else None

    return OutputOptions(args.group_outputs, ranks(args.show_ranks), ranks(args.quiet_ranks),
                         args.show_ranks or "", args.quiet_ranks or "")


def cell_filename(execution_count) -> str:
    n = next(_cell_counter)
    return f"<In [{execution_count}] on mesh>" if execution_count else f"<mesh cell {n}>"


def cell_run_args(execution_count, code: str, want_value: bool) -> tuple:
    """The arguments of ``CellRunner.run`` for this cell (see CELL_NAMERS)."""
    for namer in CELL_NAMERS:
        named = namer(code)
        if named is not None:
            return (code, named[0], want_value, named[1])
    return (code, cell_filename(execution_count), want_value)


FAST_WAIT_S = 0.005
FAST_WAIT_MAX_S = 0.05   # (a cell on 256 ranks of this 2-core machine: ~25 ms)
_last_cell_s = 0.0   # how long the last %%on_mesh cell took: the next one is likely alike


class _Run:
    """One call on the cell runner mesh, waited for with interrupt and timeout."""

    def __init__(self, target: ActorMesh, method: str, args: tuple, timeout: float | None,
                 capture=None, what: str = "the cell"):
        self.procs = ProcMesh(state_of(target).proc_state, view_of(target))   # to interrupt
        self.target = target
        self.ranks = list(view_of(target).ranks)
        self.timeout = timeout
        self.capture = capture
        self.what = what
        self.started = time.monotonic()
        self.future = getattr(target, method).call(*args)
        if capture is not None:
            call_sent()   # the kernel only waits now: IPython's history thread may write
        from ..core.runtime import runtime

        self.pending = runtime().pending_of(self.future)   # who answered, if a rank dies meanwhile
        self.interrupted_at: float | None = None
        self.reason = ""
        self.debugger_widget = None   # set by the debugger's wait hook when it opens one here
        self._last_interrupt = 0.0
        if capture is not None and len(self.ranks) >= config.PROGRESS_RANKS.get():
            capture.progress = CellProgress(self, capture.router, capture.parent)

    def interrupt(self, reason: str) -> None:
        if self.interrupted_at is None:
            self.interrupted_at = time.monotonic()
            self.reason = reason
        self._send_interrupt()

    def _send_interrupt(self):
        self._last_interrupt = time.monotonic()
        self.procs.interrupt()

    def tick(self) -> None:
        now = time.monotonic()
        cap = self.capture
        if cap is not None and not cap.live and now - self.started >= _hold_s():
            cap.go_live()
        if cap is not None:
            cap.poll()   # the merge window of live output, the progress line
        if self.interrupted_at is None:
            if self.timeout is not None and now - self.started >= self.timeout:
                self.interrupt(f"timed out after {self.timeout:g} s")
            for hook in WAIT_HOOKS:
                hook(self)
        elif now - self._last_interrupt >= 0.2:
            self._send_interrupt()

    def done(self) -> None:
        global _last_cell_s
        if self.capture is not None:   # a cell (not a %mesh command's call)
            _last_cell_s = time.monotonic() - self.started
        for hook in DONE_HOOKS:
            try:
                hook(self)
            except Exception as e:   # a broken hook must not lose the cell's result
                print(f"monarch_kernel: {hook.__name__} failed: {e}")

    def gave_up(self) -> bool:
        return self.interrupted_at is not None and time.monotonic() - self.interrupted_at > STOP_GRACE_S

    # ---------------------------------------------------------------- waiting
    def wait_sync(self):
        while True:
            try:
                return self.future.get(TICK_S)
            except TimeoutError:
                pass
            except KeyboardInterrupt:
                self.interrupt("was interrupted")
                continue
            if self.gave_up():
                return self._unstoppable()
            self.tick()

    async def wait_async(self):
        # Most cells finish in a few milliseconds: wait about as long as the last cell took
        # (FAST_WAIT_S at least, FAST_WAIT_MAX_S at most) in this thread first, blocking the
        # loop that long, then let the loop run (widgets, comms) while longer cells go on.
        # A cell that ends within the wait costs the kernel one wake; handed to the loop, the
        # wait costs ~0.4 ms of CPU more (a 5 ms wait that runs out, the loop's wake-ups).
        from ..core.runtime import runtime

        rt = runtime()
        hook = rt.set_wait_hook(None)   # a pause is this cell's wait hooks' to handle
        try:
            return self.future.get(min(FAST_WAIT_MAX_S, max(FAST_WAIT_S, 1.5 * _last_cell_s)))
        except TimeoutError:
            pass
        except KeyboardInterrupt:
            self.interrupt("was interrupted")
        finally:
            if rt.wait_hook is None:
                rt.set_wait_hook(hook)
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def wake(_):
            loop.call_soon_threadsafe(lambda: done.done() or done.set_result(None))

        self.future.add_done_callback(wake)
        while not self.future.done():
            try:
                await asyncio.wait([done], timeout=TICK_S)
            except asyncio.CancelledError:   # the kernel's interrupt, in an async cell
                self.interrupt("was interrupted")
                continue
            if self.future.done():
                break
            if self.gave_up():
                return self._unstoppable()
            self.tick()
        return self.future.get()

    def _unstoppable(self):
        from ..core.runtime import runtime

        rt = runtime()
        # Only the ranks that have not answered are stuck; the others' values are kept.
        answered = rt.answered_so_far(self.future) or [(False, None)] * len(self.ranks)
        st = state_of(self.procs)
        busy = [r for r, (a, _) in zip(self.ranks, answered) if not a and st.procs[r].key not in rt.dead]
        done = [r for r, (a, _) in zip(self.ranks, answered) if a]
        values = [v for _, v in answered]
        groups = [(ranks, "KeyboardInterrupt", f"{self.what} {self.reason}, but did not stop within "
                   f"{STOP_GRACE_S:g} s" + (f" ({why})" if why == _NATIVE else f": {why}"), "")
                  for why, ranks in silent_procs.reasons([st.procs[r] for r in busy], st.key, _NATIVE).items()]
        for r, v in zip(self.ranks, values):   # ranks that answered with an error keep it
            if isinstance(v, (CellFailure, ActorError)):
                groups.append(([r], getattr(v, "exc_type", "") or type(v).__name__, getattr(v, "message", str(v)),
                               getattr(v, "traceback", "") or getattr(v, "remote_traceback", "")))
        ok = [r for r in done if not isinstance(values[self.ranks.index(r)], (CellFailure, ActorError))]
        note = ("those ranks stay busy; `%mesh status` shows them, `%mesh stop` ends the mesh"
                + (f"; the other ranks' values ({rank_list(ok)}) are in `_on_mesh`" if ok else ""))
        result = CellValues(view_of(self.target).extent, values, self.ranks)
        raise cell_error(groups, result, note=note, base=CellInterrupted)


def values_after_death(run: _Run, err: SupervisionError) -> list | None:
    """A rank died while the cell ran: wait up to a second for the live ranks to finish, so
    their values are kept (``_on_mesh``); dead or unfinished ranks hold an ActorError."""
    from ..core.runtime import runtime

    p = run.pending
    if p is None:
        return None
    rt = runtime()
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline and any(
            not a and k not in rt.dead for a, k in zip(p.answered, p.keys)):
        time.sleep(0.01)
    values = []
    for a, k, v in zip(p.answered, p.keys, p.results):
        dead = rt.dead.get(k)
        if a and not isinstance(v, SupervisionError):
            values.append(v)
        elif dead is not None or isinstance(v, SupervisionError):
            values.append(ActorError(supervision_message(dead or v), exc_type="SupervisionError"))
        else:
            values.append(ActorError("still running 1 s after another rank died: it goes on there (`%mesh "
                                     "status` shows what each rank does; `mesh.interrupt()` stops it)",
                                     exc_type="Unfinished"))
    return values


def refused_for_death(target: ActorMesh):
    """The error of a cell its mesh would not send because ranks of it are dead: every dead
    rank (one line per way they died), that the cell ran nowhere, and the ``--ranks`` that
    runs it on the living ones. (It named the first dead rank only, and not whether the cell
    ran on the others.)"""
    from ..core.runtime import runtime

    dead = runtime().dead
    procs = state_of(target).proc_state.procs
    gone = {r: dead[procs[r].key] for r in view_of(target).ranks if procs[r].key in dead}
    if not gone:   # (the mesh named a death this kernel has not recorded: its own words)
        return None
    living = [r for r in view_of(target).ranks if r not in gone]
    gs = failure_groups(list(gone), [ActorError(supervision_message(e), exc_type="SupervisionError")
                                     for e in gone.values()])
    note = "the cell ran on no rank"
    if living:
        note += f"; `%%on_mesh --ranks {ranges(living)}` runs it on the living ones"
    return cell_error(gs, note=note)


def _hold_s() -> float:
    return config.HOLD_S.get()


FAILED = (CellFailure, ActorError)


def any_failed(values) -> bool:
    """Did a rank raise? One look per distinct type of value, not per rank."""
    return any(issubclass(t, FAILED) for t in set(map(type, values)))


def outcome(run: _Run, values) -> CellValues:
    """The ValueMesh of a finished run; raises the grouped error if any rank failed."""
    extent = view_of(run.target).extent
    result = CellValues(extent, values, run.ranks)
    if not any_failed(values):
        return result
    gs = failure_groups(run.ranks, values)
    if not gs:
        return result
    failed = {r for g in gs for r in g[0]}
    ok = [r for r in run.ranks if r not in failed]
    note = f"the other ranks' values ({rank_list(ok)}) are in `_on_mesh`" if ok else ""
    if run.interrupted_at is not None:
        note = f"{run.what} {run.reason} on every rank; the mesh is still usable" + (
            f"; {note}" if note else "")
        raise cell_error(gs, result, note, base=CellInterrupted)
    raise cell_error(gs, result, note)


def failure_groups(ranks, values) -> list[tuple[list[int], str, str, str]]:
    """The ranks that failed, one group per error that reads alike once its rank and pid are
    left out, in the order of their first rank: (ranks, type, words, traceback). A rank alone
    keeps its own words, its pid among them."""
    groups: dict[tuple[str, str], list] = {}
    for r, v in zip(ranks, values, strict=False):
        if isinstance(v, CellFailure):
            key, tb, own = (v.exc_type, v.message), v.traceback, v.message
        elif isinstance(v, ActorError):
            own = v.message
            key, tb = (v.exc_type or "ActorError", _without_who(own)), v.remote_traceback
        else:
            continue
        g = groups.setdefault(key, [[], tb, own])
        g[0].append(r)
    ordered = sorted(groups.items(), key=lambda kv: kv[1][0][0])
    return [(rs, t, own if len(rs) == 1 else m, tb) for (t, m), (rs, tb, own) in ordered]


# "rank 17 (host vm, pid 4242)" in a failure's words (core/errors.py: MeshFailure)
_WHO = re.compile(r" rank \d+ \(host ([^,()]*), pid \d+\)")


def _without_who(message: str) -> str:
    """A failure's words without the rank and pid they name, so that the ranks of a lost
    host are one group (``ranks 0-255: SupervisionError: mesh 'procs' (host vm): host lost:
    ...``), not 256 paragraphs that differ in two numbers."""
    return _WHO.sub(r" (host \1)", message) if " pid " in message else message


def rank_list(ranks) -> str:
    from .display import rank_ranges

    return rank_ranges(ranks)


def supervision_message(err: SupervisionError) -> str:
    text = str(err).split(". Call respawn()")[0]
    failure = getattr(err, "failure", None)
    if str(getattr(failure, "reason", "")).startswith(HOST_LOST):
        # Its words say what to do (wait for a stalled host, or a new mesh): respawn() needs a
        # live host, and a stalled one's procs come back with their state.
        s = session()
        name = f" {s.name}" if s.name else ""
        if s.host is not None and len(s.host) > 1:
            # Other hosts live on with their state: the user ends them first, knowingly (a
            # connect alone refuses a job that lost a host, and says this then).
            how = (f"The whole host is gone, and the state of its procs; the other hosts' ranks keep theirs "
                   f"(`%%on_mesh --ranks` runs cells on them). `%mesh stop{name}`, then `%mesh connect{name}` "
                   "with the same options, starts a new mesh")
        else:
            how = (f"The whole host is gone, and the state of its procs: `%mesh connect{name}` starts a new mesh "
                   "(the next cell says why it ended)")
        text = text.replace(HOST_GONE_HINT, how)
        return f"{text}\n`%mesh status` shows the mesh"
    return (f"{text}\nThe other ranks keep their state; `mesh.respawn()` replaces the dead procs (with an "
            "empty namespace); `%mesh status` shows the mesh")
