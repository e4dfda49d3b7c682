"""HostMesh: a set of host agents, and the ways to get one.

  this_host()           a private agent on this machine; it ends with this process
  this_host("name")     a persistent local mesh called "name": attach if it runs, else start it
  attach("name")        a running named mesh (from its connection file)
  attach_to_workers([addr, ...], key=...)   agents started by hand on other hosts
"""
from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import uuid

from .. import config
from . import fanout, host_recovery, silent_procs
from .connection import (
    agent_alive,
    check_name,
    connection_path,
    new_key,
    read_connection_file,
)
from .errors import HostUnreachableError, MeshFailure, MeshGoneError, MonarchError
from .extensions import start_local_agent
from .future import Future
from .mesh import ActorMeshState, ProcMesh, ProcMeshState, _watch_replacements
from .runtime import ProcRef, pid_alive, pid_space, runtime
from .shape import Extent

log = logging.getLogger("monarch_kernel")

DEFAULT_LEASE_S = config.LEASE_S.get()
HELLO_TIMEOUT_S = 10.0


class HostMesh:
    """Host agents you can spawn procs on; dims ``{"hosts": H}``."""

    def __init__(self, agents: list[dict], key: bytes, name: str, *, local: bool = False,
                 persistent: bool = False, process=None):
        self.name = name
        self._agents = agents
        self._key = key
        self._local = local
        self.persistent = persistent
        self._process = process
        self._proc_meshes: dict[str, ProcMeshState] = {}
        self._detached = False
        rt = runtime()
        rt.keyring.add(key)
        _watch_replacements(rt)
        from .controllers import install as install_controllers

        install_controllers(rt)
        futs = [rt.agent_request(a["addr"], key, "hello", rt.contact, rt.whoami()) for a in agents]
        self._infos = []
        for a, f in zip(agents, futs):
            try:
                self._infos.append(f.get(HELLO_TIMEOUT_S))
            except TimeoutError:
                raise MeshGoneError(f"host agent at {a['addr']} did not answer within {HELLO_TIMEOUT_S:.0f} s "
                                    "(is it running, and is the key right?)") from None
        for a, info in zip(agents, self._infos):
            local = info.get("pid_space") and info.get("pid_space") == pid_space()
            rt.watch_agent(a["addr"], key, info.get("pid") if local else None, info.get("host", ""))
            fanout.learn_agent(rt, info.get("addr") or a["addr"], info)   # its procs' ProcRef.agent
        rt.on_agent_event("superseded", _superseded)
        self._adopt_registry()

    # ------------------------------------------------------------------ shape
    @property
    def extent(self) -> Extent:
        return Extent(("hosts",), (len(self._agents),))

    def __len__(self):
        return len(self._agents)

    @property
    def hosts(self) -> list[str]:
        return [i["host"] for i in self._infos]

    @property
    def initialized(self) -> Future:
        """Monarch's ``await hosts.initialized``: ours is connected when it is returned."""
        f: Future = Future(f"host mesh '{self.name}'")
        f.set_result(True)
        return f

    async def __aenter__(self) -> HostMesh:
        return self

    async def __aexit__(self, *exc) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ procs
    def spawn_procs(self, per_host: dict | None = None, bootstrap=None, name: str | None = None,
                    proc_bind=None, bootstrap_command=None) -> ProcMesh:
        """Fork procs on every host from its warm zygote, e.g. ``per_host={"gpus": 4}``.
        Monarch's defaults: with no ``per_host`` (or ``{}``), one proc per host
        (``%mesh connect`` instead starts one per GPU, else per core: ``default_per_host()``).
        ``bootstrap``: a function run on every new proc before it is returned.
        ``proc_bind``/``bootstrap_command`` (CPU binding, a custom launch command) are not
        supported here: they raise rather than be ignored."""
        self.check_attached()
        if proc_bind is not None or bootstrap_command is not None:
            raise NotImplementedError("proc_bind and bootstrap_command are not supported: procs fork from "
                                      "the host agent's warm zygote. Use with_python_executable() for "
                                      "another interpreter, or bootstrap= for per-proc setup")
        if per_host is None:
            per_host = {}
        if not isinstance(per_host, dict):
            raise TypeError(f"per_host must be a dict of dim name -> size, e.g. {{'gpus': 4}}; got {per_host!r}")
        for k, v in per_host.items():
            if not isinstance(k, str) or not k.isidentifier():
                raise ValueError(f"dimension name {k!r} must be an identifier like 'gpus'")
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"per_host[{k!r}] must be a positive int, got {v!r}")
        name = name or "procs"
        per = 1
        for v in per_host.values():
            per *= v
        if self._local and len(self._agents) == 1:
            labels, sizes = tuple(per_host), tuple(per_host.values())
        else:
            if "hosts" in per_host:
                raise ValueError("'hosts' is the host dim of a multi-host mesh; name per-host dims otherwise")
            labels, sizes = ("hosts", *per_host), (len(self._agents), *per_host.values())
        mesh_id = uuid.uuid4().hex[:12]
        rt = runtime()
        futs = [rt.agent_request(a["addr"], self._key, "spawn", mesh_id, name,
                                 list(range(h * per, (h + 1) * per)), labels, sizes, rt.contact)
                for h, a in enumerate(self._agents)]
        refs: list[ProcRef] = []
        try:
            for (a, info), f in zip(self.agents_and_infos(), futs, strict=True):
                try:
                    refs.extend(_spawned(rt, a["addr"], info.get("host") or a["addr"], self._key, f, name))
                except HostUnreachableError as e:
                    raise MeshGoneError(f"cannot spawn proc mesh '{name}' on host mesh '{self.name}': {e}. "
                                        f"{self._restart_hint()}") from None
        except BaseException:
            # One host refused or failed: the others must not keep (or go on forking) their share.
            for a in self._agents:
                rt.agent_send(a["addr"], self._key, "abort_spawn", mesh_id)
            raise
        refs.sort(key=lambda r: r.rank)
        st = ProcMeshState(mesh_id, name, self._key, labels, sizes, refs)
        st.host_mesh = self
        rt.mesh_states[mesh_id] = st
        rt.register_procs(refs, self._key)
        self._proc_meshes[mesh_id] = st
        for a in self._agents:
            rt.agent_send(a["addr"], self._key, "register", mesh_id, st.record())
        pm = ProcMesh(st)
        if bootstrap is not None:
            from .bootstrap import run_bootstrap

            run_bootstrap(pm, bootstrap)
        return pm

    def with_python_executable(self, python_executable: str) -> HostMesh:
        """A new private host mesh on this machine whose procs run ``python_executable``
        (it needs monarch_kernel importable). Only for this machine's mesh: remote hosts
        run the interpreter their agent was started with."""
        if not self._local or len(self._agents) != 1:
            raise NotImplementedError("with_python_executable() works on this machine's mesh only; start the "
                                      "remote agents with the interpreter you want (python -m workers.agent)")
        if not (os.path.isfile(python_executable) and os.access(python_executable, os.X_OK)):
            raise ValueError(f"with_python_executable: {python_executable!r} is not an executable file")
        key = new_key()
        agent, proc = start_local_agent(key, name=f"private-{os.getpid()}-{uuid.uuid4().hex[:6]}", persistent=False,
                                        python=python_executable)
        hm = HostMesh([agent], key, f"{self.name}+{os.path.basename(python_executable)}", local=True,
                      process=proc)
        _named[hm.name] = hm
        atexit.register(_shutdown_quietly, hm)
        return hm

    def proc_mesh(self, name: str = "procs") -> ProcMesh:
        """A proc mesh that already runs on these hosts (e.g. after ``attach``)."""
        found = [s for s in self._proc_meshes.values() if s.name == name and not s.stopped]
        if not found:
            have = sorted({s.name for s in self._proc_meshes.values() if not s.stopped})
            raise KeyError(f"no proc mesh named {name!r} on '{self.name}' (it has: {', '.join(have) or 'none'}); "
                           "create one with spawn_procs(...)")
        return ProcMesh(found[-1])

    @property
    def proc_meshes(self) -> dict[str, ProcMesh]:
        return {s.name: ProcMesh(s) for s in self._proc_meshes.values() if not s.stopped}

    def status(self) -> list[dict]:
        """One row per proc: host, mesh, rank, pid, state, CPU %, RSS bytes."""
        rt = runtime()
        futs = [rt.agent_request(a["addr"], self._key, "status") for a in self._agents]
        rows = []
        for f in futs:
            rows.extend(f.get(10))
        return rows

    def preload(self, *modules: str, timeout: float = 600.0) -> dict[str, float]:
        """Import ``modules`` once on each host, in the zygote its procs are forked from, so
        every proc spawned (or respawned) after this starts with them loaded: at 256 ranks a
        cell's ``import matplotlib.pyplot`` costs ~0.5 s of CPU a rank, here once a host, and
        their memory is shared. Procs already running import them on first use, as before.
        Returns {host: seconds}. A module that cannot be imported on some host is a
        ValueError naming it, the host and why; the others are loaded all the same.
        (``MONARCH_KERNEL_PRELOAD`` does the same as the agents start.)"""
        names = config.module_names(modules)
        if not names:
            raise ValueError("preload() needs module names, e.g. preload('numpy', 'matplotlib.pyplot')")
        rt = runtime()
        futs = [rt.agent_request(a["addr"], self._key, "preload", names) for a in self._agents]
        took, failed = {}, []
        for f in futs:
            ans = f.get(timeout)
            took[ans["host"]] = ans["seconds"]
            failed += [f"{name} on host {ans['host']}: {why}" for name, why in ans["failed"].items()]
        if failed:
            raise ValueError(f"could not preload {len(failed)} module(s) (the rest are loaded): " + "; ".join(failed)
                             + ". Install them on the hosts (or `%mesh sync --env`), or fix the name.")
        return took

    # ------------------------------------------------------------------ lifecycle
    def detach(self) -> None:
        """Leave the mesh running (a persistent one waits for its lease) and let go of it."""
        if self._detached:
            return
        rt = runtime()
        futs = [rt.agent_request(a["addr"], self._key, "detach") for a in self._agents]
        for f in futs:
            try:
                f.get(5)
            except Exception:
                pass
        self.forget()

    def shutdown(self) -> None:
        """Stop every proc and the agents themselves."""
        if self._detached:
            return
        rt = runtime()
        futs = [rt.agent_request(a["addr"], self._key, "shutdown") for a in self._agents]
        for f in futs:
            try:
                f.get(10)
            except Exception:
                pass
        for st in self._proc_meshes.values():
            self._mark_stopped(st, "the host mesh was shut down")
        self.forget()
        if self._process is not None:
            try:
                self._process.wait(5)
            except Exception:
                self._process.kill()
                self._process.wait()

    def forget(self) -> None:
        """Let go of this handle without asking the agents anything (they are gone, or a
        job owns them): no more heartbeats, and its name is free again."""
        self._detached = True
        rt = runtime()
        for a in self._agents:
            rt.forget_agent(a["addr"])
        _named.pop(self.name, None)

    def _restart_hint(self) -> str:
        if self.persistent and self._local:
            return (f"If its agent is gone, this_host({self.name!r}) starts a new one (the old procs' state "
                    "is lost)")
        return "If its agent is gone, start a new one and spawn again (the old procs' state is lost)"

    def agents_gone(self) -> bool:
        """Is every agent of this mesh a process of this machine that no longer runs?"""
        pids = [i.get("pid") if i.get("pid_space") == pid_space() else None for i in self._infos]
        return bool(pids) and all(p is not None and not pid_alive(p) for p in pids)

    def check_attached(self) -> None:
        """Raise MeshGoneError if this handle was detached or shut down."""
        if self._detached:
            raise MeshGoneError(f"host mesh '{self.name}' was detached or shut down; "
                                f"attach({self.name!r}) to use it again")

    # ------------------------------------------------------------------ for ProcMesh and features
    @property
    def mesh_key(self) -> bytes:
        """The key its agents were started with (signs every request to them)."""
        return self._key

    def agents_and_infos(self) -> list[tuple[dict, dict]]:
        """Per agent: its address record and what it said when we attached (host, pid, ...)."""
        return list(zip(self._agents, self._infos, strict=True))

    @property
    def detached(self) -> bool:
        return self._detached

    @property
    def local_process(self):
        """The agent's process when this process started it (a Popen), else None."""
        return self._process
    def register_actor_mesh(self, st: ProcMeshState, am: ActorMeshState, forget: bool = False) -> None:
        rt = runtime()
        for addr in st.agents():
            rt.agent_send(addr, self._key, "register_actor", st.id, am.id, None if forget else am.record())

    def _mark_stopped(self, st: ProcMeshState, why: str) -> None:
        rt = runtime()
        st.stopped = True
        for ref in st.procs:
            rt.proc_failed(ref.key, MeshFailure(st.name, ref.rank, ref.host, ref.pid, why, ref.key),
                           hint="spawn a new proc mesh")

    def stop_proc_mesh(self, st: ProcMeshState) -> None:
        rt = runtime()
        futs = [rt.agent_request(addr, self._key, "stop", [r.key for r in refs])
                for addr, refs in st.agents().items()]
        for f in futs:
            f.get(15)
        self._mark_stopped(st, "the proc mesh was stopped")
        rt.forget_procs(st.procs)
        for addr in st.agents():
            rt.agent_send(addr, self._key, "register", st.id, None)

    def respawn_dead(self, st: ProcMeshState) -> None:
        """Replace the dead procs of ``st`` on their live hosts, with their actors."""
        host_recovery.respawn_dead(st, self._key, self._restart_hint())

    def _adopt_registry(self) -> None:
        """On attach: rebuild handles for the proc and actor meshes the agents know."""
        for st in host_recovery.adopt_registry(self, self._infos, self._key):
            self._proc_meshes[st.id] = st

    def __repr__(self):
        kind = "persistent" if self.persistent else "private"
        return f"<HostMesh '{self.name}' hosts={len(self._agents)} ({kind})>"

    def _repr_html_(self):
        from .reprs import host_mesh_html

        return host_mesh_html(self)


