"""The debugger widget (ipywidgets): shows the registry, sends commands; no logic of its own.

Live table of paused ranks, a rank selector, a command box, buttons (continue, step,
next, up, down, where, continue all) and an output pane with a button per rank: choosing
ranks in the list shows the first one's pane, which opens scrolled to its newest line.

At hundreds of ranks: the table merges neighbours paused alike (``registry.table_rows``),
the pane has buttons for at most ``PANE_BUTTONS`` ranks (the one shown, those chosen in the
list, then the first), and the widget is redrawn at most every ``RENDER_GAP_S`` however
many ranks pause or answer (256 ranks pausing at once sent 27 MB of widget state in 8 s
when each event redrew a 256-row table).
Shown as a transient widget (jupyter/transient.py) under the cell whose ranks paused:
when that cell ends, on close, or at kernel shutdown it becomes a line of text, so a saved
notebook holds no dead widget. The registry calls
``_changed`` from whichever thread read the rank's message (usually the runtime's I/O
thread); widget state goes out on iopub, which ipykernel makes safe from any thread.
Button clicks and the command box arrive as comm messages, which ipykernel 7 dispatches
even while an awaited ``%%on_mesh`` cell holds the shell (kernelbase ``shell_main``):
that is what lets the widget drive ranks paused by the cell that is still running.
"""
from __future__ import annotations

import html
import threading
import time
import weakref

import ipywidgets as W

from ..core.mesh_tables import rank_ranges
from .registry import DebugError, DebugRegistry, PausedSession, table_rows

_SHOWN: weakref.WeakSet = weakref.WeakSet()
BUTTONS = (("continue", "continue"), ("step", "step"), ("next", "next"), ("up", "up"), ("down", "down"),
           ("where", "where"))
RENDER_GAP_S = 0.1   # the widget is redrawn at most this often (events between are one redraw)
PANE_BUTTONS = 12    # ranks with a button above the output pane; the list chooses any other


class WidgetMode:
    """``%mesh debug`` turns it on: ranks paused while a cell runs get a widget under that
    cell (settled into a line of text when the cell ends, so no widget is left behind);
    ``%mesh debug console`` or the widget's close button turn it off."""

    on = False


def widget_shown() -> bool:
    """Is a debugger widget shown (and not closed) in this kernel?"""
    return any(w.open for w in list(_SHOWN))


