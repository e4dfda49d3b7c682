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
        self.exhausted = None   # while the tokens come back: the call that ran them out
        self._lock = threading.Lock()

    def admit(self, lines: int, call=None) -> int:
        """How many of ``lines`` lines (the first ones of a message) may go to the controller;
        the rest are counted as kept back. A batch is cut where the tokens run out rather than
        let through whole: a batch of 300 lines let through on the last token put the limit 6 s
        in debt, and the next cell's first line was kept back. ``call``: the call that prints
        (a new one has its lines let through from the tokens there are)."""
        if self.rate <= 0:
            return lines
        with self._lock:
            now = time.monotonic()
            self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now
            if self.exhausted is not None and (self.tokens >= self.resume_at or call != self.exhausted[0]):
                self.exhausted = None
            n = 0 if self.exhausted is not None else min(lines, int(self.tokens))
            if n < lines:
                self.exhausted = (call,)
            self.tokens -= n
            self.skipped += lines - n
            return n

    def take_skipped(self) -> int:
        if not self.skipped:   # the usual case, before every reply: no lock
            return 0
        with self._lock:
            n, self.skipped = self.skipped, 0
            return n


def skipped_text(rank: int, n: int) -> str:
    """What a controller without a notebook prints for it (the number comes first)."""
    return f"{n} lines kept only in rank {rank}'s log (output rate limit): %mesh logs --ranks {rank}\n"
