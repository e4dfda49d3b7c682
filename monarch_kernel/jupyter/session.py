"""The notebook's connection to a mesh: which HostMesh, ProcMesh and cell runner are current.

A mesh is a persistent local HostMesh (``this_host(name)``): its agent outlives the
kernel, so after a kernel restart ``%mesh connect`` with the same name (the default one
if none was given) re-attaches to the same procs, namespaces and actors.

The default name comes from the notebook: jupyter_server gives the kernel the notebook's
path in ``JPY_SESSION_NAME``; without it the name is ``default``.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import socket
import threading
import time

from monarch_kernel import config
from monarch_kernel.core.mesh import state_of

from ..core import hosts as hosts_mod
from ..core.connection import agent_alive, read_connection_file
from ..core.errors import MeshGoneError
from ..core.hosts import HostMesh, this_host
from ..core.mesh import ActorMesh, ProcMesh
from ..core.runtime import runtime
from ..core.transport import pid_alive, pid_space

log = logging.getLogger("monarch_kernel.jupyter")

PROC_MESH = "procs"         # the proc mesh a notebook's cells run on
CELL_ACTOR = "__cells__"    # reserved actor mesh name of the cell runner
PREWARM_LEASE_S = 120.0     # an agent started ahead of time, never used, goes away after this


def default_mesh_name() -> str:
    """``<notebook stem>-<hash of its path>`` when the kernel knows its notebook, else
    ``default``: stable across kernel restarts, distinct for two notebooks of one name."""
    path = os.environ.get("JPY_SESSION_NAME", "")
    if not path:
        return config.DEFAULT_MESH.get()
    stem = re.sub(r"[^A-Za-z0-9_.-]", "-", os.path.splitext(os.path.basename(path))[0]).strip("-.")
    digest = hashlib.sha1(path.encode()).hexdigest()[:6]
    return f"{(stem or 'nb')[:40]}-{digest}"


def parse_duration(text: str) -> float:
    """``90``, ``90s``, ``15m``, ``2h``, ``1d`` -> seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text or "")
    if not m:
        raise ValueError(f"bad duration {text!r}: use seconds (90) or a number with s, m, h or d (15m, 2h)")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]


def _agent_last_words(hm: HostMesh) -> str:
    """Why a mesh's agent stopped, from its log when it ran here (its zygote was killed, ...),
    and the log's path: the notebook user has no other way to learn it."""
    lost = " (its procs and their state are lost)"
    pairs = hm.agents_and_infos()
    if len(pairs) != 1 or pairs[0][1].get("pid_space") != pid_space():
        return lost
    from ..launch.local import last_words

    said = last_words(hm.name, pairs[0][1].get("pid"))
    if said is None:
        return lost
    why, log = said
    return f": {why}; its log: {log}" if why else f"{lost}; its log: {log}"


