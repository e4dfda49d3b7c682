"""Jobs whose hosts are processes on this machine: ``ProcessJob`` and ``LocalJob``.

``ProcessJob(meshes={"hosts": 2})`` starts one persistent host agent per host, each its
own process (as Monarch's examples use local subprocess hosts to stand for machines), so
a two-host program runs unchanged on a laptop. ``LocalJob()`` is what ``%mesh connect``
does: one agent per mesh, dims without a "hosts" dim.

How long the agent processes live (they are what holds the procs and actors):
- ``state(cached_path=None)``: nothing can re-attach, so they are private to this process
  and end with it, however it ends (they watch its pid).
- cached (the default): a later process can re-attach, so they outlive a crash or a
  kernel restart until their lease. But a SIGTERM to the process that started them
  (``kill <pid>``, a batch system ending the script) ends them too, unless the user chose
  the persistence by giving a lease (``ProcessJob(..., lease=7200)``,
  ``%mesh connect --lease 2h``): then they wait out that lease for a re-attach.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
import weakref

from ..core.transport import pid_alive
from ..launch.local import start_local_agent
from .base import JobTrait, Progress

log = logging.getLogger("monarch_kernel.job")


#: What one more host on this machine costs before it runs a proc: its agent and its zygote,
#: which imports torch (measured: 17 + 67 MB of their own, 21 + 146 MB PSS), rounded up.
LOCAL_HOST_MB = 200


def _check_room(hosts: int) -> None:
    """Refuse, before starting any, more local hosts than this machine's memory holds (a
    ``--hosts 1000`` typed for ``--procs 1000`` would start 1000 zygotes importing torch)."""
    import psutil

    avail_mb = psutil.virtual_memory().available / 2**20
    if hosts * LOCAL_HOST_MB > avail_mb:
        raise ValueError(f"{hosts} hosts on this machine need about {hosts * LOCAL_HOST_MB:,} MB (each its own "
                         f"host agent and zygote, ~{LOCAL_HOST_MB} MB) and {avail_mb:,.0f} MB are available; "
                         f"room for about {int(avail_mb // LOCAL_HOST_MB)}. Ask for fewer hosts, and more procs "
                         "on each (`%mesh connect NAME --hosts 4 --procs 64`)")


class ProcessJob(JobTrait):
    """Each host a local agent process; the "allocation" is their pids."""

    kind = "process"

    def __init__(self, meshes: dict[str, int] | None = None, env: dict[str, str] | None = None, *,
                 name: str | None = None, lease: float | None = None):
        self.env = dict(env or {})   # extra environment of the agents and their procs (Monarch's env=)
        super().__init__(meshes or {"hosts": 1}, name=name, lease=lease)
        self._popen: list = []

    def spec(self) -> dict:
        return {"meshes": self._meshes, "env": self.env}

    def _create(self, key: bytes, progress: Progress) -> list[dict]:
        total = sum(self._meshes.values())
        _check_room(total)
        self._handle = {"id": f"local-{os.getpid()}-{int(time.time())}", "pids": []}
        agents = []
        private = self._cache is None   # state(cached_path=None): nobody can re-attach
        here = socket.gethostname()
        for mesh, n in self._meshes.items():
            for rank in range(n):
                progress(f"starting host agent {len(agents) + 1}/{total}")
                env = self.env
                if total > 1 and "MONARCH_KERNEL_HOST_NAME" not in env:
                    # Several hosts on one machine: each a name of its own in the ranks' tables,
                    # errors and telemetry (they would all read as this machine's hostname).
                    env = {**env, "MONARCH_KERNEL_HOST_NAME": f"{here}/{mesh}{rank}"}
                agent, proc = start_local_agent(key, name=f"{self.name}.{mesh}.{rank}", persistent=not private,
                                                lease=self.lease, env=env)
                self._popen.append(proc)
                self._handle["pids"].append(agent["pid"])
                agents.append({**agent, "mesh": mesh, "rank": rank})
        if not private and not self._lease_chosen:
            _end_on_sigterm(self)
        return agents

    def _gone_reason(self) -> str | None:
        self._reap()   # agents of ours that exited (stopped from the Mesh panel, killed): no zombies
        dead = [p for p in (self._handle or {}).get("pids", []) if not pid_alive(p)]
        if dead:
            return f"host agent pid {', '.join(map(str, dead))} no longer runs"
        return None

    def _release(self) -> None:
        pids = (self._handle or {}).get("pids", [])
        for pid in pids:
            if pid_alive(pid):
                try:
                    os.kill(pid, signal.SIGTERM)   # the agent stops its procs, then exits
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 5
        while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
            self._reap()
            time.sleep(0.02)
        for pid in pids:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        self._reap(wait=True)

    def kill(self) -> None:
        _ENDED_ON_SIGTERM.discard(self)
        super().kill()

    def _reap(self, wait: bool = False) -> None:
        for p in list(self._popen):
            if (p.wait(2) if wait else p.poll()) is not None:
                self._popen.remove(p)

    def describe(self) -> dict:
        return {**super().describe(), "pids": (self._handle or {}).get("pids", [])}

    def __getstate__(self):
        d = dict(self.__dict__)
        d["_popen"], d["_hosts"] = [], {}
        return d


class LocalJob(ProcessJob):
    """One local agent per mesh name; its procs have only the per-host dims (as today's
    ``%mesh connect`` and ``this_host()``)."""

    kind = "local"
    _local_dims = True

    def __init__(self, hosts: tuple[str, ...] | list[str] = ("hosts",), *, name: str | None = None,
                 lease: float | None = None):
        if isinstance(hosts, str):
            hosts = (hosts,)
        self._names = tuple(hosts)
        super().__init__({h: 1 for h in self._names}, name=name, lease=lease)

    def spec(self) -> dict:
        return {"hosts": list(self._names)}


# ---------------------------------------------------------------------- SIGTERM
_ENDED_ON_SIGTERM: weakref.WeakSet = weakref.WeakSet()   # jobs whose agents end with this process
_previous_handler: list = []                             # the SIGTERM handler ours replaced


def _end_on_sigterm(job: ProcessJob) -> None:
    """On SIGTERM, end ``job``'s agents before this process goes (then do what SIGTERM did
    before: the default action, or the handler that was installed)."""
    _ENDED_ON_SIGTERM.add(job)
    if _previous_handler:
        return
    if threading.current_thread() is not threading.main_thread():
        log.warning("job %s started off the main thread: its agents will not end on SIGTERM, only "
                    "after their lease", job.name)
        return
    _previous_handler.append(signal.getsignal(signal.SIGTERM))
    signal.signal(signal.SIGTERM, _on_sigterm)


def _on_sigterm(signum, frame) -> None:
    for job in list(_ENDED_ON_SIGTERM):
        if job._lease_chosen:   # chosen after state() (job.lease = ..., %mesh connect --lease)
            continue
        try:
            job._release()
            job._reset(job._cache)
        except Exception as e:   # the process is going anyway: say what is left
            log.warning("ending the agents of job %s on SIGTERM: %s", job.name, e)
    _ENDED_ON_SIGTERM.clear()
    previous = _previous_handler.pop() if _previous_handler else signal.SIG_DFL
    signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
    if callable(previous):
        previous(signum, frame)
    elif previous != signal.SIG_IGN:
        os.kill(os.getpid(), signal.SIGTERM)
