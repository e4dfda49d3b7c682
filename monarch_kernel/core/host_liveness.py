"""Is a silent host agent on this machine stalled, or only starved of CPU?

Between machines, a host is declared lost after ``HOST_TIMEOUT_S`` of silence: nothing
else can be known. An agent on *this* machine (same pid namespace: its own netns "host"
or plain loopback) can be asked of the operating system instead. With hundreds of busy
procs on two cores, a healthy agent waits a long time for a CPU; its silence is load,
not loss. So the controller's I/O thread, while such an agent is silent, looks at each of
its threads (``/proc/PID/task/*/stat``, ``schedstat`` and the main thread's ``wchan``):

  * stopped (SIGSTOP, a debugger) or gone: silence counts, as between machines;
  * it wants to make progress, and silence is tolerated up to
    ``MONARCH_KERNEL_STARVED_HOST_TIMEOUT_S`` (a runaway agent is still declared lost, later),
    when at this look:
      - a thread that answers heartbeats (the main loop, zmq's I/O thread) is runnable
        (R: running or waiting in the run queue) or in the kernel (D: a page fault, disk);
      - the main thread waits on a futex (the GIL, a lock) while another of its threads is
        runnable or in the kernel (the telemetry sampler holding the GIL);
      - the main thread sleeps in a timed wait of its own (nanosleep: waiting for procs
        to stop), not in its poll;
      - or its threads ran or waited to run for at least half of the wall time since the
        previous look;
  * otherwise (asleep in its poll: idle, cut off from the network; or deadlocked): silence
    counts.

An agent looks at its controller the same way when the controller is on its machine
(node/agent.py ``_controller_starved``): a kernel beside 256 printing procs on 2 cores was
silent for 3-6 s, and detaching it sent the procs' lines to the host's stderr mid-cell. The
controller's I/O thread names itself ``monarch-io`` for this (``name_this_thread``).

The state letter comes first because the counters lag: the kernel adds a thread's wait in
the run queue to ``schedstat`` only when the thread gets a CPU. An agent that sat runnable
for 2-3 s on a loaded machine showed no progress at all in the looks between, was judged
asleep, and was declared lost (bench/repro_agent_silence.py; load average 40-120 on 2 cores).
"""
from __future__ import annotations

import logging
import os
import threading
import time

from .. import config

log = logging.getLogger("monarch_kernel")

BUSY_FRACTION = 0.5   # of wall time spent running or runnable: the agent wants the CPU
PROC = "/proc"   # tests point it at a tree of their own
_STOPPED = ("", "T", "t", "Z", "X")   # stopped (a signal, a debugger), a zombie, gone
IO_THREAD_NAME = "monarch-io"   # a controller's I/O thread (core/inbox.py): its heartbeats
_ANSWERING = ("ZMQbg/IO", IO_THREAD_NAME)   # threads that answer or send heartbeats, besides the main one


def name_this_thread(name: str) -> None:
    """Give the calling thread ``name`` where the OS shows it (``/proc/.../comm``, 15
    bytes): Python names threads for itself only, and a watcher of this process reads
    the OS's names."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
            f.write(name[:15])
    except OSError:
        pass


def starved_host_timeout_s() -> float:
    return config.STARVED_HOST_TIMEOUT_S.get()


def _state(pid: int) -> str:
    """The process state letter (R, S, D, T, t, Z, ...), '' when it is gone."""
    try:
        return _read(f"{PROC}/{pid}/stat").rsplit(")", 1)[1].split()[0]
    except IndexError:
        return ""


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _threads(pid: int) -> list[tuple[int, str, str, int]] | None:
    """(tid, name, state letter, ns ran + waited runnable) of each thread of ``pid``; None
    when it is gone."""
    try:
        tids = os.listdir(f"{PROC}/{pid}/task")
    except OSError:
        return None
    out = []
    for tid in tids:
        stat = _read(f"{PROC}/{pid}/task/{tid}/stat")
        if ")" not in stat:
            continue   # a thread that just ended
        try:
            ran, waited = _read(f"{PROC}/{pid}/task/{tid}/schedstat").split()[:2]
            ns = int(ran) + int(waited)
        except ValueError:
            ns = 0
        name = stat[stat.find("(") + 1:stat.rfind(")")]
        out.append((int(tid), name, stat.rsplit(")", 1)[1].split()[0], ns))
    return out


def wants_to_progress(pid: int, threads: list, fraction: float) -> str:
    """Why the agent ``pid`` (its ``threads`` as ``_threads`` gives them) is working or
    starved rather than asleep, at this look; '' when it is asleep (see the module doc)."""
    main = next((t for t in threads if t[0] == pid), None)
    if main is None or main[2] in _STOPPED:
        return ""
    for tid, name, state, _ in threads:
        if (tid == pid or name.startswith(_ANSWERING)) and state in ("R", "D"):
            what = "the main loop" if tid == pid else f"its {name} thread"
            return f"{what} is {'runnable (waiting for a CPU)' if state == 'R' else 'in the kernel (D)'}"
    wchan = _read(f"{PROC}/{pid}/task/{pid}/wchan") if main[2] == "S" else ""
    if "futex" in wchan and any(t[2] in ("R", "D") for t in threads if t[0] != pid):
        return "the main loop waits on a lock (the GIL) held by a runnable thread"
    if "nanosleep" in wchan:
        return "the main loop is in a timed wait of its own"
    if fraction >= BUSY_FRACTION:
        return f"its threads ran or waited for a CPU {fraction:.0%} of the time"
    return ""


class LocalAgentWatch:
    """The scheduler's view of one same-machine agent (or, from an agent, its controller),
    looked at while it is silent."""

    __slots__ = ("pid", "what", "_t", "_ns", "busy", "why", "_said")

    def __init__(self, pid: int, what: str = "host agent"):
        self.pid = pid
        self.what = what   # what it is, for the log (an agent watches its controller too)
        self._t = 0.0
        self._ns: int | None = None
        self.busy = False
        self.why = ""     # why it is busy, at the last look
        self._said = False

    def silence_is_load(self, now: float, silent_s: float) -> bool:
        """Called on every tick while the agent is silent: look, then judge."""
        self.look(now)
        load = self.silence_tolerated(silent_s)
        if load and not self._said and silent_s > 1.0:
            self._said = True
            log.info("%s pid %d silent for %.1f s but working or starved (%s): "
                     "tolerated up to %.0f s", self.what, self.pid, silent_s, self.why, starved_host_timeout_s())
        elif not load:
            self._said = False
        return load

    def look(self, now: float | None = None) -> None:
        """Does the agent want to make progress now (its threads' states), or did it want
        the CPU most of the time since the previous look (their counters)?"""
        now = time.monotonic() if now is None else now
        threads = _threads(self.pid)
        ns = None if threads is None else sum(t[3] for t in threads)
        fraction = 0.0
        if ns is not None and self._ns is not None and now > self._t:
            fraction = (ns - self._ns) / ((now - self._t) * 1e9)
        self.why = wants_to_progress(self.pid, threads, fraction) if threads else ""
        self.busy = bool(self.why)
        self._t, self._ns = now, ns

    def silence_tolerated(self, silent_s: float) -> bool:
        """True while the agent's silence is load (alive, not stopped, wanting the CPU)."""
        if not self.busy or silent_s >= starved_host_timeout_s():
            return False
        return _state(self.pid) not in _STOPPED
