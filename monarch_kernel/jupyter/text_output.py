"""Text output of one cell from many ranks: merged, grouped, filtered, and bounded.

256 ranks printing ``epoch 1 loss 0.12`` should read as one line,
``[ranks 0-255] epoch 1 loss 0.12``, and 256 ranks printing 10,000 lines each must neither
freeze the front-end nor grow the kernel. This module decides what text a cell writes;
``output.CellCapture`` feeds it and writes what it returns.

``--group-outputs`` (ipyparallel's option, our names):
  * ``merged`` (default): identical lines (same stream, same text) from several ranks are
    written once, labelled with their ranks. Held output (a cell that ends within the hold)
    is merged over the whole cell; live output over a short window (``MONARCH_KERNEL_MERGE_WINDOW_S``).
  * ``rank``: each rank's output together, rank 0 first (ipyparallel's ``engine``).
  * ``order``: collated: every rank's first output, then every rank's second... (as
    ipyparallel's ``order``).
  Live output of ``rank`` and ``order`` is written as it arrives, each line labelled.

Bounds (read when a cell starts; monarch_kernel/config.py, with the MONARCH_KERNEL_ prefix).
Memory: at most ``OUTPUT_HELD`` lines are kept (held, or in the merge window); lines
past that are only counted, per rank. Front-end: what is written is a token bucket of
``OUTPUT_RATE`` lines a second with bursts of ``OUTPUT_BURST``, and at most ``OUTPUT_LINES`` lines a cell
(a merged line counts once). Lines not written are counted per rank and the cell says
where they are: every line a proc prints is also in its log on its host
(telemetry/logs.py), which ``%mesh logs R`` reads. A proc also limits what it
sends (monarch_kernel/node/output_limit.py) and reports the lines it kept back; they are counted here.
"""
from __future__ import annotations

import collections
import time
from collections.abc import Iterable

from monarch_kernel import config

from .display import rank_ranges

MODES = ("merged", "rank", "order")
SKIPPED = "skipped"   # node/output_limit.py: a proc's count of lines it kept back
MODE_ALIASES = {"engine": "rank"}   # ipyparallel's name for grouping by rank



Line = tuple[int, str, str]   # (rank, stream, text without its newline)


class OutputOptions:
    """What ``%%on_mesh`` asked for: the grouping and which ranks' output to show."""

    def __init__(self, mode: str = "merged", show: Iterable[int] | None = None,
                 quiet: Iterable[int] | None = None, show_spec: str = "", quiet_spec: str = ""):
        mode = MODE_ALIASES.get(mode, mode)
        if mode not in MODES:
            raise ValueError(f"--group-outputs {mode!r}: use one of {', '.join(MODES)}")
        self.mode = mode
        self.show = set(show) if show is not None else None
        self.quiet = set(quiet or ())
        self.specs = " ".join(s for s in (f"--show-ranks {show_spec}" if show_spec else "",
                                          f"--quiet-ranks {quiet_spec}" if quiet_spec else "") if s)

    def wants(self, rank: int) -> bool:
        return (self.show is None or rank in self.show) and rank not in self.quiet


class OutputBudget:
    """What may still be written: a token bucket (``OUTPUT_RATE``/s, ``OUTPUT_BURST``) and a
    cell cap (``OUTPUT_LINES``); each defaults to its variable's value now."""

    def __init__(self, rate: float | None = None, burst: int | None = None, max_lines: int | None = None):
        rate = config.OUTPUT_RATE.get() if rate is None else rate
        burst = config.OUTPUT_BURST.get() if burst is None else burst
        max_lines = config.OUTPUT_LINES.get() if max_lines is None else max_lines
        self.rate, self.burst, self.max_lines, self.left = rate, burst, max_lines, max_lines
        self.tokens = float(burst)
        self.stamp = time.monotonic()
        self.limited = False   # some line was refused

    def take(self, n: int) -> int:
        """How many of ``n`` lines may be written now (the rest are refused)."""
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        ok = max(0, min(n, int(self.tokens), self.left))
        self.tokens -= ok
        self.left -= ok
        if ok < n:
            self.limited = True
        return ok


def split_lines(text: str) -> list[str]:
    return text.rstrip("\n").split("\n")


