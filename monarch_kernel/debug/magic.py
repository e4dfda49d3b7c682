"""``%mesh debug``: the debugger widget, and its text commands for use outside a running cell.

    %mesh debug                       the widget: paused ranks, command box, panes, buttons
    %mesh debug console               back to the text console in the running cell
    %mesh debug list                  the paused ranks (also those paused while detached)
    %mesh debug attach RANK           the text console on RANK (until none is paused, or detach)
    %mesh debug cast RANKS CMD ...    one pdb command to several ranks (ranks(1,3), 0:4:2, gpus=1:3)
    %mesh debug continue [RANKS]      continue the paused ranks (all by default)
    %mesh debug --post-mortem on|off  a rank that raises stops in the debugger at the raise
    %mesh debug dap RANK|off          JupyterLab's debugger panel drives RANK (dap.py), or the kernel

Imported by ``%mesh`` (``OPTIONAL_COMMANDS``) when the extension loads, which also hooks the
console into ``%%on_mesh`` waits (``jupyter.on_mesh.WAIT_HOOKS``): when a rank pauses while
a cell runs, the cell becomes the console, unless ``%mesh debug`` turned the widget on:
then a widget opens under that cell and drives the ranks (the kernel keeps handling its
messages while the awaited ``%%on_mesh`` cell runs); when the cell ends the widget becomes
a line of text (jupyter/transient.py), so a saved notebook holds no dead widget.
"""
from __future__ import annotations

import argparse
import sys
import time

from monarch_kernel.core.mesh import view_of
from monarch_kernel.jupyter import on_mesh
from monarch_kernel.jupyter.magics import mesh_command, mesh_parser

from ..core.mesh_tables import rank_ranges
from .console import SETTLE_MAX_S, console, on_their_way, paused_lines, settle_gap, table
from .registry import DebugError, registry

ACTIONS = ("list", "attach", "cast", "continue", "dap", "console")

parser = mesh_parser(
    "debug", "ranks paused in breakpoint(): the debugger widget, or list / attach / cast / continue",
    usage="%mesh debug [list | attach RANK | cast RANKS CMD | continue [RANKS] | dap [RANK|off] | console] "
          "[--post-mortem on|off]")
parser.add_argument("action", nargs="?", choices=ACTIONS, metavar="ACTION",
                    help="list, attach RANK, cast RANKS CMD, continue [RANKS], dap RANK|off, console; "
                         "none: the widget")
parser.add_argument("rest", nargs=argparse.REMAINDER, metavar="ARGS")
parser.add_argument("--post-mortem", choices=("on", "off"),
                    help="on: a rank whose cell or endpoint raises stops in the debugger at the raise")


def _view():
    from monarch_kernel.jupyter.session import session

    s = session()
    return view_of(s.procs) if s.procs is not None else None


@mesh_command(parser)
def debug(ctx, args):
    reg = registry()
    if args.post_mortem is not None:
        procs, _ = ctx.require()
        reg.set_post_mortem(procs, args.post_mortem == "on")
        print(f"post-mortem debugging is {args.post_mortem} on {len(procs)} ranks"
              + (": a rank that raises stops in the debugger" if args.post_mortem == "on" else ""))
        if args.action is None:
            return None
    procs = _procs_or_none(ctx)
    if procs is not None:
        reg.refresh(procs)
    try:
        if args.action is None:
            from .widget import DebuggerWidget, WidgetMode

            WidgetMode.on = True
            if reg.paused():   # paused outside a running cell: the widget goes here
                DebuggerWidget(reg).display()
            else:
                print("debugger widget on: it opens under the cell whose ranks pause in breakpoint(), and "
                      "becomes a line of text when that cell ends (`%mesh debug console` for the text console)")
            return None
        if args.action == "console":
            from .widget import WidgetMode

            WidgetMode.on = False
            print("debugger console on: a cell whose ranks pause becomes their pdb console")
        if args.action == "list":
            print(table(reg.paused()))
        elif args.action == "attach":
            if len(args.rest) != 1:
                raise DebugError("attach takes one rank, e.g. `%mesh debug attach 1`")
            spec = args.rest[0]
            target = reg.select(spec)
            if len(target) != 1:
                raise DebugError(f"attach takes one rank; {spec!r} names {len(target)}")
            console().run(rank=target[0].rank)
        elif args.action == "cast":
            if len(args.rest) < 2:
                raise DebugError("cast needs ranks and a command, e.g. `%mesh debug cast ranks(1,3) p x`")
            targets = reg.cast(args.rest[0], " ".join(args.rest[1:]))
            c = console()
            c._wait_for_quietly(targets)
        elif args.action == "dap":
            from .dap import dap_command

            print(dap_command(args.rest))
        elif args.action == "continue":
            if len(args.rest) > 1:
                raise DebugError("continue takes at most one rank spec, e.g. `%mesh debug continue ranks(1,3)`")
            targets = reg.continue_all(args.rest[0] if args.rest else None)
            if not targets:
                print("no rank is paused in the debugger")
            else:
                console()._wait_for_quietly(targets)
                print(f"continued rank{'s' if len(targets) > 1 else ''} "
                      f"{', '.join(str(s.rank) for s in targets)}")
    except DebugError as e:
        raise ValueError(str(e)) from None   # %mesh shows it as a UsageError with the usage
    return None