class MeshSession:
    """What ``%mesh`` and ``%%on_mesh`` act on. One per kernel (``session()``)."""

    def __init__(self):
        self.host: HostMesh | None = None
        self.job = None            # a monarch_kernel.job JobTrait when the mesh came from a job
        self.job_mesh: str | None = None   # which of the job's meshes the cells run on
        self.procs: ProcMesh | None = None
        self.cells: ActorMesh | None = None
        self.name: str | None = None
        self._prewarm: threading.Thread | None = None
        self._prewarmed: str | None = None
        self.preloaded: dict[str, float] = {}   # the last connect's --preload: {host: seconds}

    # ------------------------------------------------------------------ prewarm
    def prewarm(self, name: str | None = None) -> None:
        """Start (or attach to) the default mesh's agent and its warm zygote in the
        background, so the first ``%mesh connect`` does not wait for Python and torch."""
        name = name or default_mesh_name()

        def go():
            try:
                this_host(name, lease=PREWARM_LEASE_S)
                self._prewarmed = name
            except Exception as e:   # the user will see the real error on %mesh connect
                log.warning("prewarming mesh %r failed: %s", name, e)

        self._prewarm = threading.Thread(target=go, name="monarch-prewarm", daemon=True)
        self._prewarm.start()

    # ------------------------------------------------------------------ connect
    def connect(self, name: str | None, procs: int | None, per_host: dict | None, lease: float | None,
                progress=None, job=None, job_progress=None, job_mesh: str | None = None,
                preload: list[str] | None = None) -> tuple[ProcMesh, bool]:
        """Attach to (or start) mesh ``name`` and its notebook proc mesh; True if it was
        spawned now, False if re-attached. With ``job`` (a ``monarch_kernel.job`` job), the
        hosts are the job's mesh ``job_mesh`` (default: its first): its allocation is asked
        for, or re-attached to when a kernel before this one asked for it. The job's other
        meshes keep their own procs; connecting with another ``job_mesh`` moves the cells
        there (each mesh's namespaces stay on its procs). ``preload``: modules each host
        imports before its procs are forked (HostMesh.preload); a re-attached mesh's procs
        import them on first use, its later spawns and respawns start with them."""
        name = name or (job.name if job is not None else default_mesh_name())
        if self._prewarm is not None:
            self._prewarm.join()
        if job is None and self.job is not None and self.name == name:
            job = self.job            # `%mesh connect NAME --mesh OTHER`: the same job, another mesh
        if job is None:
            from ..job import cached_job

            job = cached_job(name)   # `%mesh connect NAME` of a job's mesh: re-attach through the job
        if job_mesh is not None and job is None:
            raise ValueError(f"--mesh {job_mesh} picks one of a job's meshes, but {name!r} is not a job's mesh: "
                             "use it with --job VAR (or --slurm, --ssh, --k8s), or with the name of a job's mesh")
        if job is not None:
            job_mesh = job_mesh or next(iter(job.meshes))
            if job_mesh not in job.meshes:
                raise ValueError(f"{job.kind} job {job.name!r} has no mesh {job_mesh!r}; its meshes: "
                                 f"{', '.join(job.meshes)} (pick one with --mesh)")
        if self.host is not None and (self.name != name or (job is not None and job is not self.job)):
            self.disconnect()
        stale = hosts_mod.named_host_mesh(name)
        if stale is not None and not stale.detached and not host_alive(stale):
            stale.forget()
        if job is not None and self._prewarmed == name:
            pre = hosts_mod.named_host_mesh(name)   # a local agent started ahead of time holds the name
            if pre is not None and not pre.detached and not pre.proc_meshes:
                pre.shutdown()
            self._prewarmed = None
        if job is not None:
            state = job.state(progress=job_progress)
            hm = state[job_mesh]
            if lease is not None:
                job.lease = lease   # chosen: the hosts outlive this kernel that long, whatever ends it
                for mesh in state:
                    set_lease(state[mesh], lease)
        else:
            hm = this_host(name, lease=lease)
            if lease is not None or (self._prewarmed == name and hm.local_process is not None):
                set_lease(hm, lease if lease is not None else hosts_mod.DEFAULT_LEASE_S)
        if self._prewarmed == name:
            self._prewarmed = None   # it is the user's mesh now, kept on shutdown
        self.host, self.name, self.job, self.job_mesh = hm, name, job, job_mesh
        if preload:
            self.preloaded = hm.preload(*preload)   # {host: seconds}
        spawned = False
        try:
            pm = hm.proc_mesh(PROC_MESH)
        except KeyError:
            want = per_host or ({"gpus": procs} if procs else None)
            pm = _spawn_with_progress(hm, want, progress)
            spawned = True
        else:
            want = per_host or ({"gpus": procs} if procs else None)
            have_dims = dict(zip(state_of(pm).labels, state_of(pm).sizes, strict=False))
            if "hosts" in have_dims and "hosts" not in (want or {}):
                have_dims.pop("hosts")   # a multi-host mesh: --procs counts procs per host
            if want and have_dims != want:
                have = ", ".join(f"{k}={v}" for k, v in zip(state_of(pm).labels, state_of(pm).sizes, strict=False))
                raise ValueError(f"mesh {name!r} already runs with {have}; `%mesh stop {name}` first to "
                                 "start it with another size (its state will be lost)")
        self.procs = pm
        try:
            self.cells = pm.actor_mesh(CELL_ACTOR)
        except KeyError:
            from ..node.cells import CellRunner

            self.cells = pm.spawn(CELL_ACTOR, CellRunner, pm)
            # Connected means cells can run: wait for the runner (spawn returns at once), so a
            # `%mesh stop` right after does not leave its start to fail unobserved.
            self.cells.initialized.get(120)
        return pm, spawned

    def require(self) -> tuple[ProcMesh, ActorMesh]:
        """The current mesh, or an error that says how to get one."""
        if self.procs is None or self.cells is None:
            raise NotConnected("no mesh is connected: run `%mesh connect` first (a local mesh, one proc "
                               "per GPU or CPU core; `%mesh connect --procs 4` for 4), or `%mesh connect "
                               "NAME` to attach to a running one (`%mesh list` shows them)")
        if state_of(self.procs).stopped:
            raise NotConnected(f"mesh {self.name!r} was stopped: `%mesh connect {self.name}` starts it again")
        if not host_alive(self.host):
            name, why = self.name, _agent_last_words(self.host)
            self.forget()
            raise MeshGoneError(f"mesh {name!r} is gone: its host agent no longer runs{why}. Run "
                                f"`%mesh connect {name}` to start a new one")
        return self.procs, self.cells

    # ------------------------------------------------------------------ leave
    def disconnect(self) -> str | None:
        name = self.name
        if self.job is not None:
            self.job.disconnect()   # the allocation keeps running until its lease
        elif self.host is not None and not self.host.detached:
            self.host.detach()
        self.forget()
        return name

    def stop(self, name: str | None = None) -> str:
        """Stop mesh ``name`` (default: the current one): its procs and its agent."""
        name = name or self.name or default_mesh_name()
        if self._prewarm is not None:
            self._prewarm.join()
        from ..job import cached_job

        job = self.job if self.name == name else cached_job(name)
        if job is not None:   # procs, agents and the allocation (scancel, pods, ...)
            job.kill()
            if self.name == name:
                self.forget()
            return name
        hm = self.host if self.name == name else None
        if hm is None or hm.detached:
            hm = hosts_mod.named_host_mesh(name)
        if hm is None or hm.detached:
            info = read_connection_file(name)   # MeshGoneError: no such mesh
            if not agent_alive(info):
                from ..core.connection import connection_path

                connection_path(name).unlink(missing_ok=True)
                raise MeshGoneError(f"mesh {name!r} was already gone (its agent no longer ran); "
                                    "its connection file was removed")
            hm = hosts_mod.attach(name)
        hm.shutdown()
        if self.name == name:
            self.forget()
        return name

    def forget(self) -> None:
        self.host = self.procs = self.cells = self.job = None
        self.name = self.job_mesh = None

    def shutdown_kernel(self) -> None:
        """Kernel shutdown or restart: leave connected meshes running (persistent), stop
        an agent that was only prewarmed and never got procs."""
        if self._prewarm is not None:
            self._prewarm.join(10)
        pre = self._prewarmed and hosts_mod.named_host_mesh(self._prewarmed)
        if pre and not pre.detached and not pre.proc_meshes and pre is not self.host:
            pre.shutdown()
        if self.job is not None:
            self.job.disconnect()   # a job's allocation outlives the kernel, until its lease
        elif self.host is not None and not self.host.detached:
            if self.host.proc_meshes:
                self.host.detach()
            else:
                self.host.shutdown()
        self.forget()