class DebuggerWidget:
    def __init__(self, reg: DebugRegistry):
        self.reg = reg
        self.open = True
        self._lock = threading.RLock()
        self._due_lock = threading.Lock()
        self._due: threading.Timer | None = None   # a redraw waiting for RENDER_GAP_S to pass
        self._last_render = 0.0
        self.texts: dict[int, str] = {}      # rank -> its pane's text (kept after it resumes)
        self.pane_for: int | None = None     # the rank whose output the pane shows
        self.pane = W.HTML()
        self.pane_rank = W.ToggleButtons(options=[], description="output", style={"button_width": "110px"})
        self.shown = None   # the TransientWidget once displayed
        self.title = W.HTML()
        self.table = W.HTML()
        self.ranks = W.SelectMultiple(options=[], rows=4, description="ranks",
                                      layout=W.Layout(width="420px"))
        self.command = W.Text(placeholder="pdb command for the selected ranks, e.g. p x",
                              description="command", layout=W.Layout(width="420px"))
        # continuous_update (the default): the box's value reaches the kernel as it is typed,
        # so Enter's submit finds it there (with False it arrived after the submit)
        self.send_btn = W.Button(description="send", button_style="primary")
        self.buttons = [W.Button(description=label, tooltip=f"{cmd} on the selected ranks")
                        for label, cmd in BUTTONS]
        self.all_btn = W.Button(description="continue all", button_style="warning")
        self.close_btn = W.Button(description="close", tooltip="close the widget (the cell becomes the console; "
                                                               "`%mesh debug` brings the widget back)")
        self.status = W.HTML()
        self.send_btn.on_click(lambda _: self.send(self.command.value))
        self.command.on_submit(lambda _: self.send(self.command.value))
        for (_, cmd), b in zip(BUTTONS, self.buttons, strict=True):
            b.on_click(lambda _, c=cmd: self.send(c, clear=False))
        self.all_btn.on_click(lambda _: self.continue_all())
        self.close_btn.on_click(lambda _: self.close())
        self.box = W.VBox([
            self.title, self.table,
            W.HBox([self.ranks]),
            W.HBox([self.command, self.send_btn]),
            W.HBox([*self.buttons, self.all_btn, self.close_btn]),
            self.status, self.pane_rank, self.pane,
        ])
        self.ranks.observe(self._ranks_chosen, names="value")
        self.pane_rank.observe(self._pane_chosen, names="value")
        self.box.add_class("monarch-debugger")
        for s in reg.paused():
            self.texts[s.rank] = s.output
        reg.listeners.append(self._changed)
        _SHOWN.add(self)
        self._render()

    def show(self):
        return self.box

    def display(self) -> None:
        """Show the widget under the running cell (it becomes text when closed)."""
        from monarch_kernel.jupyter.transient import TransientWidget

        self.shown = TransientWidget(self.box, "mesh debugger (a widget: shown while the kernel runs)")

    def _ipython_display_(self):
        self.display()

    def _ranks_chosen(self, change) -> None:
        chosen = [r for r in change["new"] if r in self.texts]
        if chosen and self.pane_for != chosen[0]:
            self.pane_for = chosen[0]
            self._render()

    def _pane_chosen(self, change) -> None:
        if change["new"] is not None and change["new"] != self.pane_for:
            self.pane_for = change["new"]
            self._render()

    # ---------------------------------------------------------------- actions (kernel main thread)
    def selected(self) -> list[PausedSession]:
        paused = {s.rank: s for s in self.reg.paused()}
        chosen = [paused[r] for r in self.ranks.value if r in paused]
        if chosen:
            return chosen
        if self.ranks.value:
            raise DebugError(f"the selected {rank_ranges(self.ranks.value)} "
                             f"{'are' if len(self.ranks.value) > 1 else 'is'} no longer paused")
        if len(paused) == 1:
            return list(paused.values())
        if not paused:
            raise DebugError("no rank is paused in the debugger")
        raise DebugError(f"{len(paused)} ranks are paused: select one or more in the list first")

    def send(self, line: str, clear: bool = True) -> None:
        line = (line or "").strip()
        try:
            if not line:
                raise DebugError("type a pdb command first (e.g. `p x`, `next`, `where`)")
            targets = self.selected()
            for s in targets:
                self.reg.send(s, line)
            self._say(f"sent <code>{html.escape(line)}</code> to {rank_ranges(s.rank for s in targets)}")
            if clear:
                self.command.value = ""
        except DebugError as e:
            self._say(html.escape(str(e)), error=True)

    def continue_all(self) -> None:
        targets = self.reg.continue_all()
        if targets:
            self._say(f"continued {rank_ranges(s.rank for s in targets)}")
        else:
            self._say("no rank is paused in the debugger", error=True)

    def close(self, summary: str | None = None) -> None:
        """The close button (the text console takes over), or the end of the cell the
        widget was opened under (``summary``: the line that replaces it)."""
        if summary is None:
            WidgetMode.on = False
        self.open = False
        with self._due_lock:
            if self._due is not None:
                self._due.cancel()
                self._due = None
        if self._changed in self.reg.listeners:
            self.reg.listeners.remove(self._changed)
        if self.shown is not None:
            self.shown.settle(summary or "mesh debugger closed: the cell is the debugger console now "
                              "(`%mesh debug` brings the widget back)")
        self.box.close()

    def _say(self, text: str, error: bool = False) -> None:
        color = "#b00020" if error else "#555"
        self.status.value = f'<span class="monarch-debugger-status" style="color:{color}">{text}</span>'

    # ---------------------------------------------------------------- registry events (any thread)
    def _changed(self, event: str, s: PausedSession | None) -> None:
        if not self.open:
            return
        if s is not None:
            self.texts[s.rank] = s.output
        self._render_soon()

    def _render_soon(self) -> None:
        """Redraw now, or once ``RENDER_GAP_S`` has passed since the last redraw (one timer
        for all the events in between)."""
        with self._due_lock:
            if self._due is not None:
                return
            wait = self._last_render + RENDER_GAP_S - time.monotonic()
            if wait > 0:
                self._due = threading.Timer(wait, self._render_due)
                self._due.daemon = True
                self._due.start()
                return
        self._render()

    def _render_due(self) -> None:
        with self._due_lock:
            self._due = None
        if self.open:
            self._render()

    def _render(self) -> None:
        with self._lock:
            self._last_render = time.monotonic()
            paused = self.reg.paused()
            n = len(paused)
            self.title.value = (f"<b>Mesh debugger</b>: {n} rank{'s' if n != 1 else ''} paused"
                                if n else "<b>Mesh debugger</b>: no rank is paused (waiting for breakpoint())")
            self.table.value = _table_html(paused)
            opts = [(f"rank {s.rank}: {s.function}() at {s.where}", s.rank) for s in paused]
            if list(self.ranks.options) != opts:
                keep = tuple(r for r in self.ranks.value if r in {s.rank for s in paused})
                self.ranks.options = opts
                self.ranks.value = keep
            ranks = sorted(self.texts)
            if self.pane_for not in self.texts:
                self.pane_for = ranks[0] if ranks else None
            live = {s.rank for s in paused}
            opts = [(f"rank {r}" + ("" if r in live else " (running)"), r)
                    for r in _pane_choices(ranks, self.ranks.value, self.pane_for)]
            if list(self.pane_rank.options) != opts:
                self.pane_rank.options = opts
            if self.pane_rank.value != self.pane_for:
                self.pane_rank.value = self.pane_for
            rank = self.pane_for
            value = "" if rank is None else _pane_html(rank, self.texts.get(rank, ""))
            if self.pane.value != value:
                self.pane.value = value


