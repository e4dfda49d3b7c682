"""The text debugger console: the waiting cell (or script) becomes pdb for the paused ranks.

It opens on the controller's main thread when a rank pauses while that thread waits on
the mesh: inside ``Future.get`` (``Runtime.wait_hook``) or on an ``%%on_mesh`` cell's
wait tick (``jupyter.on_mesh.WAIT_HOOKS``). It reads lines with ``input()``, which in a
notebook is the kernel's stdin channel (an input box), in a script the terminal.

Console grammar (anything else goes to the rank in front as a pdb command)::

    rank N            switch to paused rank N
    ranks             list the paused ranks
    cast RANKS CMD    send CMD to several ranks (Monarch grammar: ranks(1,3), 0:4:2, gpus=1:3)
    continue all      continue every paused rank (also: c all)
    detach            leave the console; ranks stay paused (%mesh debug attach N comes back)

When the rank in front continues, the console moves on to the next paused rank and
closes when none is left. An interrupt (KeyboardInterrupt) interrupts every paused rank:
none is left paused.

At hundreds of ranks (a ``breakpoint()`` in a cell on every rank) what the ranks say alike
is said once: ranks paused at the same place are one line (``debugger: ranks 0-255 paused
at ...``), the same output from several ranks is shown once with their ranks, as a cell's
output is, and the console waits for a burst of pauses to settle (``SETTLE_S``) before it
speaks.
"""
from __future__ import annotations

import re
import signal
import sys
import threading
import time
from collections.abc import Callable

from ..core.mesh_tables import RANKS_CHARS, alike, ranges, rank_ranges
from .registry import DebugError, DebugRegistry, PausedSession, table_rows

HELP = ("debugger: pdb commands go to the rank in front; `rank N` switches, `ranks` lists, "
        "`cast RANKS CMD` sends to several, `continue all` resumes all, `detach` leaves them paused")


SETTLE_S = 0.1             # the console speaks once no rank has paused for this long ...
SETTLE_PER_RANK_S = 0.002  # ... longer while ranks of the cell are still on their way ...
SETTLE_MAX_S = 1.0         # ... or after this, however many still pause


class NoStdin(Exception):
    """The front-end cannot answer input requests (e.g. allow_stdin off)."""