def _superseded(link, by) -> None:
    log.warning("another controller (%s) attached to %s; this one no longer receives its events", by, link.addr)


_named: dict[str, HostMesh] = {}
_lock = threading.Lock()


def named_host_mesh(name: str) -> HostMesh | None:
    """The host mesh this process knows by ``name`` (this_host(name), attach(name), a job's)."""
    return _named.get(name)


def remember_host_mesh(name: str, hm: HostMesh) -> None:
    """Know ``hm`` by ``name`` from now on (a job's meshes, so attach(name) finds them)."""
    _named[name] = hm


def this_host(name: str | None = None, *, lease: float | None = None) -> HostMesh:
    """This machine as a HostMesh.

    With no name: a private agent that ends when this process ends. With a name: a
    persistent mesh that outlives this process (re-attach with ``attach(name)`` or
    ``this_host(name)``) and stops after ``lease`` seconds with no controller attached.
    """
    key_name = name or f"private-{os.getpid()}"
    with _lock:
        hm = _named.get(key_name)
        if hm is not None and not hm._detached:
            if not hm.agents_gone():
                return hm
            log.warning("the agent of host mesh '%s' is gone: starting a new one", key_name)
            _forget_gone(hm)
        if name is not None:
            check_name(name)
            try:
                info = read_connection_file(name)
                if agent_alive(info):
                    hm = _named[name] = _attach_info(name, info)
                    return hm
                connection_path(name).unlink(missing_ok=True)
            except MeshGoneError:
                pass
            key = new_key()
            agent, proc = start_local_agent(key, name=name, persistent=True,
                                            lease=DEFAULT_LEASE_S if lease is None else lease,
                                            conn_file=connection_path(name))
            hm = HostMesh([agent], key, name, local=True, persistent=True, process=proc)
        else:
            key = new_key()
            agent, proc = start_local_agent(key, name=key_name, persistent=False, lease=lease)
            hm = HostMesh([agent], key, key_name, local=True, process=proc)
            atexit.register(_shutdown_quietly, hm)
        _named[key_name] = hm
        return hm


