"""Worker output in the notebook: rank-labelled, under the cell that caused it.

Workers send ``("out", rank, stream, text)`` and ``("display", rank, data, metadata)``
to the controller's inbox; the runtime's I/O thread hands them to ``OutputRouter``
(``rt.output`` and ``rt.on_message("display", ...)``).

While an ``%%on_mesh`` cell runs, its output is first *held* and, when the cell ends
within ``MONARCH_KERNEL_HOLD_S`` (1 s), written in rank order (rank 0's lines, then rank 1's, ...): the
cell's output is then the same on every run, which is what nbval compares. A cell that
runs longer switches to *live*: what was held is written in arrival order, and every
later line is written at once, from the I/O thread, under the cell's parent header
(ipykernel's streams and display publisher take a per-thread parent). Per rank, order is
always kept: a worker flushes its stdout before it sends a display or a reply, on the
same socket. ``--stream`` on ``%%on_mesh`` goes live at once; ``MONARCH_KERNEL_HOLD_S``
changes the hold. Figures and other rich displays of several ranks are gathered into one
output, a grid or tabs (rank_grid.py); text stays in the stream.
"""
from __future__ import annotations

import sys
import threading
import time
import uuid

from .. import config
from ..core.mesh_tables import RANKS_CHARS, rank_ranges
from .rank_grid import SHOWN_RANKS, KeptDisplays, grid_bundle, is_rich
from .text_output import SKIPPED, OutputOptions, TextLimits, collate, label, merge, split_lines


def label_lines(rank: int, text: str) -> str:
    return "".join(f"[rank {rank}] {line}\n" for line in text.rstrip("\n").split("\n"))


def label_display(rank: int, data: dict, metadata: dict) -> tuple[dict, dict]:
    """Mark a worker's display with its rank (text, HTML, and the metadata)."""
    data = dict(data)
    md = dict(metadata or {})
    md["monarch_kernel"] = {"rank": rank}
    if "text/plain" in data:
        data["text/plain"] = f"[rank {rank}] {data['text/plain']}"
    tag = f'<div style="font-size:smaller;opacity:.7">rank {rank}</div>'
    if "text/html" in data:
        data["text/html"] = f"<div>{tag}{data['text/html']}</div>"
    else:
        for mime in ("image/png", "image/jpeg"):
            if mime in data:
                data["text/html"] = f'<div>{tag}<img src="data:{mime};base64,{data[mime]}"/></div>'
                break
    return data, md


GRID_UPDATE_S = 0.25   # a live grid of ranks' figures is re-sent at most this often


def write_labelled(router: OutputRouter, limits: TextLimits, groups: list[tuple[str, str, list[int]]],
                   parent) -> None:
    """Labelled lines, one write per run of the same stream; then, once, the notice that
    ``limits`` started keeping lines back."""
    run_stream, run = None, []
    for stream, text, ranks in groups:
        if stream != run_stream and run:
            router.write_text(run_stream, "".join(run), parent)
            run = []
        run_stream = stream
        run.append(label(ranks, text))
    if run:
        router.write_text(run_stream, "".join(run), parent)
    notice = limits.first_limit_notice()
    if notice:
        router.write_text("stderr", notice, parent)


