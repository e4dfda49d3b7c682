"""The job interface: where a mesh's hosts come from, and how a later process finds them again.

    job = SlurmJob(meshes={"trainers": 2})
    hosts = job.state().trainers                     # a HostMesh, one agent per node
    procs = hosts.spawn_procs(per_host={"gpus": 8})
    job.kill()                                       # procs, agents and the allocation

``state()`` writes the job (its scheduler handle, its agents' addresses and the mesh key)
into the mesh connection file ``$MONARCH_KERNEL_HOME/meshes/<job name>.json``, mode 0600.
The same call in a later process (a restarted kernel) finds that file, checks with the
scheduler that the allocation still runs, and attaches to the same agents: their
persistent registries give back the same procs and actors. An allocation that is gone
is reported (``JobGoneError``); ``state(renew=True)`` asks for a new one.

The cache is JSON, not a pickle like Monarch's: loading it runs no code. A job's default
name is derived from its spec, so the same constructor call finds the same cache.
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path

from ..core import hosts as hosts_mod
from ..core.connection import check_name, connection_path, new_key, write_connection_file
from ..core.errors import MeshGoneError, SupervisionError
from ..core.hosts import HostMesh

log = logging.getLogger("monarch_kernel.job")

Progress = Callable[[str], None]
CACHE = object()   # state()'s default: the cache is the job's mesh connection file


class JobError(RuntimeError):
    """The scheduler refused or failed the job; the message is the scheduler's own."""


class JobGoneError(JobError, MeshGoneError):
    """The job's allocation no longer runs (ended, cancelled, timed out, pods deleted)."""


class JobInterrupted(KeyboardInterrupt):
    """The interrupt (the kernel's stop button, Ctrl-C) while a job started: what it had
    asked for was released, and the message says so. Named ``KeyboardInterrupt`` for the
    notebook (its ``ename``); a kernel shows the message alone, not the client library's
    frames the interrupt happened to land in."""

    def _render_traceback_(self) -> list[str]:
        return [f"\x1b[31mKeyboardInterrupt: {self}\x1b[0m"]


JobInterrupted.__name__ = "KeyboardInterrupt"


class JobState:
    """One ``HostMesh`` attribute per mesh of the job: ``state.trainers``."""

    def __init__(self, hosts: dict[str, HostMesh], job: JobTrait | None = None):
        self._hosts = hosts
        self.job = job

    def __getattr__(self, name: str) -> HostMesh:
        try:
            return self.__dict__["_hosts"][name]
        except KeyError:
            raise AttributeError(f"the job has no mesh {name!r}; its meshes: "
                                 f"{', '.join(sorted(self.__dict__['_hosts']))}") from None

    def __getitem__(self, name: str) -> HostMesh:
        return getattr(self, name)

    def __iter__(self):
        return iter(self._hosts)

    def __repr__(self):
        return f"<JobState {', '.join(f'{k}={len(v)} hosts' for k, v in self._hosts.items())}>"