class Console:
    def __init__(self, reg: DebugRegistry):
        self.reg = reg
        self.active = False
        self.seen_pauses = 0    # pauses up to this count need no console (detached / widget)
        self.read: Callable[[str], str] = _read_line
        self.write: Callable[[str], None] = _write

    def wanted(self) -> bool:
        reg = self.reg
        return (not self.active and not reg.quiet and bool(reg.sessions)
                and reg.pauses > self.seen_pauses)

    # ---------------------------------------------------------------- the loop
    def run(self, rank: int | None = None, on_interrupt: Callable[[], None] | None = None,
            running: Callable[[], int] | None = None) -> None:
        """Drive paused ranks until none is paused (or ``detach``). ``on_interrupt``: called
        on KeyboardInterrupt instead of re-raising it (after the ranks were interrupted);
        ``running``: how many ranks of the waiting cell have not answered (paused or not)."""
        if self.active:
            return
        self.active = True
        reg = self.reg
        # An awaited cell turns SIGINT into a task cancel that cannot run while input()
        # blocks the loop: make it a KeyboardInterrupt here while the console runs.
        old_sigint = _sigint_raises()
        try:
            current = reg.by_rank(rank) if rank is not None else None
            announced: set[str] = set()
            first = True
            while True:
                sessions = reg.paused()
                if not sessions:
                    if not first:
                        self.write("debugger: no rank is paused any more\n")
                    return
                if first:
                    self._settle(running)
                    sessions = reg.paused() or sessions
                if current is None or current.key not in reg.sessions:
                    prev = current
                    current = _next_after(sessions, prev)
                    if prev is not None:
                        self.write(f"debugger: rank {prev.rank} continued; now at rank {current.rank}\n")
                self._announce(sessions, announced, current, first)
                first = False
                self._show_output(current, sessions)
                if current.state != "prompt":
                    reg.wait(lambda c=current: c.state == "prompt" or c.key not in reg.sessions
                             or any(s.unread for s in reg.sessions.values()), 0.2)
                    continue
                try:
                    line = self.read(f"(rank {current.rank} pdb) ")
                except NoStdin:
                    self._no_stdin()
                    return
                out = self._handle(line.strip(), current)
                if out == "detach":
                    self.write("debugger: detached; the paused ranks stay paused "
                               "(`%mesh debug attach RANK` to come back)\n")
                    return
                if isinstance(out, PausedSession):
                    current = out
        except KeyboardInterrupt:
            reg.interrupt_all()
            self.write("debugger: interrupted; every paused rank was interrupted\n")
            if on_interrupt is None:
                raise
            on_interrupt()
        finally:
            self.seen_pauses = reg.pauses
            self.active = False
            if old_sigint is not None:
                signal.signal(signal.SIGINT, old_sigint)

    def _handle(self, line: str, current: PausedSession):
        reg = self.reg
        try:
            m = re.fullmatch(r"rank\s+(\S+)", line)
            if m:
                if not re.fullmatch(r"-?\d+", m.group(1)):
                    raise DebugError(f"`rank {m.group(1)}`: give a rank number, e.g. `rank 1`")
                return reg.select(m.group(1))[0]
            if line in ("ranks", "rank"):
                self.write(table(reg.paused()) + "\n")
                return None
            if line in ("continue all", "c all", "cont all"):
                targets = reg.continue_all()
                self._wait_for(targets)
                return None
            if line == "detach":
                return "detach"
            if line == "cast" or line.startswith("cast "):
                spec, cmd = split_cast(line[4:].strip())
                targets = reg.cast(spec, cmd)
                self._wait_for(targets)
                return None
            if line == "help debugger":
                self.write(HELP + "\n")
                return None
            reg.send(current, line)
            self._wait_for([current])
        except DebugError as e:
            self.write(f"debugger: {e}\n")
        return None

    def _wait_for(self, targets: list[PausedSession], label: bool | None = None) -> None:
        """Until each target prompts again or leaves the debugger, showing their output."""
        reg = self.reg
        label = len(targets) > 1 if label is None else label

        def done():
            return all(s.answered for s in targets)

        # One rank's output is shown as it comes; several ranks' when all have answered (or
        # every 0.5 s while some have not), so that what they said alike is said once.
        ready = done if label else (lambda: done() or any(s.unread for s in targets))
        while True:
            finished = reg.wait(ready, 0.5)
            # Decide before flushing: a rank's output precedes its prompt, so once it has
            # answered, this flush shows all of it, labelled as this wait labels it.
            finished = finished and done()
            self._flush(targets, label=label)
            if finished and done():
                return

    def _wait_for_quietly(self, targets: list[PausedSession]) -> None:
        """For ``%mesh debug cast/continue``: the same wait, output labelled by rank, and
        without opening the console for ranks that pause meanwhile."""
        self.reg.quiet += 1
        try:
            self._wait_for(targets, label=True)
        finally:
            self.reg.quiet -= 1

    # ---------------------------------------------------------------- output
    def _settle(self, running: Callable[[], int] | None) -> None:
        """Wait until the ranks that pause together have paused, so that they are announced
        together: until every rank of the cell still running is paused, or none has paused
        for ``SETTLE_S`` plus ``SETTLE_PER_RANK_S`` for each still on its way (on a small
        machine the controller waits for a CPU behind them), ``SETTLE_MAX_S`` at most."""
        reg, end = self.reg, time.monotonic() + SETTLE_MAX_S
        while True:
            seen = reg.pauses
            on_way = on_their_way(reg, running()) if running is not None else 0
            left = end - time.monotonic()
            if (running is not None and on_way == 0) or left <= 0:
                return
            if not reg.wait(lambda seen=seen: reg.pauses != seen, min(left, settle_gap(on_way))):
                return

    def _announce(self, sessions, announced: set, current: PausedSession, first: bool) -> None:
        new = [s for s in sessions if s.key not in announced and s.prompts]
        if not new:
            return
        announced.update(s.key for s in new)
        self.write("".join(f"{line}\n" for line in paused_lines(new)))
        if first:
            self.write(HELP + "\n")
        if len(sessions) > 1:
            self.write(f"debugger: {len(sessions)} ranks paused ({ranges((s.rank for s in sessions), RANKS_CHARS)}); "
                       f"commands go to rank {current.rank}\n")

    def _show_output(self, current: PausedSession, sessions) -> None:
        self._flush([current], label=False)
        self._flush([s for s in sessions if s is not current], label=True)

    def _flush(self, sessions: list[PausedSession], label: bool) -> None:
        """Write what ``sessions`` said since the last flush; ``label``: each line with its
        ranks, and what several ranks said alike once (``[ranks 0-255] -> breakpoint()``)."""
        with self.reg.cond:
            said = []
            for s in sessions:
                chunks, s.unread = s.unread, []
                if chunks:
                    said.append((s.rank, "".join(chunks)))
        if not label:
            self.write("".join(text for _, text in said))
            return
        for ranks, text in alike(said):
            who = f"[{rank_ranges(ranks, RANKS_CHARS)}] "
            self.write("".join(f"{who}{ln}\n" for ln in text.rstrip("\n").split("\n")))

    def _no_stdin(self) -> None:
        """No input box: continue the ranks so the cell can finish, and say why."""
        targets = self.reg.continue_all()
        self.write(f"debugger: {rank_ranges(s.rank for s in targets)} paused in breakpoint(), but this "
                   "front-end cannot answer input requests (allow_stdin is off); they were continued. Show "
                   "`%mesh debug` (the widget) before running the cell, or use a front-end with input boxes\n")