def _pane_choices(ranks: list[int], chosen, shown: int | None) -> list[int]:
    """The ranks given a pane button: all of them up to ``PANE_BUTTONS``; past that the one
    shown, the ones chosen in the list, then the first ranks, in rank order."""
    if len(ranks) <= PANE_BUTTONS:
        return ranks
    have = set(ranks)
    picked = dict.fromkeys(r for r in [shown, *chosen] if r in have)
    for r in ranks:
        if len(picked) >= PANE_BUTTONS:
            break
        picked.setdefault(r)
    return sorted(picked)


def _pane_html(rank: int, text: str) -> str:
    """A rank's debugger output; column-reverse makes the scroll box start at its bottom,
    so the newest line is in view without any script."""
    return (f'<div style="max-height:300px;overflow:auto;display:flex;flex-direction:column-reverse">'
            f'<pre class="monarch-debugger-pane" data-rank="{rank}" style="margin:0">'
            f"{html.escape(text[-20000:])}</pre></div>")


def _table_html(paused: list[PausedSession]) -> str:
    if not paused:
        return ""
    body, note = table_rows(paused)
    head = "".join(f"<th style='text-align:left;padding:0 8px'>{h}</th>"
                   for h in ("rank", "in", "where", "function", "state"))
    rows = "".join(
        "<tr class='monarch-debugger-row'>" + "".join(
            f"<td style='text-align:left;padding:0 8px'>{html.escape(v)}</td>" for v in row) + "</tr>"
        for row in body)
    note = f"<div class='monarch-debugger-note' style='color:#555'>{html.escape(note)}</div>" if note else ""
    return f"<table class='monarch-debugger-table'><tr>{head}</tr>{rows}</table>{note}"
