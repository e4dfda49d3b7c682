"""The debugger widget (ipywidgets): shows the registry, sends commands; no logic of its own.

Live table of paused ranks, a rank selector, a command box, buttons (continue, step,
next, up, down, where, continue all) and one output pane per rank. The registry calls
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


def widget_shown() -> bool:
    """Is a debugger widget shown (and not closed) in this kernel?"""
    return any(w.open for w in list(_SHOWN))


class DebuggerWidget:
    def __init__(self, reg: DebugRegistry):
        self.reg = reg
        self.open = True
        self._lock = threading.RLock()
        self.texts: dict[int, str] = {}      # rank -> its pane's text (kept after it resumes)
        self.panes: dict[int, W.HTML] = {}
        self.title = W.HTML()
        self.table = W.HTML()
        self.ranks = W.SelectMultiple(options=[], rows=4, description="ranks",
                                      layout=W.Layout(width="420px"))
        self.command = W.Text(placeholder="pdb command for the selected ranks, e.g. p x",
                              description="command", continuous_update=False, layout=W.Layout(width="420px"))
        self.send_btn = W.Button(description="send", button_style="primary")
        self.buttons = [W.Button(description=label, tooltip=f"{cmd} on the selected ranks")
                        for label, cmd in BUTTONS]
        self.all_btn = W.Button(description="continue all", button_style="warning")
        self.close_btn = W.Button(description="close", tooltip="close the widget (the cell becomes the console)")
        self.status = W.HTML()
        self.tabs = W.Tab()
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
            self.status, self.tabs,
        ])
        self.box.add_class("monarch-debugger")
        for s in reg.paused():
            self.texts[s.rank] = s.output
        reg.listeners.append(self._changed)
        _SHOWN.add(self)
        self._render()

    def show(self):
        return self.box

    def _ipython_display_(self):
        from IPython.display import display

        display(self.box)

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

    def close(self) -> None:
        self.open = False
        if self._changed in self.reg.listeners:
            self.reg.listeners.remove(self._changed)
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
            for rank, text in sorted(self.texts.items()):
                pane = self.panes.get(rank)
                value = f'<pre class="monarch-debugger-pane" style="max-height:300px;overflow:auto">' \
                        f"{html.escape(text[-20000:])}</pre>"
                if pane is None:
                    pane = self.panes[rank] = W.HTML(value)
                elif pane.value != value:
                    pane.value = value
            ranks = sorted(self.panes)
            children = tuple(self.panes[r] for r in ranks)
            if self.tabs.children != children:
                self.tabs.children = children
            live = {s.rank for s in paused}
            titles = tuple(f"rank {r}" + ("" if r in live else " (running)") for r in ranks)
            if tuple(self.tabs.titles) != titles:
                self.tabs.titles = titles


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