SPAWN_TIMEOUT_S = 120.0
ZYGOTE_LOOK_S = 3.0   # a host's share of a spawn not done by then: can its zygote fork?


def _spawned(rt, addr: str, host: str, key: bytes, fut, name: str) -> list:
    """A host's share of a spawn (its procs' refs), waited for up to SPAWN_TIMEOUT_S. Every few
    seconds it is not done, its agent is asked about its zygote: one stopped by a signal or
    held by a debugger forks nothing until someone lets it go, so the spawn fails at once
    with what to do (it waited, silent, for as long as the zygote was stopped)."""
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    look, last = ZYGOTE_LOOK_S, None   # (the zygote's state at the look before)
    while True:
        try:
            return fut.get(max(0.0, min(look, deadline - time.monotonic())))
        except TimeoutError:
            pass
        try:
            pid, state = rt.agent_request(addr, key, "zygote_state").get(2)
        except Exception:   # (an agent that cannot say: the spawn waits on)
            pid, state = None, None
        # Held twice in a row, half a second apart (a `py-spy dump` stops a process for a moment).
        held = state in silent_procs.WHY
        look = 0.5 if held and state != last else ZYGOTE_LOOK_S
        if held and state == last or state == "gone":
            words = "has exited" if state == "gone" else silent_procs.why(state, pid)
            if state != "disk-sleep" or time.monotonic() >= deadline:
                raise MonarchError(f"cannot spawn proc mesh '{name}' on host {host}: its zygote (pid {pid}, "
                                   f"the process that forks its procs) is {words}")
        last = state
        if time.monotonic() >= deadline:
            raise MonarchError(f"spawn of proc mesh '{name}' did not finish within {SPAWN_TIMEOUT_S:.0f} s on "
                               f"host {host}" + (f" (its zygote, pid {pid}, is {state})" if state else ""))