def _procs_or_none(ctx):
    try:
        return ctx.session.require()[0]
    except Exception:
        return None


def _install_dap() -> None:
    from IPython.core.getipython import get_ipython

    shell = get_ipython()
    if shell is not None and getattr(shell, "kernel", None) is not None:
        from .dap import install

        install(shell)


# ----------------------------------------------------------------------- running %%on_mesh cells
_said: set[str] = set()   # paused sessions the widget mode has named (each once)


def on_mesh_tick(run) -> None:
    """WAIT_HOOKS entry: a rank paused while an ``%%on_mesh`` cell runs."""
    from .widget import DebuggerWidget, WidgetMode, widget_shown

    reg = registry()
    c = console()
    widget = WidgetMode.on or widget_shown()
    if widget and reg.sessions:
        _name_new_pauses(reg, run)
    if not c.wanted():
        return
    if run.capture is not None:
        run.capture.go_live()   # what the ranks printed before they paused comes first
    if widget:
        if WidgetMode.on and getattr(run, "debugger_widget", None) is None:
            sys.stdout.flush()   # the lines naming the paused ranks come before the widget
            run.debugger_widget = DebuggerWidget(reg)
            run.debugger_widget.display()
        c.seen_pauses = reg.pauses
        return
    c.run(on_interrupt=lambda: run.interrupt("interrupted"),
          running=lambda: run.pending.remaining if run.pending is not None else 0)


class _Burst:
    """When the ranks of a burst of pauses have all paused (the console's ``_settle``, for a
    hook polled ~10 times a second rather than a wait): every rank of the cell still running
    has paused, or none has for ``settle_gap``, or SETTLE_MAX_S passed since the first pause
    not named yet. Settled, the next pause starts a new burst."""
    first: float | None = None
    seen = -1
    since = 0.0

    @classmethod
    def settled(cls, reg, run) -> bool:
        now = time.monotonic()
        if reg.pauses != cls.seen:
            cls.seen, cls.since = reg.pauses, now
            cls.first = now if cls.first is None else cls.first
        on_way = on_their_way(reg, run.pending.remaining if run.pending is not None else 0)
        if on_way and now - cls.since < settle_gap(on_way) and now - (cls.first or now) < SETTLE_MAX_S:
            return False
        cls.first = None
        return True


def _name_new_pauses(reg, run) -> None:
    """With the widget, the cell's output names the ranks that paused (once each, those
    paused alike on one line, once their burst has settled) and leaves driving them to the
    widget."""
    _said.intersection_update(reg.sessions)   # a rank paused again is named again
    new = [s for s in reg.paused() if s.key not in _said and s.prompts]
    if not new or not _Burst.settled(reg, run):
        return
    _said.update(s.key for s in new)
    if run.capture is not None:
        run.capture.go_live()
    for line in paused_lines(new, lambda ranks: f"; the debugger widget drives {'it' if len(ranks) == 1 else 'them'}"):
        print(line)


def on_mesh_done(run) -> None:
    """DONE_HOOKS entry: the cell ended; its widget becomes a line of text."""
    w = getattr(run, "debugger_widget", None)
    if w is not None and w.open:
        ranks = sorted(w.texts)
        w.close(summary=f"mesh debugger: drove {rank_ranges(ranks)} in this cell "
                        "(the widget closed when the cell ended)")


if on_mesh_done not in on_mesh.DONE_HOOKS:
    on_mesh.DONE_HOOKS.append(on_mesh_done)
if on_mesh_tick not in on_mesh.WAIT_HOOKS:
    on_mesh.WAIT_HOOKS.append(on_mesh_tick)
_install_dap()
registry().view_fn = _view   # handles "dbg", opens the console in blocking waits from now on