class JobTrait(ABC):
    """A specification of hosts (``meshes={"name": host count}``) and, once applied, the
    allocation that holds them. Subclasses say how to allocate (``_create``), whether an
    allocation still runs (``_gone_reason``) and how to release it (``_release``)."""

    kind = "job"
    #: one agent per mesh without a "hosts" dim (LocalJob) instead of {"hosts": N, ...}
    _local_dims = False

    #: meshes come later (KubernetesJob.add_mesh), so an empty dict is fine at first
    _meshes_later = False

    def __init__(self, meshes: dict[str, int], *, name: str | None = None, lease: float | None = None):
        if not isinstance(meshes, dict) or (not meshes and not self._meshes_later):
            raise ValueError(f"meshes must be a dict of mesh name -> host count, e.g. {{'trainers': 2}}; "
                             f"got {meshes!r}")
        for k, v in meshes.items():
            if not isinstance(k, str) or not k.isidentifier() or k.startswith("_"):
                raise ValueError(f"mesh name {k!r} must be an identifier like 'trainers'")
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"meshes[{k!r}] must be a positive number of hosts, got {v!r}")
        self._meshes = dict(meshes)
        self._lease = float(lease if lease is not None else hosts_mod.DEFAULT_LEASE_S)
        #: the user asked for a lease: the hosts are to outlive this process by choice
        self._lease_chosen = lease is not None
        self._name = check_name(name) if name else None
        self._handle: dict | None = None      # the scheduler's id for the allocation
        self._key: bytes | None = None
        self._agents: list[dict] = []         # {"addr", "host", "pid", "mesh", "rank"}
        self._hosts: dict[str, HostMesh] = {}
        #: where this object's allocation is cached: set by state() and job_load(); None
        #: while nothing was applied, or for state(cached_path=None)
        self._cache: Path | None = None

    # ------------------------------------------------------------------ what subclasses give
    def spec(self) -> dict:
        """What defines the job (JSON): a cached job is reused only for the same spec."""
        return {"meshes": self._meshes}

    @abstractmethod
    def _create(self, key: bytes, progress: Progress) -> list[dict]:
        """Allocate and start one agent per host; return the agents, each with its ``mesh``.
        Set ``self._handle`` before waiting, so an interrupt can release what was asked."""

    @abstractmethod
    def _gone_reason(self) -> str | None:
        """None while the allocation runs, else why it is gone (for the error)."""

    #: what ``_release`` did, for the message of an interrupted start
    _released_what = "what it had asked for was released"

    @abstractmethod
    def _release(self) -> None:
        """Release the allocation (scancel, delete pods, end agents); idempotent."""

    @classmethod
    def _from_spec(cls, spec: dict, *, name: str, lease: float | None) -> JobTrait:
        return cls(**spec, name=name, lease=lease)

    def describe(self) -> dict:
        """For ``%mesh status``: scheduler, id, hosts, state, time left."""
        return {"scheduler": self.kind, "id": self.job_id, "hosts": len(self._agents)}

    # ------------------------------------------------------------------ the interface
    @property
    def name(self) -> str:
        """The job's mesh name: given, or derived from its spec (the same call, the same name)."""
        return self._name or f"{self.kind}-{self._spec_digest()}"

    @property
    def lease(self) -> float:
        """Seconds the hosts wait with no controller attached before they end."""
        return self._lease

    @lease.setter
    def lease(self, seconds: float) -> None:
        """Choose the lease (``%mesh connect --lease`` does): the hosts are then meant to
        outlive this process for that long, even when it gets a SIGTERM."""
        self._lease, self._lease_chosen = float(seconds), True

    @property
    def job_id(self) -> str | None:
        return (self._handle or {}).get("id")

    @property
    def active(self) -> bool:
        return self._handle is not None

    @property
    def meshes(self) -> dict[str, int]:
        return dict(self._meshes)

    def state(self, cached_path: str | Path | None | object = CACHE, *, renew: bool = False,
              progress: Progress | None = None) -> JobState:
        """The job's host meshes: attach to the running allocation (ours, or the one cached
        from an earlier process), or ask the scheduler for one. ``renew=True`` replaces an
        allocation that is gone instead of raising ``JobGoneError``. The cache is the mesh
        connection file of the job's name; ``cached_path=PATH`` puts it elsewhere and, as in
        Monarch, ``cached_path=None`` neither reads nor writes one."""
        progress = progress or (lambda text: log.info("%s", text))
        if not self._meshes:
            raise ValueError(f"{type(self).__name__} has no meshes yet: add one first (add_mesh)")
        if self._hosts and not any(h.detached for h in self._hosts.values()):
            reason = self._gone_reason()
            if reason is None:
                return JobState(self._hosts, self)
            self._forget_hosts()
            if not renew:
                raise self._gone_error(reason)
        path = connection_path(self.name) if cached_path is CACHE else Path(cached_path) if cached_path else None
        if self._handle is None:
            self._cache = path
        else:
            path = self._cache   # an applied job stays where it was cached (or uncached)
        if self._handle is None and path is not None:
            rec = _read(path)
            if rec is not None:
                self._adopt(rec, path)
        if self._handle is not None:
            reason = self._gone_reason()
            if reason is None:
                progress(f"{self.kind} job {self.job_id}: re-attaching to {len(self._agents)} hosts")
                try:
                    return self._attach()
                except (MeshGoneError, SupervisionError, TimeoutError) as e:
                    reason = f"its agents do not answer ({e})"
            if not renew:
                raise self._gone_error(reason)
            self._release()
            self._reset(path)
        key = new_key()
        try:
            agents = self._create(key, progress)
        except BaseException as e:
            asked = self._handle is not None
            pressed = _held_off_interrupts(self._release)
            self._handle = None
            if (isinstance(e, KeyboardInterrupt) or pressed) and not isinstance(e, JobInterrupted):
                what = self._released_what if asked else "nothing had been asked for yet"
                raise JobInterrupted(f"{self.kind} job {self.name!r} was interrupted while it started; {what}, "
                                     "nothing of it is left") from None
            raise
        # an attach-only job takes the key its running agents already have
        self._key, self._agents = self.__dict__.pop("_key_from_create", key), agents
        if path is not None:
            self.dump(path)
        return self._attach()

    def kill(self) -> None:
        """End procs and agents and release the allocation this object holds (one it asked
        for or re-attached to with ``state()``, or loaded with ``job_load()``); afterwards
        nothing of it is left queued or running, and its cache is removed.

        The interrupt (the kernel's stop button, Ctrl-C) is held off while it runs, so that a
        press or two while the allocation is released cannot leave half of it behind: the
        release finishes, then says it held the interrupt off. A third press gets through,
        with a message saying how to release the rest.

        A job object that was never applied holds nothing, so its ``kill()`` releases
        nothing, even when a job of the same name and spec is cached by another process:
        that one is released with ``job_load(path).kill()`` or ``%mesh stop NAME``
        (a warning says so)."""
        if self._handle is None and not self._hosts:
            cached = connection_path(self.name)
            rec = _read(cached) if cached.exists() else None
            if rec is not None and rec.get("job"):
                import warnings

                cached_id = (rec["job"].get("handle") or {}).get("id")
                warnings.warn(f"{type(self).__name__} {self.name!r} was never applied in this process, so kill() "
                              f"released nothing; the job cached at {cached} (id {cached_id}) "
                              f"was started elsewhere: job_load({str(cached)!r}).kill() or `%mesh stop {self.name}` "
                              "releases it", UserWarning, stacklevel=2)
            return
        if _held_off_interrupts(self._kill, through_at=3,
                                escaped=f"interrupted three times while {self.kind} job {self.name!r} was released: "
                                        f"part of it may be left; `%mesh stop {self.name}` or job.kill() again "
                                        "releases the rest"):
            import sys

            print(f"{self.kind} job {self.name!r}: the interrupt was held off until the job was released; "
                  "nothing of it is left", file=sys.stderr, flush=True)

    def _kill(self) -> None:
        for hm in self._hosts.values():
            try:
                hm.shutdown()
            except Exception as e:
                log.warning("shutting down %s: %s", hm.name, e)
        self._hosts = {}
        if self._handle is None:
            return
        self._release()
        self._reset(self._cache)

    def disconnect(self) -> None:
        """Let go of the meshes and leave the allocation running (re-attach with state())."""
        for hm in self._hosts.values():
            hm.detach()
        self._hosts = {}

    def dump(self, path: str | Path | None = None) -> Path:
        """Write the job (spec, allocation, agents, key) as JSON, mode 0600."""
        path = Path(path) if path else connection_path(self.name)
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_connection_file(path, self._record())
        return path

    # ------------------------------------------------------------------ internals
    def _spec_digest(self) -> str:
        return hashlib.sha1(json.dumps(self.spec(), sort_keys=True).encode()).hexdigest()[:8]

    def _record(self) -> dict:
        return {"name": self.name, "key": self._key.hex() if self._key else None,
                "agents": [{k: a.get(k) for k in ("addr", "host", "pid", "mesh", "rank")} for a in self._agents],
                "persistent": True, "lease": self.lease,
                "job": {"kind": self.kind, "class": f"{type(self).__module__}.{type(self).__qualname__}",
                        "spec": self.spec(), "handle": self._handle, "created": time.time(),
                        "lease_chosen": self._lease_chosen}}

    def _adopt(self, rec: dict, path: Path) -> None:
        job = rec.get("job") or {}
        if job.get("kind") != self.kind:
            raise JobError(f"{path} holds a {job.get('kind') or 'plain'} mesh named {self.name!r}, not a "
                           f"{self.kind} job: pick another name, or stop that mesh (%mesh stop {self.name})")
        if json.loads(json.dumps(job.get("spec"))) != json.loads(json.dumps(self.spec())):
            raise JobError(f"job {self.name!r} is cached with another spec ({job.get('spec')}; this one is "
                           f"{self.spec()}): kill it first (job_load({str(path)!r}).kill()) or use another name")
        self._handle = job.get("handle")
        self._key = bytes.fromhex(rec["key"]) if rec.get("key") else None
        self._agents = list(rec.get("agents") or [])

    def _attach(self) -> JobState:
        _listen_towards(self._agents)
        hosts: dict[str, HostMesh] = {}
        try:
            for mesh in self._meshes:
                agents = sorted((a for a in self._agents if a.get("mesh") == mesh), key=lambda a: a.get("rank", 0))
                hm_name = f"{self.name}.{mesh}"
                hm = HostMesh(agents, self._key, hm_name, local=self._local_dims and len(agents) == 1,
                              persistent=True)
                hosts_mod.remember_host_mesh(hm_name, hm)
                hosts[mesh] = hm
        except BaseException:
            for hm in hosts.values():
                hm.forget()
            raise
        self._hosts = hosts
        return JobState(hosts, self)

    def _forget_hosts(self) -> None:
        for hm in self._hosts.values():
            hm.forget()
        self._hosts = {}

    def _reset(self, path: Path | None) -> None:
        self._forget_hosts()
        self._handle, self._key, self._agents = None, None, []
        if path is None:
            return
        try:
            rec = _read(path)
            if rec is not None and (rec.get("job") or {}).get("kind") == self.kind:
                path.unlink()
        except OSError:
            pass

    def _gone_error(self, reason: str) -> JobGoneError:
        return JobGoneError(f"{self.kind} job {self.name!r} (id {self.job_id}) is gone: {reason}. "
                            "job.state(renew=True) asks for a new allocation (its procs and actors are lost); "
                            f"in a notebook, `%mesh stop {self.name}` forgets it, then the connect cell asks for a "
                            "new one")

    def __repr__(self):
        where = f"id {self.job_id}" if self._handle else "not applied"
        return f"<{type(self).__name__} {self.name!r} {self._meshes} ({where})>"


