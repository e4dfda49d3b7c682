"""The debugger widget (ipywidgets): shows the registry, sends commands; no logic of its own.

Live table of paused ranks, a rank selector, a command box, buttons (continue, step,
next, up, down, where, continue all) and an output pane with a button per rank: choosing
ranks in the list shows the first one's pane, which opens scrolled to its newest line.
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
import weakref

import ipywidgets as W

from .registry import DebugError, DebugRegistry, PausedSession

_SHOWN: weakref.WeakSet = weakref.WeakSet()
BUTTONS = (("continue", "continue"), ("step", "step"), ("next", "next"), ("up", "up"), ("down", "down"),
           ("where", "where"))


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
        self.texts: dict[int, str] = {}      # rank -> its pane's text (kept after it resumes)
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
        self.pane_rank.observe(lambda _: self._render(), names="value")
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
        if chosen and self.pane_rank.value != chosen[0]:
            self.pane_rank.value = chosen[0]

    # ---------------------------------------------------------------- actions (kernel main thread)
    def selected(self) -> list[PausedSession]:
        paused = {s.rank: s for s in self.reg.paused()}
        chosen = [paused[r] for r in self.ranks.value if r in paused]
        if chosen:
            return chosen
        if self.ranks.value:
            raise DebugError(f"the selected rank{'s' if len(self.ranks.value) > 1 else ''} "
                             f"{', '.join(map(str, self.ranks.value))} no longer paused")
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
            self._say(f"sent <code>{html.escape(line)}</code> to rank{'s' if len(targets) > 1 else ''} "
                      f"{', '.join(str(s.rank) for s in targets)}")
            if clear:
                self.command.value = ""
        except DebugError as e:
            self._say(html.escape(str(e)), error=True)

    def continue_all(self) -> None:
        targets = self.reg.continue_all()
        if targets:
            self._say(f"continued rank{'s' if len(targets) > 1 else ''} {', '.join(str(s.rank) for s in targets)}")
        else:
            self._say("no rank is paused in the debugger", error=True)

    def close(self, summary: str | None = None) -> None:
        """The close button (the text console takes over), or the end of the cell the
        widget was opened under (``summary``: the line that replaces it)."""
        if summary is None:
            WidgetMode.on = False
        self.open = False
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
        self._render()

    def _render(self) -> None:
        with self._lock:
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
            live = {s.rank for s in paused}
            opts = [(f"rank {r}" + ("" if r in live else " (running)"), r) for r in ranks]
            if list(self.pane_rank.options) != opts:
                keep = self.pane_rank.value if self.pane_rank.value in self.texts else None
                self.pane_rank.options = opts
                self.pane_rank.value = keep if keep is not None else (ranks[0] if ranks else None)
            rank = self.pane_rank.value
            value = "" if rank is None else _pane_html(rank, self.texts.get(rank, ""))
            if self.pane.value != value:
                self.pane.value = value


def _pane_html(rank: int, text: str) -> str:
    """A rank's debugger output; column-reverse makes the scroll box start at its bottom,
    so the newest line is in view without any script."""
    return (f'<div style="max-height:300px;overflow:auto;display:flex;flex-direction:column-reverse">'
            f'<pre class="monarch-debugger-pane" data-rank="{rank}" style="margin:0">'
            f"{html.escape(text[-20000:])}</pre></div>")


def _table_html(paused: list[PausedSession]) -> str:
    if not paused:
        return ""
    head = "".join(f"<th style='text-align:left;padding:0 8px'>{h}</th>"
                   for h in ("rank", "in", "where", "function", "state"))
    rows = "".join(
        "<tr class='monarch-debugger-row'>" + "".join(
            f"<td style='text-align:left;padding:0 8px'>{html.escape(str(v))}</td>"
            for v in (s.rank, s.what or "?", s.where, s.function, s.state)) + "</tr>"
        for s in paused)
    return f"<table class='monarch-debugger-table'><tr>{head}</tr>{rows}</table>"
