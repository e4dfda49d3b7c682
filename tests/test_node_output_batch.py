"""A proc's output batch (node/output_batch.py) with a stream and a sender of our own.

The proc's streams and its reply path use it as here: ``write`` under the batch's lock
(it sets ``pending``), ``pending`` looked at before a reply, ``flush`` (under the lock)
before the reply goes.
"""
from __future__ import annotations

import threading
import time

from monarch_kernel.node.output_batch import OutputBatch


class Stream:
    """The part of ForwardingStream the batch uses."""

    def __init__(self, batch: OutputBatch, name: str = "stdout"):
        self.batch, self.name, self._buf = batch, name, []
        batch.streams.append(self)

    def write(self, s: str) -> None:
        with self.batch.lock:
            self._buf.append(s)
            self.batch.pending = True
            if "\n" in s:
                self.batch.lines(self)

    def holds_text(self) -> bool:
        return bool(self._buf)

    def take_lines(self) -> str:
        text = "".join(self._buf)
        cut = text.rfind("\n") + 1
        self._buf = [text[cut:]] if cut < len(text) else []
        return text[:cut]


def _wait(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.001)


def test_lines_that_come_fast_go_together_and_the_first_goes_at_once():
    sent = []
    batch = OutputBatch(lambda name, text, call: sent.append(text), interval_s=0.05)
    out = Stream(batch)
    out.write("first\n")
    assert sent == ["first\n"]          # after a quiet spell: at once
    for i in range(100):
        out.write(f"line {i}\n")
    assert sent == ["first\n"] and batch.pending
    _wait(lambda: len(sent) == 2)       # the timer: the 100 lines in one message
    assert sent[1] == "".join(f"line {i}\n" for i in range(100))
    assert not batch.pending


def test_a_reply_waits_for_the_batch_the_timer_is_sending():
    """The call returns while the timer thread is sending its batch: the reply must see the
    batch as pending and its flush must come after the timer's send, or that output reaches
    the controller after the reply (at 256 ranks: 432,000 lines missing from the cell)."""
    sent, in_send, release = [], threading.Event(), threading.Event()

    def send(name, text, call):
        if threading.current_thread().name == "monarch-output-batch":
            in_send.set()
            release.wait(5)          # the timer thread, slow to get a CPU back
        sent.append((threading.current_thread().name, text))

    batch = OutputBatch(send, interval_s=0.02)
    out = Stream(batch)
    out.write("a\n")
    out.write("b\n")                 # waits for the timer
    assert in_send.wait(5)
    assert out._buf == [] and batch.pending    # taken from the buffer, not sent yet
    flushed = threading.Event()

    def reply():
        with batch.lock:
            batch.flush()
        flushed.set()
    threading.Thread(target=reply, name="main").start()
    time.sleep(0.05)
    assert not flushed.is_set()      # the reply's flush waits ...
    release.set()
    assert flushed.wait(5)           # ... for the timer's send
    assert [t for _, t in sent] == ["a\n", "b\n"] and not batch.pending


def test_the_other_streams_waiting_lines_go_first():
    sent = []
    batch = OutputBatch(lambda name, text, call: sent.append((name, text)), interval_s=10)
    out, err = Stream(batch, "stdout"), Stream(batch, "stderr")
    out.write("1\n")
    out.write("2\n")
    err.write("3\n")
    out.write("4\n")
    with batch.lock:
        batch.flush()
    assert sent == [("stdout", "1\n"), ("stdout", "2\n"), ("stderr", "3\n"), ("stdout", "4\n")]


def test_a_call_whose_lines_may_not_wait_sends_each_at_once():
    """A direct call's output goes from the writing thread's own socket, as its reply does:
    nothing waits for the timer's thread."""
    sent = []
    batch = OutputBatch(lambda name, text, call: sent.append(text), lambda: ("direct", 1),
                        lambda call: call[0] != "direct", interval_s=10)
    out = Stream(batch)
    for i in range(5):
        out.write(f"{i}\n")
    assert sent == [f"{i}\n" for i in range(5)] and not batch.pending
