"""A proc's output rate limit: past it, lines go only to the proc's log on its host.

Every printed line is one message to the controller. 32 ranks printing 10,000 lines each
queue 320,000 messages in the controller's inbox, ahead of its agents' heartbeats: the
controller then declares the host lost (measured here: "silent for 3.2 s") and the cell
fails. So each proc sends at most ``MONARCH_KERNEL_PROC_OUTPUT_RATE`` lines a second
(default 50) after a burst of ``MONARCH_KERNEL_PROC_OUTPUT_BURST`` (default 500); the
lines past it are still written to the proc's log file (telemetry/logs.py, read with
``%mesh logs``), and the proc tells the controller how many it kept back (a ``skipped``
output, before its next line and before the reply of the call that printed them). The
notebook shows far fewer lines than this anyway (jupyter/text_output.py). A rate of 0
turns the limit off. Until issue 11's fan-in batches output per host, this is what keeps a
flood from starving the controller.
"""
from __future__ import annotations

import threading
import time

from monarch_kernel import config

SKIPPED = "skipped"   # the output "stream" that carries a count of lines kept back
FRESH_CALL_LINES = 10   # lines a new call may always send (a cell's first lines after a flood)


class OutputLimit:
    def __init__(self, rate: float | None = None, burst: float | None = None):
        self.rate = config.PROC_OUTPUT_RATE.get() if rate is None else rate
        self.burst = config.PROC_OUTPUT_BURST.get() if burst is None else burst
        self.tokens = self.burst
        self.stamp = time.monotonic()
        self.skipped = 0
        # Once the tokens ran out, lines go again only when a second's worth came back: a
        # flood then sends one message a second a proc, not one a batch (each batch let through
        # on the token it had earned: 50 messages a second a proc, 12,800 for an agent of 256).
        self.resume_at = max(1.0, min(self.burst, self.rate))
        self.exhausted = False
        self.call = None   # the call that printed last
        self._lock = threading.Lock()

    def admit(self, lines: int, call=None) -> int:
        """How many of ``lines`` lines (the first ones of a message) may go to the controller;
        the rest are counted as kept back. A batch is cut where the tokens run out rather than
        let through whole: a batch of 300 lines let through on the last token put the limit 6 s
        in debt, and the next cell's first line was kept back. ``call``: the call that prints;
        a new one's first ``FRESH_CALL_LINES`` lines go whatever a flood before it left."""
        if self.rate <= 0:
            return lines
        with self._lock:
            now = time.monotonic()
            self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now
            fresh = call != self.call
            self.call = call
            if self.exhausted and (fresh or self.tokens >= self.resume_at):
                self.exhausted = False
            n = 0 if self.exhausted else min(lines, max(int(self.tokens), FRESH_CALL_LINES if fresh else 0))
            if n < lines:
                self.exhausted = True
            self.tokens -= n
            self.skipped += lines - n
            return n

    def keep_back(self, lines: int) -> None:
        """Count ``lines`` as kept back whatever the tokens (no controller to send them to)."""
        with self._lock:
            self.skipped += lines

    def take_skipped(self) -> int:
        if not self.skipped:   # the usual case, before every reply: no lock
            return 0
        with self._lock:
            n, self.skipped = self.skipped, 0
            return n


def shortened_lines(text: str, most: int) -> str:
    """``text`` with each line cut to ``most`` characters, for the controller (the proc's log
    keeps every character). A line of progress redrawn with carriage returns (tqdm) is first
    cut to its last drawing, what a terminal would show. One rank printing a 100 MB line
    would otherwise send it whole to the kernel, and 256 ranks would hold 25 GB there."""
    out = []
    for line in text.split("\n"):
        if len(line) > most:
            cr = line.rfind("\r", 0, len(line) - 1)
            if cr >= 0:
                line = line[cr + 1:]
            if len(line) > most:
                # (the same words on every rank: identical long lines still merge)
                line = f"{line[:most]}... [{len(line) - most:,} more characters in the rank's log]"
        out.append(line)
    return "\n".join(out)


def skipped_text(rank: int, n: int) -> str:
    """What a controller without a notebook prints for it (the number comes first)."""
    return f"{n} lines kept only in rank {rank}'s log (output rate limit): %mesh logs {rank}\n"