class NotConnected(Exception):
    """``%%on_mesh`` or a ``%mesh`` command that needs a mesh, with none connected."""


def host_alive(hm: HostMesh | None) -> bool:
    """Is the host mesh still there: an agent that exited is gone, one lost by silence only
    stalled (its procs and their state come back when it answers)."""
    if hm is None or hm.detached:
        return False
    proc = hm.local_process
    if proc is not None and proc.poll() is not None:   # our child: poll() also reaps it
        return False
    rt = runtime()
    child = proc.pid if proc is not None else None   # poll() just said it runs: no /proc read
    here = None
    gone = 0
    agents = [a for a, _ in hm.agents_and_infos()]
    for a in agents:
        link = rt.agents.get(a["addr"])
        pid = a.get("pid")
        if link is not None and link.gone:   # its process exited
            gone += 1
        elif pid and pid != child:
            # An agent of this machine is gone when its process is; a link lost by silence
            # alone (stopped, starved, or on another machine: only its job can tell) is a
            # stalled host, whose procs come back with their state.
            here = here or socket.gethostname()
            if a.get("host") == here and not pid_alive(pid):
                gone += 1
    # A mesh of several hosts that lost some keeps its other hosts' ranks (and their state).
    return gone == 0 or (len(agents) > 1 and gone < len(agents))


def set_lease(hm: HostMesh, seconds: float) -> None:
    """Tell the agents how long to keep the mesh with no controller attached."""
    rt = runtime()
    futs = [rt.agent_request(a["addr"], hm.mesh_key, "lease", float(seconds)) for a, _ in hm.agents_and_infos()]
    for f in futs:
        try:
            f.get(5)
        except Exception as e:
            log.warning("could not set the lease: %s", e)


def _spawn_with_progress(hm: HostMesh, per_host: dict | None, progress) -> ProcMesh:
    """spawn_procs, reporting (ready, total) to ``progress`` while the procs start."""
    from ..core.bootstrap import default_per_host

    per_host = per_host or default_per_host()   # spawn_procs' own default is Monarch's: 1 per host
    if progress is None:
        return hm.spawn_procs(per_host=per_host, name=PROC_MESH)
    from ..core.transport import gpu_count

    total = 1
    for v in (per_host or {"gpus": gpu_count() or os.cpu_count() or 1}).values():
        total *= v
    total *= len(hm)
    out: dict = {}

    def spawn():
        try:
            out["pm"] = hm.spawn_procs(per_host=per_host, name=PROC_MESH)
        except BaseException as e:
            out["err"] = e

    t = threading.Thread(target=spawn, name="monarch-spawn", daemon=True)
    t.start()
    progress(0, total)
    last = 0
    while t.is_alive():
        t.join(0.1)
        if not t.is_alive():
            break
        try:
            ready = sum(1 for r in hm.status() if r["mesh"] == PROC_MESH and r["state"] == "alive")
        except Exception:
            ready = last
        if ready != last:
            last = ready
            progress(min(ready, total), total)
        time.sleep(0.05)
    if "err" in out:
        raise out["err"]
    progress(total, total)
    return out["pm"]


_SESSION: MeshSession | None = None


def session() -> MeshSession:
    global _SESSION
    if _SESSION is None:
        _SESSION = MeshSession()
    return _SESSION
