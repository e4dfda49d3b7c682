"""Replies a proc holds back to send several as one signed message (a pipeline's).

While more calls already wait in a proc's work inbox, its main thread keeps the plain-value
replies of quick calls and sends up to HOLD_MAX of them as one ``messages.Replies``: one
signature and one send here, one check and one wake-up at the caller, for the group. The
proc decides what may be held (``Proc._hold_reply``) and when the main thread sends
(inbox dry, HOLD_S, output, another message, a call not known to be quick); this module
keeps them, sends them, and runs the flusher thread that sends them late when the main
thread cannot: a call that was quick last time and is slow now.
"""
from __future__ import annotations

import sys
import threading
import time
import traceback
from typing import Callable

HOLD_S = 0.001     # the main thread holds replies at most this long
HOLD_MAX = 32      # replies in one Replies message at most
LATE_S = 0.005     # the flusher sends replies held this long (the main thread is in a slow call)
PARK_S = 0.05      # the flusher sleeps for good after this long with none held


class HeldReplies:
    def __init__(self, send_plain: Callable, key: bytes, proc_key: str, running: Callable[[], bool]):
        self.items: list = []   # [call_id, ok, value, ...] for ``to``, since ``since`` (perf_counter)
        self.to = ""
        self.since = 0.0
        self._send_plain, self._key, self._proc_key, self._running = send_plain, key, proc_key, running
        self._lock = threading.Lock()   # the main thread holds and sends; the flusher sends
        self._flusher: threading.Thread | None = None
        self._parked = threading.Event()   # set: the flusher sleeps until replies are held again
        self._wake = threading.Event()

    def add(self, reply_to: str, call_id: int, ok: bool, value) -> None:
        """(main thread) Hold one reply (the proc checked it may be held); send the group
        once it has HOLD_MAX."""
        items = self.items
        with self._lock:
            if not items:
                self.to, self.since = reply_to, time.perf_counter()
                if self._flusher is None or self._parked.is_set():
                    self._start_flusher()
            items += (call_id, ok, value)
            full = len(items) >= 3 * HOLD_MAX
        if full:
            self.send()

    def send(self) -> None:
        """Send what is held (main thread; or the flusher, past LATE_S)."""
        items = self.items
        with self._lock:
            if not items:
                return
            if len(items) == 3:   # one: a plain Reply, as if never held
                msg = ("r", items[0], self._proc_key, items[1], items[2])
            else:
                msg = ("rs", self._proc_key, items[:])   # messages.Replies, in field order
            items.clear()
            self._send_plain(self.to, self._key, msg)

    def _start_flusher(self) -> None:
        if self._flusher is None:
            self._flusher = threading.Thread(target=self._flush_late, name="held-replies", daemon=True)
            self._flusher.start()
        else:
            self._parked.clear()
            self._wake.set()

    def _flush_late(self) -> None:
        """(flusher thread) While replies are being held, look every LATE_S and send any
        held longer than that. Parks after PARK_S with none held."""
        items, clock = self.items, time.perf_counter
        idle_since = clock()
        while self._running():
            time.sleep(LATE_S)
            now = clock()
            if items:
                idle_since = now
                if now - self.since >= LATE_S:
                    try:
                        self.send()
                    except Exception:   # noqa: BLE001  (the main thread sends what is left)
                        traceback.print_exc(file=sys.__stderr__)
            elif now - idle_since > PARK_S:
                self._parked.set()
                self._wake.wait()
                self._wake.clear()
                idle_since = clock()
