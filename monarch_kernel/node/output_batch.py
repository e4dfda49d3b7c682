"""A proc's printed lines, sent in batches while they come fast.

A line printed after a quiet spell goes at once, as before. Lines printed within
``MONARCH_KERNEL_OUTPUT_BATCH_MS`` (default 20) of the last ones sent wait, and go
together when that time is up (a timer thread) or sooner with the call's reply (the reply
flushes first, so output still always arrives before the result it belongs to). Sent one
message a line, 256 procs printing 10,000 lines each made ~1 million messages for their
agent to forward: the flood took 73 s on 2 cores, most of it the agent's, and a proc
spent ~30 us of CPU a line (a message, a pickle, a send, a flushed write to its log).
ipykernel batches a kernel's own output the same way (every 0.2 s).

Only a call fanned through the agent batches: its output and its reply travel on the fan
link, one socket that every thread of the proc sends on under a lock, so the timer thread's
batch keeps its place. A direct call's output goes on the writing thread's own ZeroMQ socket,
as its reply does: lines sent by another thread could be read after later ones (a receiver
takes turns between sockets), so there each line goes at once, as before (fewer than
``MONARCH_KERNEL_FANOUT_MIN`` ranks: a flood there is within what the controller takes).

Both streams of a proc share one batch, so lines keep their order across stdout and
stderr: when the other stream writes a line, the waiting lines go first. The lock is held
while lines are sent, so the timer's send and the reply's flush cannot overtake each other.
"""
from __future__ import annotations

import os
import threading
import time

from monarch_kernel import config


class OutputBatch:
    def __init__(self, send, current_call=lambda: None, batchable=lambda call: True,
                 interval_s: float | None = None):
        self.send = send   # (stream name, text of whole lines, the call that printed them) -> None
        self.current_call = current_call
        self.batchable = batchable   # may this call's lines wait? (is their way one any thread may send on)
        self.interval = config.OUTPUT_BATCH_MS.get() / 1e3 if interval_s is None else interval_s
        self.lock = threading.RLock()
        self.sent_at = 0.0
        self.waiting = None   # the stream whose whole lines wait for the timer
        # Output not sent yet: text in a stream's buffer (whole lines or not), or a batch the
        # timer is sending. A reply flushes first when it is set: one look on a call's way out.
        self.pending = False
        self.streams: list = []   # both streams of the proc (they add themselves)
        self.call = None      # the call that printed them: their output goes its way (a
        # call fanned through the agent: up through the agent, before its reply), even when
        # the timer sends them after the call returned and before its reply went
        self._wake = threading.Event()
        self._timer: threading.Thread | None = None
        os.register_at_fork(after_in_child=self._forked)

    def _forked(self) -> None:
        """A child of user code's fork starts with a free lock and no timer thread."""
        self.lock, self._wake, self._timer = threading.RLock(), threading.Event(), None
        self.waiting = self.call = None
        self.pending = False

    def lines(self, stream) -> None:
        """``stream`` (under ``self.lock``) has whole lines in its buffer: send them now, or
        let them wait for the timer."""
        if self.waiting is stream:
            return   # more of the lines that wait: the timer sends them all (a flood's way)
        if self.waiting is not None:
            self._send(self.waiting)   # the other stream's lines were written first
        now = time.monotonic()
        call = self.current_call()
        self.call = call
        if self.interval <= 0 or now - self.sent_at >= self.interval or not self.batchable(call):
            self._send(stream)
            self.sent_at = now
            return
        self.waiting = stream
        if self._timer is None:
            self._timer = threading.Thread(target=self._run, name="monarch-output-batch", daemon=True)
            self._timer.start()
        self._wake.set()

    def flush(self) -> None:
        """Send what waits (before the other stream's text, or a reply)."""
        with self.lock:
            if self.waiting is not None:
                self._send(self.waiting)

    def _send(self, stream) -> None:
        self.waiting = None
        text = stream.take_lines()
        try:
            if text:
                self.send(stream.name, text, self.call)
        finally:
            self.settle()   # (only once sent: a reply that saw it set waits on the lock)

    def settle(self) -> None:
        """After a send: is anything left unsent? (under the lock)"""
        self.pending = self.waiting is not None or any(s.holds_text() for s in self.streams)

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            delay = self.sent_at + self.interval - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            with self.lock:
                if self.waiting is not None:
                    self._send(self.waiting)
                    self.sent_at = time.monotonic()