class CellCapture:
    """The output of one running cell: held (then grouped) or live.

    Text goes through text_output.py: merged, grouped by rank or collated
    (``--group-outputs``), filtered (``--show-ranks``/``--quiet-ranks``) and bounded.
    Rich displays (figures, HTML) of several ranks become one grid output (rank_grid.py):
    held, it is written when the cell ends; live, it is written at the first one and
    updated in place (a display id) as more arrive, at most every ``GRID_UPDATE_S``. Those
    of ``rank_grid.SHOWN_RANKS`` ranks are shown; every rank's are kept (``displays``)."""

    def __init__(self, router: OutputRouter, parent: dict | None, ranks, live: bool,
                 options: OutputOptions | None = None):
        self.router = router
        self.parent = parent
        self.ranks = set(ranks)
        self.live = live
        self.options = options or OutputOptions()
        self.limits = TextLimits(self.options)
        self.held: list[tuple[int, tuple]] = []
        self.rich: list[tuple[int, dict]] = []   # live: what the grid shows so far
        self.grid_id: str | None = None
        self.grid_sent = 0.0       # live: when the grid was last sent
        self.grid_due = False      # live: the grid changed since
        self.displays = KeptDisplays()   # every rank's rich displays, for `_on_mesh_displays`
        self.unshown: set[int] = set()   # ranks whose rich displays are kept, not shown
        self.progress = None   # cell_progress.CellProgress, for cells on many ranks
        self.lock = threading.Lock()

    def add(self, rank: int, item: tuple) -> None:
        with self.lock:
            if not self.options.wants(rank):
                self.limits.hidden[rank] += 1
                return
            if item[0] == "stream":
                self._add_text(rank, item[1], item[2])
                return
            rich = item[0] == "display" and is_rich(item[1])
            if rich:
                self.displays.keep(rank, item[1], item[2])
            if not self.live:
                self.held.append((rank, item))
                return
            if rich:
                self._grow_grid(rank, item[1], self.parent)
                return
        self.router.emit(rank, item, self.parent)

    def kept_back(self, rank: int, n: int) -> None:
        """``n`` lines rank ``rank`` did not send (monarch_kernel/node/output_limit.py): counted, and
        said so when the cell ends."""
        with self.lock:
            if self.options.wants(rank):
                self.limits.dropped[rank] += n
            else:
                self.limits.hidden[rank] += n

    def _add_text(self, rank: int, stream: str, text: str) -> None:
        """Under the lock: hold, merge in the window, or write (within the budget)."""
        lim = self.limits
        if not self.live:
            if lim.admit_held(rank, text.count("\n") or 1):
                self.held.append((rank, ("stream", stream, text)))
            return
        if self.options.mode == "merged":
            lim.add_to_window(rank, stream, text)
            if lim.window_due():
                self._write(lim.take_window(), self.parent)
            return
        self._write(lim.writable([(stream, t, [rank]) for t in split_lines(text)]), self.parent)

    def poll(self) -> None:
        """About 10 times a second while the cell runs (on_mesh._Run.tick): write a merge
        window that waited long enough, and refresh the progress line."""
        with self.lock:
            if self.live and self.limits.window_due():
                self._write(self.limits.take_window(), self.parent)
            if self.grid_due and time.monotonic() - self.grid_sent >= GRID_UPDATE_S:
                self._send_grid(self.parent)
        if self.progress is not None:
            self.progress.tick()

    def go_live(self) -> None:
        """Write what was held, in arrival order (merged when asked), and stream the rest."""
        with self.lock:
            if self.live:
                return
            self.live = True
            held, self.held = self.held, []
            if self.options.mode == "merged":   # merged lines read best in rank order
                held.sort(key=lambda ri: ri[0])
            self._write_held(held, self.parent, collated=False, display=self._show_live)

    def finish(self) -> None:
        """The cell is done: write what was held, grouped as asked (``rank``: each rank's
        output together; ``order``: collated; ``merged``: identical lines once); the rich
        displays of two or more ranks as one grid; then what was not shown, and where it is."""
        with self.lock:
            held, self.held = self.held, []
            self.live = True
            groups = self.limits.take_window()
            if self.grid_due:
                self._send_grid(None)
        self._write(groups, None)
        if self.options.mode != "order":
            held.sort(key=lambda ri: ri[0])
        rich = [(r, it[1]) for r, it in held if it[0] == "display" and is_rich(it[1])]
        if len({r for r, _ in rich}) < 2:
            rich = []
        shown = set(sorted({r for r, _ in rich})[:SHOWN_RANKS])
        self.unshown.update(r for r, _ in rich if r not in shown)
        self._write_held([ri for ri in held if not (rich and ri[1][0] == "display" and is_rich(ri[1][1]))],
                         None, collated=self.options.mode == "order")
        if rich:
            self.router.publish(*grid_bundle([(r, d) for r, d in rich if r in shown]), None)
        notes = self.limits.closing_notes() + self._unshown_note()
        if notes:
            self.router.write_text("stderr", notes, None)
        if self.progress is not None:
            self.progress.finish()
        self.router.flush()

    def _show_live(self, rank: int, item: tuple, parent) -> None:
        if item[0] == "display" and is_rich(item[1]):
            self._grow_grid(rank, item[1], parent)
        else:
            self.router.emit(rank, item, parent)

    def _write_held(self, held: list[tuple[int, tuple]], parent, collated: bool, display=None) -> None:
        """Held text as ``--group-outputs`` says; displays through ``display(rank, item,
        parent)`` (default: written as they are)."""
        display = display or self.router.emit
        if self.options.mode == "merged":
            lines = [(r, it[1], t) for r, it in held if it[0] == "stream" for t in split_lines(it[2])]
            self._write(self.limits.writable(merge(lines)), parent)
            for rank, item in held:
                if item[0] != "stream":
                    display(rank, item, parent)
            return
        items = [(r, ("line", it[1], t)) if it[0] == "stream" else (r, it)
                 for r, it in held for t in (split_lines(it[2]) if it[0] == "stream" else [None])]
        if collated:
            items = collate(items)
        pending: list[tuple[str, str, list[int]]] = []
        for rank, item in items:
            if item[0] == "line":
                pending.append((item[1], item[2], [rank]))
                continue
            self._write(self.limits.writable(pending), parent)
            pending = []
            display(rank, item, parent)
        self._write(self.limits.writable(pending), parent)

    def _write(self, groups: list[tuple[str, str, list[int]]], parent) -> None:
        write_labelled(self.router, self.limits, groups, parent)

    def _grow_grid(self, rank: int, data: dict, parent) -> None:
        """Live: add a rank's display to the grid (that of the ``SHOWN_RANKS`` lowest ranks
        that displayed so far, as when the cell ends within the hold) and send it, or have
        ``poll`` send it once ``GRID_UPDATE_S`` has passed."""
        shown = {r for r, _ in self.rich}
        if rank not in shown and len(shown) >= SHOWN_RANKS:
            top = max(shown)
            if rank > top:
                self.unshown.add(rank)
                return
            self.rich = [(r, d) for r, d in self.rich if r != top]   # a lower rank takes its place
            self.unshown.add(top)
        self.rich.append((rank, data))
        self.grid_due = True
        if self.grid_id is None or time.monotonic() - self.grid_sent >= GRID_UPDATE_S:
            self._send_grid(parent)

    def _send_grid(self, parent) -> None:
        bundle, md = grid_bundle(self.rich)
        self.grid_due, self.grid_sent = False, time.monotonic()
        if self.grid_id is None:
            self.grid_id = uuid.uuid4().hex
            self.router.publish(bundle, md, parent, self.grid_id)
        else:
            self.router.publish(bundle, md, parent, self.grid_id, update=True)

    def _unshown_note(self) -> str:
        if not self.unshown:
            return ""
        first = min(self.unshown)
        lost = (f"; {self.displays.not_kept} displays past {self.displays.bytes // 1024**2} MB were not kept"
                if self.displays.not_kept else "")
        who = rank_ranges(sorted(self.unshown), RANKS_CHARS)
        return (f"[monarch_kernel] figures and other displays of {who} are not "
                f"shown here (a cell shows {SHOWN_RANKS} ranks'); `display(*_on_mesh_displays[{first}])` shows "
                f"rank {first}'s{lost}\n")