def _held_off_interrupts(release: Callable[[], None], through_at: int = 2,
                         escaped: str = "interrupted again while releasing the job: part of it may be left; "
                                        "job_load(path).kill() or `%mesh stop NAME` releases it") -> bool:
    """Run ``release`` with SIGINT held off, so that pressing the interrupt button while it
    runs does not cut it short (leaving pods or a queued job); press number ``through_at``
    gets through (a KeyboardInterrupt saying ``escaped``). True if one came meanwhile.

    (A kernel's interrupt goes to its whole process group: the release's own commands,
    scancel or ssh, run in sessions of their own so that it does not end them either.)"""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        release()
        return False
    presses: list[int] = []

    def held(signum, frame):
        presses.append(signum)
        if len(presses) >= through_at:
            raise KeyboardInterrupt(escaped)

    old = signal.signal(signal.SIGINT, held)
    try:
        release()
    finally:
        signal.signal(signal.SIGINT, old if old is not None else signal.default_int_handler)
    return bool(presses)


def _listen_towards(agents: list[dict]) -> None:
    """Make this process's runtime reachable from the job's hosts (it may have started on
    loopback): listen on the local address that routes to them, or MONARCH_KERNEL_BIND."""
    from ..core.runtime import is_local, runtime
    from .rendezvous import controller_ip

    remote = [a["addr"] for a in agents if a.get("addr") and not is_local(a["addr"])]
    if remote:
        host = remote[0].split("://", 1)[-1].rsplit(":", 1)[0]
        ip = controller_ip(host)
        if ip != "127.0.0.1":
            runtime().listen_on(ip)