def _next_after(sessions: list[PausedSession], prev: PausedSession | None) -> PausedSession:
    if prev is not None:
        for s in sessions:
            if s.rank > prev.rank:
                return s
    return sessions[0]


def split_cast(rest: str) -> tuple[str, str]:
    """``ranks(1,3) p x`` -> (``ranks(1,3)``, ``p x``); ``0:4:2 next`` -> (``0:4:2``, ``next``)."""
    if rest.startswith("ranks("):
        end = rest.find(")")
        if end < 0:
            raise DebugError(f"cast {rest!r}: unclosed ranks(...); write e.g. `cast ranks(1,3) p x`")
        spec, cmd = rest[:end + 1], rest[end + 1:].strip()
    else:
        spec, _, cmd = rest.partition(" ")
        cmd = cmd.strip()
    if not spec or not cmd:
        raise DebugError("cast needs ranks and a command, e.g. `cast ranks(1,3) p x` or `cast 0:4:2 next`")
    return spec, cmd


def table(sessions: list[PausedSession]) -> str:
    if not sessions:
        return "no rank is paused in the debugger"
    body, note = table_rows(sessions)
    rows = [["rank", "in", "where", "function", "state"], *body]
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    text = "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)
    return f"{text}\n({note})" if note else text


def on_their_way(reg: DebugRegistry, running: int) -> int:
    """Of ``running`` ranks of a cell that have not answered, those not paused (yet)."""
    return max(0, running - sum(1 for s in list(reg.sessions.values()) if s.prompts))


def settle_gap(on_way: int) -> float:
    """How long no new pause means a burst of pauses is over, with ``on_way`` ranks still
    running (on a small machine the controller waits for a CPU behind them)."""
    return SETTLE_S + SETTLE_PER_RANK_S * on_way


def paused_lines(sessions: list[PausedSession], then: Callable[[list[int]], str] = lambda ranks: "") -> list[str]:
    """'debugger: ranks 0-255 paused at <In [2] on mesh>:3 in <module>() (cell)', a line for
    each place where ``sessions`` paused, ``then(ranks)`` after it."""
    return [f"debugger: {rank_ranges(ranks, RANKS_CHARS)} paused at {place}{then(ranks)}"
            for ranks, place in alike((s.rank, s.place) for s in sessions)]


def _sigint_raises():
    """On the main thread: SIGINT raises KeyboardInterrupt; returns the handler it replaced."""
    if threading.current_thread() is not threading.main_thread():
        return None
    try:
        return signal.signal(signal.SIGINT, signal.default_int_handler)
    except ValueError:
        return None


def _read_line(prompt: str) -> str:
    try:
        return input(prompt)
    except EOFError:
        return "continue"
    except Exception as e:
        if type(e).__name__ == "StdinNotImplementedError":
            raise NoStdin() from None
        raise


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


_CONSOLE: Console | None = None


def console() -> Console:
    from .registry import registry

    reg = registry()
    global _CONSOLE
    if _CONSOLE is None or _CONSOLE.reg is not reg:
        _CONSOLE = Console(reg)
    return _CONSOLE


def install_console(reg: DebugRegistry) -> None:
    """The main thread opens the console when a rank pauses while it waits in get()."""
    global _CONSOLE
    _CONSOLE = Console(reg)
    main = threading.main_thread().ident

    def hook():
        c = _CONSOLE
        if c is not None and c.reg is reg and c.wanted():
            c.run()   # even with the widget shown: a thread blocked in get() cannot serve it

    reg.rt.set_wait_hook((main, hook))