class LooseOutput:
    """What ranks print while no ``%%on_mesh`` cell of theirs runs (an actor's endpoint
    called from a plain cell, a background task): identical lines from several ranks within
    ``MONARCH_KERNEL_MERGE_WINDOW_S`` are shown once with their ranks, as a cell's are (an
    endpoint printing on 256 ranks was 256 lines), under the cell running now. Written by a
    timer after the window, and at once when the cell ends, a display comes, or the held
    lines pass ``MAX_LINES``. Each cell's loose output has a cell's limits (lines a second
    and a cell in the notebook, ``text_output.TextLimits``); what they keep back and what the
    procs kept back is counted and said when the cell ends, as a cell's is."""

    MAX_LINES = 10_000

    def __init__(self, router: OutputRouter):
        self.router = router
        self.lock = threading.Lock()
        self.lines: list[tuple[int, str, str]] = []
        self.parent: dict | None = None
        self.timer: threading.Timer | None = None
        self.limits = TextLimits(OutputOptions())

    def end_cell(self, *_) -> None:
        """A cell ends (or the next starts): what is held is written, then what was not
        shown; the limits start afresh."""
        with self.lock:
            self._flush()
            notes = self.limits.closing_notes()
            self.limits = TextLimits(OutputOptions())
        if notes:
            self.router.write_text("stderr", notes, self.parent)

    def kept_back(self, rank: int, n: int) -> None:
        with self.lock:
            self.limits.dropped[rank] += n

    def add(self, rank: int, stream: str, text: str, parent: dict | None) -> None:
        with self.lock:
            if self.lines and parent is not self.parent:
                self._flush()   # the lines of an earlier cell stay under it
            self.parent = parent
            self.lines += [(rank, stream, t) for t in split_lines(text)]
            if len(self.lines) >= self.MAX_LINES:
                self._flush()
            elif self.timer is None:
                self.timer = threading.Timer(config.MERGE_WINDOW_S.get(), self.flush)
                self.timer.daemon = True
                self.timer.start()

    def flush(self, *_) -> None:
        with self.lock:
            self._flush()

    def _flush(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        lines, self.lines = self.lines, []
        if not lines:
            return
        lines.sort(key=lambda ln: ln[0])   # rank order; stable, so each rank's order is kept
        write_labelled(self.router, self.limits, self.limits.writable(merge(lines)), self.parent)


class OutputRouter:
    """Installed once per controller process by the magics (``install``)."""

    def __init__(self, shell=None):
        self.shell = shell
        self.active: CellCapture | None = None
        self.cell_parent: dict | None = None   # the cell running now (pre_run_cell), for loose output
        self.loose = LooseOutput(self)
        self._streams = {"stdout": sys.stdout, "stderr": sys.stderr}

    def install(self, rt) -> None:
        rt.output = self.on_output
        rt.on_message("display", self.on_display, replace=True)   # the kernel's current router
        events = getattr(self.shell, "events", None)
        if events is not None:
            for event, fn in (("pre_run_cell", self._cell_started), ("post_run_cell", self.loose.end_cell)):
                if fn not in events.callbacks[event]:
                    events.register(event, fn)

    def _cell_started(self, *_) -> None:
        """On the kernel's main thread, where its parent header is known (a context variable
        of ipykernel's: the I/O thread cannot read it)."""
        self.loose.end_cell()
        self.cell_parent = self._current_parent()

    # ---------------------------------------------------------------- I/O thread
    def on_output(self, rank: int, stream: str, text: str) -> None:
        if stream == SKIPPED:   # lines the proc kept back (its rate limit): counted, in its log
            cap = self.active
            n = int(text.split(" ", 1)[0])
            if cap is not None and rank in cap.ranks:
                cap.kept_back(rank, n)
            else:
                self.loose.kept_back(rank, n)
            return
        self._route(rank, ("stream", stream, text))

    def on_display(self, msg) -> None:
        _, rank, data, metadata = msg
        self._route(rank, ("display", data, metadata))

    def _route(self, rank: int, item: tuple) -> None:
        cap = self.active
        if cap is not None and rank in cap.ranks:
            cap.add(rank, item)
        elif item[0] == "stream":
            self.loose.add(rank, item[1], item[2], self.cell_parent)
        else:
            self.loose.flush()   # the lines printed before the display come first
            self.emit(rank, item, self.cell_parent)

    # ---------------------------------------------------------------- a cell
    def begin(self, ranks, live: bool = False, options: OutputOptions | None = None) -> CellCapture:
        self.loose.flush()
        parent = self._current_parent()
        cap = self.active = CellCapture(self, parent, ranks, live, options)
        return cap

    def end(self, cap: CellCapture) -> None:
        if self.active is cap:
            self.active = None
        cap.finish()
        if cap.displays and self.shell is not None:
            self.shell.user_ns["_on_mesh_displays"] = cap.displays

    def _current_parent(self) -> dict | None:
        kernel = getattr(self.shell, "kernel", None)
        if kernel is None:
            return None
        try:
            return kernel.get_parent("shell")
        except Exception:
            return None

    # ---------------------------------------------------------------- writing
    def emit(self, rank: int, item: tuple, parent: dict | None) -> None:
        """Write one item; ``parent`` set means "from a non-main thread, for that cell"."""
        if item[0] == "stream":
            _, stream, text = item
            self.write_text(stream, label_lines(rank, text), parent)
        else:
            _, data, metadata = item
            self.publish(*label_display(rank, data, metadata), parent)

    def write_text(self, stream: str, text: str, parent: dict | None) -> None:
        """Already labelled text to the notebook's stdout or stderr."""
        out = self._streams.get(stream) if parent is not None else None
        if out is None:
            out = sys.stderr if stream == "stderr" else sys.stdout
        self._with_parent(out, parent, lambda: out.write(text))

    def publish(self, data: dict, md: dict, parent: dict | None, display_id: str | None = None,
                update: bool = False) -> None:
        """One display under the cell (``display_id``: one that later updates replace)."""
        pub = getattr(self.shell, "display_pub", None)
        if pub is None:
            sys.stdout.write(data.get("text/plain", "") + "\n")
            return
        self.flush()
        transient = {"display_id": display_id} if display_id else None
        self._with_parent(pub, parent, lambda: pub.publish(data=data, metadata=md, transient=transient,
                                                           update=update))

    def flush(self) -> None:
        """Send the text the notebook's streams hold, so a display goes after it (a stream
        that holds none is left alone: see ``holds_text``)."""
        for s in (sys.stdout, sys.stderr):
            if not holds_text(s):
                continue
            try:
                s.flush()
            except Exception:
                pass

    @staticmethod
    def _with_parent(obj, parent, fn) -> None:
        setp = getattr(obj, "set_thread_parent", None) if parent is not None else None
        if setp is None:
            fn()
            return
        token = setp(parent)
        try:
            fn()
        finally:
            obj.reset_thread_parent(token)


def holds_text(stream) -> bool:
    """Has ``stream`` text to send? ipykernel's ``OutStream.flush`` from the kernel's main
    thread hands the flush to its I/O thread and waits for it, twice a stream, even with
    nothing to send (ipykernel flushes both streams several times a cell). Its buffers say;
    a stream that is not ipykernel's, or echoes to a terminal, is assumed to hold some."""
    buffers = getattr(stream, "_buffers", None)
    if not isinstance(buffers, dict) or getattr(stream, "echo", None) is not None:
        return True
    return any(b.tell() for b in list(buffers.values()))


def flush_only_text(stream) -> None:
    """Make ``stream.flush()`` return at once when the stream holds no text (``holds_text``);
    what was written is still sent first, as before."""
    if getattr(stream, "_buffers", None) is None or getattr(stream.flush, "only_text", False):
        return
    real = stream.flush

    def flush() -> None:
        if holds_text(stream):
            real()

    flush.only_text = True
    stream.flush = flush