def _read(path: Path) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except ValueError as e:
        raise JobError(f"cannot read the cached job {path}: {e}; remove the file to start afresh") from None


def cached_job(name: str) -> JobTrait | None:
    """The job cached under mesh ``name`` (started by this or another process: a kernel, a
    script), ready to be released with ``.kill()``; None when that mesh is no job's (a lone
    agent's) or there is no such mesh. What ``%mesh stop NAME`` and the Mesh panel's stop use."""
    path = connection_path(name)
    try:
        with open(path) as f:
            is_job = bool(json.load(f).get("job"))
    except (OSError, ValueError):
        return None
    return job_load(path) if is_job else None


def job_load(path: str | Path) -> JobTrait:
    """The job written by ``job.dump(path)`` (or cached by ``state()``), ready to re-attach
    with ``.state()`` or be released with ``.kill()``."""
    import importlib

    rec = _read(Path(path))
    if rec is None:
        raise FileNotFoundError(f"no job file at {path}")
    job = rec.get("job")
    if not job:
        raise JobError(f"{path} is a mesh connection file, not a job; attach with monarch_kernel.actor.attach")
    mod, _, cls = job["class"].rpartition(".")
    if not mod.startswith("monarch_kernel.job."):
        raise JobError(f"{path} names job class {job['class']!r}, which is not one of monarch_kernel.job's")
    klass = getattr(importlib.import_module(mod), cls)
    obj = klass._from_spec(job["spec"], name=rec["name"], lease=rec.get("lease"))
    obj._adopt(rec, Path(path))
    obj._cache = Path(path)
    obj._lease_chosen = bool(job.get("lease_chosen", True))
    return obj