def merge(lines: Iterable[Line]) -> list[tuple[str, str, list[int]]]:
    """``(stream, text, ranks)`` groups, in the order of their first line. A rank's k-th
    copy of a line joins the other ranks' k-th copies, so a rank repeating a line keeps
    both copies."""
    groups: dict[tuple[str, str, int], list[int]] = {}
    seen: collections.Counter = collections.Counter()
    for rank, stream, text in lines:
        k = seen[(rank, stream, text)]
        seen[(rank, stream, text)] = k + 1
        groups.setdefault((stream, text, k), []).append(rank)
    return [(stream, text, ranks) for (stream, text, _), ranks in groups.items()]


def collate(items: Iterable[tuple[int, object]]) -> list[tuple[int, object]]:
    """``order``: every rank's first item (rank order), then every rank's second, ..."""
    by_rank: dict[int, list] = {}
    for rank, item in items:
        by_rank.setdefault(rank, []).append(item)
    out = []
    ranks = sorted(by_rank)
    for i in range(max((len(v) for v in by_rank.values()), default=0)):
        out += [(r, by_rank[r][i]) for r in ranks if i < len(by_rank[r])]
    return out


def label(ranks: list[int], text: str) -> str:
    return f"[{rank_ranges(ranks)}] {text}\n"


class TextLimits:
    """The bounded part of a cell's text output: the merge window and what was not shown."""

    def __init__(self, options: OutputOptions):
        self.options = options
        self.budget = OutputBudget()
        self.max_held = config.OUTPUT_HELD.get()
        self.merge_window_s = config.MERGE_WINDOW_S.get()
        self.held_lines = 0
        self.window: list[Line] = []
        self.window_started = 0.0
        self.dropped: collections.Counter = collections.Counter()   # rank -> lines not written
        self.hidden: collections.Counter = collections.Counter()    # rank -> outputs filtered out
        self.warned = False

    def admit_held(self, rank: int, n: int) -> bool:
        """Room to keep ``n`` more lines? (else they are counted as not shown)"""
        if self.held_lines + n > self.max_held:
            self.dropped[rank] += n
            return False
        self.held_lines += n
        return True

    def writable(self, groups: list[tuple[str, str, list[int]]]) -> list[tuple[str, str, list[int]]]:
        """The groups the budget lets through now; the others are counted as not shown."""
        ok = self.budget.take(len(groups))
        for _, _, ranks in groups[ok:]:
            for r in ranks:
                self.dropped[r] += 1
        return groups[:ok]

    # ------------------------------------------------------------------ live, merged
    def add_to_window(self, rank: int, stream: str, text: str) -> None:
        lines = split_lines(text)
        if not self.window:
            self.window_started = time.monotonic()
        if len(self.window) + len(lines) > self.max_held:
            self.dropped[rank] += len(lines)
            return
        self.window += [(rank, stream, t) for t in lines]

    def window_due(self, now: float | None = None) -> bool:
        return bool(self.window) and (now or time.monotonic()) - self.window_started >= self.merge_window_s

    def take_window(self) -> list[tuple[str, str, list[int]]]:
        lines, self.window = self.window, []
        lines.sort(key=lambda ln: ln[0])   # rank order; stable, so each rank's order is kept
        return self.writable(merge(lines))

    # ------------------------------------------------------------------ what the cell says
    def first_limit_notice(self) -> str:
        """Once per cell, when lines start being refused while it runs."""
        if self.warned or not self.dropped:
            return ""
        self.warned = True
        return (f"[monarch_kernel] more output than the notebook can show (over {self.budget.rate:g} lines/s or "
                f"{self.budget.max_lines} lines a cell): some lines are kept only in the ranks' logs "
                "(`%mesh logs R`); a count follows when the cell ends\n")

    def closing_notes(self) -> str:
        notes = []
        if self.dropped:
            ranks = sorted(self.dropped)
            n = sum(self.dropped.values())
            b = self.budget
            notes.append(f"[monarch_kernel] {n:,} lines from {rank_ranges(ranks)} not shown here (output "
                         f"limits: {b.rate:g} lines/s and {b.max_lines} a cell in the notebook, and each proc's "
                         f"own); every line is in its rank's log: `%mesh logs {ranks[0]} --tail 100`\n")
        if self.hidden:
            ranks = sorted(self.hidden)
            notes.append(f"[monarch_kernel] output of {rank_ranges(ranks)} not shown ({self.options.specs}); "
                         f"`%mesh logs {ranks[0]}` shows it\n")
        return "".join(notes)
