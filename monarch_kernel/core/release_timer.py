"""A one-shot timer the I/O thread polls: "take the inbox back in a moment, unless a user
thread wants it again first" (inbox.py ``_unwant``).

Why: a user thread that read the inbox through a long wait (a call to all of 256 procs:
20-45 ms on a 2-core host) used to kick the I/O thread awake as it let go, so what nobody
waits for (output, a callback's reply) was read at once. In a loop of such calls the next
wait starts a fraction of a millisecond later and takes the inbox again: that wake (~0.2 ms
of CPU each on a loaded 2-core host, every cache cold after the procs ran) was wasted once a
call. Arming a timer is one system call and wakes nobody; the next wait disarms it; if none
comes, the timer wakes the I/O thread, as the short polls of shorter waits do.

Linux's timerfd, through ctypes (``os.timerfd_*`` is Python 3.13+), called with the GIL
held: a system call that cannot block. ``open()`` returns None where there is none; the
inbox then kicks as before.
"""
from __future__ import annotations

import ctypes
import functools
import os
import time


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


class ReleaseTimer:
    """A non-blocking timerfd: ``fd`` is readable once the delay has passed after ``arm()``,
    until ``clear()``; ``disarm()`` stops a pending one. Both are the C call itself (a
    partial of it: no Python frame on the hot path of every call)."""

    __slots__ = ("fd", "arm", "disarm", "_specs")

    def __init__(self, fd: int, settime, delay_s: float):
        self.fd = fd
        armed = _Itimerspec(_Timespec(0, 0), _Timespec(int(delay_s), int(delay_s % 1 * 1e9) or 1))
        off = _Itimerspec()
        self._specs = (armed, off)   # (kept alive for the pointers below)
        self.arm = functools.partial(settime, fd, 0, ctypes.byref(armed), None)
        self.disarm = functools.partial(settime, fd, 0, ctypes.byref(off), None)

    def clear(self) -> None:
        """(the poller's thread) Read the expiry, so the fd is no longer readable."""
        try:
            os.read(self.fd, 8)
        except BlockingIOError:
            pass

    def close(self) -> None:
        """Close the fd. A later ``arm``/``disarm`` (a user thread letting go after the close)
        fails harmlessly on a closed or reused fd: timerfd_settime checks the fd's type."""
        os.close(self.fd)


def open_timer(delay_s: float) -> ReleaseTimer | None:
    """A ReleaseTimer firing ``delay_s`` after each ``arm()``, or None without timerfd."""
    try:
        libc = ctypes.PyDLL(None, use_errno=True)   # PyDLL: the GIL stays held (no Python calls)
        create, settime = libc.timerfd_create, libc.timerfd_settime
    except (OSError, AttributeError):
        return None
    create.argtypes, create.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    settime.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    settime.restype = ctypes.c_int
    fd = create(time.CLOCK_MONOTONIC, os.O_NONBLOCK | os.O_CLOEXEC)
    if fd < 0:
        return None
    return ReleaseTimer(fd, settime, delay_s)
