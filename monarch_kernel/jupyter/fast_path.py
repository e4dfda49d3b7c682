"""IPython and ipykernel work that a cell does not need, skipped (issue 11: a trivial
``%%on_mesh`` cell on 256 ranks; the kernel's own time before and after the ranks' is
serial with theirs, and on a 2-core machine any CPU it spends meanwhile slows them).

* ``transform_cell``: IPython transforms a cell's text in four steps: its cleanup
  transforms, the cell-magic line transform, token transforms (``x = %magic``, ``!cmd``,
  ``x?``: the text re-tokenized for each), then, the result being one line, the prefilter
  (automagic, autocall). Our cleanup transform (``magics.rewrite_on_mesh_cell``) makes an
  ``%%on_mesh`` cell one line, ``await __import__(...).on_mesh_async('LINE', 'BODY')``, the
  cell's own text inside string literals, on which none of the later steps changes a
  thing: the prefilter sees the keyword ``await`` as the line's first word, which shadows
  magics and autocall. For such a cell ``transform_cell`` runs the cleanup transforms (all
  of them, in order: the debugger's and the user's too), then the post transforms, and
  skips the rest (~0.2 ms of the kernel's CPU warm, more cold). Any other cell, or one with
  prefilter transformers registered, takes IPython's full path.
* ``_accepts_parameters``: ipykernel reads ``inspect.signature(shell.run_cell_async)``
  on every cell (~75 us); the answer depends on the function only, so it is kept per
  function (``remember_accepted_parameters``).
* History: IPython's history thread writes each cell's input to its sqlite file as the
  cell starts (~1 ms of CPU, the GIL taken from the cell's start meanwhile, and the input
  cache's lock held through the file's sync). For an ``%%on_mesh`` cell ``HistoryWrites``
  holds that write until the cell's call is sent (``call_sent``, from on_mesh.py), when the
  kernel only waits for the ranks, or until the cell replies, ``HOLD_HISTORY_S`` at most.
  Held to the reply, a write met the next cell's start (its lock) in a run of cells.
"""
from __future__ import annotations

import threading
import time

HOLD_HISTORY_S = 1.0
HISTORY_GAP_S = 0.25   # the history thread's writes at most this often (HistoryWrites)

ASYNC_PREFIX = "await __import__('monarch_kernel.jupyter.magics'"   # magics._ASYNC_CALL's start


def install_transform(shell) -> None:
    """Give ``shell`` the ``%%on_mesh`` fast path of ``transform_cell`` (once)."""
    full = shell.transform_cell
    if getattr(full, "on_mesh_fast_path", False):
        return

    def transform_cell(raw_cell: str) -> str:
        if "%%on_mesh" in raw_cell:
            lines = on_mesh_lines(shell, raw_cell)
            if lines is not None:
                for transform in shell.input_transformers_post:
                    lines = transform(lines)
                return "".join(lines)
        return full(raw_cell)

    transform_cell.on_mesh_fast_path = True
    transform_cell.full = full
    shell.transform_cell = transform_cell


def uninstall_transform(shell) -> None:
    fast = shell.__dict__.get("transform_cell")
    if getattr(fast, "on_mesh_fast_path", False):
        del shell.transform_cell


def on_mesh_lines(shell, raw_cell: str) -> list[str] | None:
    """The cell after IPython's cleanup transforms, if that made it our one awaited line
    (and the prefilter is IPython's stock one); else None."""
    if shell.prefilter_manager.transformers:
        return None
    manager = shell.input_transformer_manager
    cell = raw_cell if raw_cell.endswith("\n") else raw_cell + "\n"
    lines = cell.splitlines(keepends=True)
    for transform in manager.cleanup_transforms:
        lines = transform(lines)
    if len(lines) != 1 or not lines[0].startswith(ASYNC_PREFIX):
        return None
    shell._last_input_line = lines[0].rstrip("\n")   # what the prefilter would have recorded
    return lines


def remember_accepted_parameters() -> None:
    """ipykernel's ``_accepts_parameters(meth, names)``, answered once per function."""
    try:
        from ipykernel import ipkernel
    except ImportError:
        return
    real = getattr(ipkernel, "_accepts_parameters", None)
    if real is None or getattr(real, "remembered", False):
        return
    known: dict = {}

    def accepts_parameters(meth, param_names):
        key = (getattr(meth, "__func__", meth), tuple(param_names))
        try:
            answer = known.get(key)
        except TypeError:   # unhashable: ask every time, as before
            return real(meth, param_names)
        if answer is None:
            answer = real(meth, param_names)
            if len(known) < 64:
                known[key] = answer
        return dict(answer)

    accepts_parameters.remembered = True
    ipkernel._accepts_parameters = accepts_parameters


class HistoryWrites:
    """Holds the history thread's write (``writeout_cache`` on that thread only) while an
    ``%%on_mesh`` cell prepares its call: ``cell_started``/``cell_ended`` from the kernel's
    ``execute_request``, ``call_sent`` from the cell. And paces it: at most one write every
    ``HISTORY_GAP_S`` (each is a SQLite transaction, ~1.5 ms of CPU on the history thread; a
    notebook running cells back to back wrote once a cell, beside the 256 procs that run it:
    2 ms of the kernel's CPU a cell at 256 ranks, measured). Whatever the thread waits to
    write is written in one transaction; a kernel killed outright loses at most the inputs of
    that gap (IPython's own ``db_cache_size`` would keep N cells instead)."""

    current: HistoryWrites | None = None   # the kernel's (one a process)

    def __init__(self, history_manager):
        self.hm = history_manager
        self.idle = threading.Event()
        self.idle.set()
        self.write_started = 0.0   # (time.monotonic() of the thread's last write: tests)
        self.writes = 0            # (the thread's writes: tests)
        HistoryWrites.current = self
        real = history_manager.writeout_cache
        if getattr(real, "held_while_cells_run", False):
            return

        def writeout_cache(conn=None):
            thread = self.hm.save_thread
            if thread is not None and threading.current_thread() is thread:
                hw = HistoryWrites.current
                gap = hw.write_started + HISTORY_GAP_S - time.monotonic()
                if gap > 0:
                    time.sleep(gap)   # (what comes meanwhile joins this write)
                hw.idle.wait(HOLD_HISTORY_S)
                hw.write_started = time.monotonic()
                hw.writes += 1
            real(conn) if conn is not None else real()

        writeout_cache.held_while_cells_run = True
        history_manager.writeout_cache = writeout_cache

    def cell_started(self, code: str) -> None:
        if code.lstrip().startswith("%%on_mesh"):
            self.idle.clear()

    def call_sent(self) -> None:
        self.idle.set()

    cell_ended = call_sent


def call_sent() -> None:
    """The running cell has sent its call and now waits: the history thread may write."""
    hw = HistoryWrites.current
    if hw is not None:
        hw.call_sent()