def _forget_gone(hm: HostMesh) -> None:
    """Let go of a mesh whose agents died: its proc meshes are stopped, its link closed."""
    for st in hm._proc_meshes.values():
        if not st.stopped:
            hm._mark_stopped(st, "its host agent is gone")
    hm.forget()
    if hm._process is not None:
        hm._process.poll()


def _shutdown_quietly(hm: HostMesh) -> None:
    try:
        hm.shutdown()
    except Exception:
        pass


def attach(name: str) -> HostMesh:
    """Attach to the running mesh called ``name``: same procs, same actors, same state."""
    with _lock:
        hm = _named.get(name)
        if hm is not None and not hm._detached:
            if not hm.agents_gone():
                return hm
            _forget_gone(hm)
        info = read_connection_file(check_name(name))
        if not agent_alive(info):
            connection_path(name).unlink(missing_ok=True)
            raise MeshGoneError(f"mesh {name!r} is gone: its agent (pid {info['agents'][0].get('pid')}) no "
                                f"longer runs. Start it again with this_host({name!r}) or %mesh connect {name}")
        hm = _named[name] = _attach_info(name, info)
        return hm


def _attach_info(name: str, info: dict) -> HostMesh:
    return HostMesh(info["agents"], bytes.fromhex(info["key"]), name, local=len(info["agents"]) == 1,
                    persistent=bool(info.get("persistent")))
