"""Is a silent host agent on this machine stalled, or only starved of CPU?

Between machines, a host is declared lost after ``HOST_TIMEOUT_S`` of silence: nothing
else can be known. An agent on *this* machine (same pid namespace: its own netns "host"
or plain loopback) can be asked of the operating system instead. With hundreds of busy
procs on two cores, a healthy agent waits a long time for a CPU; its silence is load,
not loss. So the controller's I/O thread, while such an agent is silent, reads what the
kernel's scheduler says about it (``/proc/PID/task/*/schedstat``: nanoseconds each
thread ran, and waited runnable for a CPU):

  * stopped (SIGSTOP, a debugger) or gone: silence counts, as between machines;
  * its threads ran or waited to run for at least half of the wall time since the last
    look: it is working or starved, not stalled; silence is tolerated up to
    ``MONARCH_KERNEL_STARVED_HOST_TIMEOUT_S`` (a runaway agent is still declared lost, later);
  * otherwise (asleep: blocked, deadlocked, or cut off from the network while idle):
    silence counts.
"""
from __future__ import annotations

import logging
import os
import time

from .. import config

log = logging.getLogger("monarch_kernel")

BUSY_FRACTION = 0.5   # of wall time spent running or runnable: the agent wants the CPU


def starved_host_timeout_s() -> float:
    return config.STARVED_HOST_TIMEOUT_S.get()


def _state(pid: int) -> str:
    """The process state letter (R, S, D, T, t, Z, ...), '' when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _sched_ns(pid: int) -> int | None:
    """Nanoseconds all threads of ``pid`` ran plus waited runnable; None when unreadable."""
    total = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                ran, waited = f.read().split()[:2]
            total += int(ran) + int(waited)
        except (OSError, ValueError):
            continue   # a thread that just ended
    return total


class LocalAgentWatch:
    """The scheduler's view of one same-machine agent, looked at while it is silent."""

    __slots__ = ("pid", "_t", "_ns", "busy", "_said")

    def __init__(self, pid: int):
        self.pid = pid
        self._t = 0.0
        self._ns: int | None = None
        self.busy = False
        self._said = False

    def silence_is_load(self, now: float, silent_s: float) -> bool:
        """Called on every tick while the agent is silent: look, then judge."""
        self.look(now)
        load = self.silence_tolerated(silent_s)
        if load and not self._said and silent_s > 1.0:
            self._said = True
            log.info("host agent pid %d silent for %.1f s but busy or waiting for a CPU (load): "
                        "tolerated up to %.0f s", self.pid, silent_s, starved_host_timeout_s())
        elif not load:
            self._said = False
        return load

    def look(self, now: float | None = None) -> None:
        """Compare with the previous look: did the agent want the CPU most of the time since?"""
        now = time.monotonic() if now is None else now
        ns = _sched_ns(self.pid)
        if ns is not None and self._ns is not None and now > self._t:
            self.busy = (ns - self._ns) / ((now - self._t) * 1e9) >= BUSY_FRACTION
        else:
            self.busy = False
        self._t, self._ns = now, ns

    def silence_tolerated(self, silent_s: float) -> bool:
        """True while the agent's silence is load (alive, not stopped, wanting the CPU)."""
        if not self.busy or silent_s >= starved_host_timeout_s():
            return False
        return _state(self.pid) not in ("", "T", "t", "Z", "X")
