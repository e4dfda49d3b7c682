"""ProcMesh, ActorMesh and Endpoint: the handles users call.

Handles are cheap views (a MeshView over a shared state). They pickle, so an actor can
hold a mesh and call it; such calls go proc to proc, never through the controller.
"""
from __future__ import annotations

import html
import logging
import threading
import time
import uuid
from operator import attrgetter
from typing import Generic, TypeVar

from . import fanout, silent_procs, wire
from .actors import Actor, plain_methods
from .channels import chained
from .endpoint import (
    Endpoint,
    NotAnEndpoint,
    _applied,
    _consume_unhandled,
    _done,
    _fail_if_dead,
    _failed,
    _init_params,
    _pack_args,
    _quiet,
    _wait_initialized,
)
from .errors import ActorError, MeshFailure, MeshGoneError, SupervisionError
from .extensions import install_proc_mesh_members, respawn_hooks
from .future import Future
from .messages import Interrupt, LoggingOption, Query, Spawn, StopActor
from .runtime import ProcRef, Runtime, runtime
from .shape import Extent, MeshView
from .values import ValueMesh

T = TypeVar("T")
# Actor meshes the controller spawned since a notebook cell began (jupyter/spawn_check.py
# waits on them at the cell's end, so a failed __init__ shows under the cell that spawned it).
# None (not kept) outside a notebook.
recent_spawns: list | None = None


class ProcList(list):
    """A proc mesh's procs (index = rank) that counts its changes (``gen``: a respawn
    replaces members in place), so what a call to a view needs is kept per view
    (``ProcMeshState.members``)."""

    __slots__ = ("gen",)

    def __init__(self, procs=()):
        super().__init__(procs)
        self.gen = 0

    def __reduce__(self):
        return (ProcList, (list(self),))


def _counted(name: str):
    change = getattr(list, name)

    def counted(self, *args, **kwargs):
        self.gen += 1
        return change(self, *args, **kwargs)

    counted.__name__ = name
    return counted


for _name in ("__setitem__", "__delitem__", "__iadd__", "__imul__", "append", "extend", "insert", "pop", "remove",
              "clear", "sort", "reverse"):
    setattr(ProcList, _name, _counted(_name))

_KEY = attrgetter("key")


class ProcMeshState:
    """What a ProcMesh and all its slices share: its procs (index = rank) and actors."""

    def __init__(self, id: str, name: str, key: bytes, labels, sizes, procs: list[ProcRef]):
        self.id, self.name, self.key = id, name, key
        self.labels, self.sizes = tuple(labels), tuple(sizes)
        self.procs = ProcList(procs)
        self.stopped = False
        self.actor_meshes: dict[str, ActorMeshState] = {}
        self.host_mesh = None   # the controller's HostMesh, when this process spawned or attached it
        self._members: dict[int, tuple] = {}   # id(ranks) -> (ranks, procs.gen, refs, keys): members()

    def __reduce__(self):
        return (_state_from_wire, (self.id, self.name, self.key, self.labels, self.sizes, list(self.procs)))

    def check(self, ranks) -> list[ProcRef]:
        """The procs of ``ranks``, or the error a call to them would meet."""
        return self.members(ranks)[0]

    def members(self, ranks) -> tuple[list[ProcRef], list[str]]:
        """``check(ranks)`` and their keys. Read-only lists, kept per ``ranks`` (a view's
        tuple) until a member is replaced: a call to all lists the same members each time,
        and listing 256 of them and their keys again took ~30 µs."""
        if self.stopped:
            raise MeshGoneError(f"proc mesh '{self.name}' was stopped; spawn a new one with "
                                "spawn_procs(...)")
        procs = self.procs
        kept = self._members.get(id(ranks))
        if kept is not None and kept[0] is ranks and kept[1] == procs.gen:
            refs, keys = kept[2], kept[3]
        else:
            refs = list(map(procs.__getitem__, ranks))
            keys = list(map(_KEY, refs))
            if len(self._members) >= 64:
                self._members.clear()
            self._members[id(ranks)] = (ranks, procs.gen, refs, keys)   # (holding ranks keeps its id taken)
        dead = runtime().dead
        if dead:
            for ref in refs:
                err = dead.get(ref.key)
                if err is not None:
                    raise err
        return refs, keys

    def agents(self) -> dict[str, list[ProcRef]]:
        out: dict[str, list[ProcRef]] = {}
        for ref in self.procs:
            out.setdefault(ref.agent, []).append(ref)
        return out

    def record(self) -> dict:
        return {"name": self.name, "labels": self.labels, "sizes": self.sizes, "procs": list(self.procs)}


def _state_from_wire(id, name, key, labels, sizes, procs):
    rt = runtime()
    st = rt.mesh_states.get(id)
    if st is None:
        st = rt.mesh_states[id] = ProcMeshState(id, name, key, labels, sizes, procs)
        rt.register_procs(procs, key)
        _watch_replacements(rt)
    return st


def _watch_replacements(rt: Runtime):
    if not rt.once("proc mesh states follow replaced procs"):
        return

    def on_replaced(old_key: str, ref: ProcRef):
        for st in list(rt.mesh_states.values()):
            if ref.rank < len(st.procs) and st.procs[ref.rank].key == old_key:
                st.procs[ref.rank] = ref

    rt.replace_listeners.append(on_replaced)


class _Sliceable:
    """Named-dimension views shared by ProcMesh and ActorMesh."""

    _view: MeshView

    def _with_view(self, view: MeshView):
        raise NotImplementedError

    def slice(self, **selection):
        """``mesh.slice(gpus=slice(0, 2))``; an int drops the dim: ``mesh.slice(gpus=1)``."""
        return self._with_view(self._view.slice(**selection))

    def flatten(self, name: str):
        return self._with_view(self._view.flatten(name))

    def rename(self, **mapping):
        return self._with_view(self._view.rename(**mapping))

    def size(self, dim: str | None = None) -> int:
        return len(self._view) if dim is None else self._view.size(dim)

    @property
    def sizes(self) -> dict:
        return dict(zip(self._view.labels, self._view.sizes))

    @property
    def extent(self) -> Extent:
        return self._view.extent

    def __len__(self):
        return len(self._view)


class ProcMesh(_Sliceable):
    def __init__(self, state: ProcMeshState, view: MeshView | None = None):
        self._state = state
        self._view = view or MeshView(state.labels, state.sizes)

    def _with_view(self, view):
        return ProcMesh(self._state, view)

    def __reduce__(self):
        return (ProcMesh, (self._state, self._view))

    @property
    def name(self) -> str:
        return self._state.name

    def procs(self) -> list[ProcRef]:
        return [self._state.procs[r] for r in self._view.ranks]

    def spawn(self, name: str, actor_class, *args, **kwargs) -> ActorMesh:
        """Start one ``actor_class(*args, **kwargs)`` per proc and return at once, as
        Monarch does. Calls sent meanwhile queue behind ``__init__``; if it raises on a rank,
        the mesh is failed: the next use raises a SupervisionError naming the rank, with the
        remote traceback, and the failure goes to the spawner's ``__supervise__`` (or, from
        the controller, to ``unhandled_fault_hook``). ``mesh.initialized.get()`` waits for
        every ``__init__``; in a notebook, a cell that spawns waits at its end (see README)."""
        if not (isinstance(actor_class, type) and issubclass(actor_class, Actor)):
            raise TypeError(f"spawn() needs a subclass of monarch_kernel.actor.Actor; got {actor_class!r}. "
                            "Define it as `class MyActor(Actor): ...` with @endpoint methods")
        if not isinstance(name, str) or not name:
            raise TypeError(f"spawn() takes the actor mesh's name first (a str), got {name!r}")
        _refuse_colliding_endpoints(actor_class)
        rt = runtime()
        if rt.role == "controller":
            rt.raise_unhandled()
        st, view = self._state, self._view
        refs = st.check(view.ranks)
        aid = uuid.uuid4().hex[:12]
        body = _pack_args(wire.dumps_inband, (actor_class, args, kwargs, wire.SOURCES), args, kwargs,
                          _init_params(actor_class), f"{actor_class.__name__}.__init__")
        keys = [r.key for r in refs]
        call_id, pending = rt.new_call(keys, view.extent, "mesh", f"spawn of '{name}'")
        fanout.send(rt, st.key, Spawn.make(aid, name, body, view, rt.address, call_id, _owner()), refs, 5)
        am = ActorMeshState(aid, name, actor_class.__qualname__, dict(actor_class._endpoints), st, view,
                            plain_methods(actor_class))
        am.body = body
        am.initialized = pending.future
        am.spawn_thread = threading.get_ident()
        st.actor_meshes[aid] = am
        if recent_spawns is not None and rt.role == "controller":
            recent_spawns.append(am)
        _note_owner(aid, keys)
        pending.future.add_done_callback(lambda f: _on_initialized(am, refs, f))
        _fail_if_dead(rt, keys, pending)
        hm = st.host_mesh
        if hm is not None:
            hm.register_actor_mesh(st, am)
        return ActorMesh(am)

    def actor_mesh(self, name: str) -> ActorMesh:
        """The actor mesh most recently spawned (or re-attached) under ``name``."""
        found = [a for a in self._state.actor_meshes.values() if a.name == name and not a.stopped]
        if not found:
            have = sorted({a.name for a in self._state.actor_meshes.values() if not a.stopped})
            raise KeyError(f"no actor mesh named {name!r} on proc mesh '{self.name}' "
                           f"(it has: {', '.join(have) or 'none'})")
        return ActorMesh(found[-1])

    def actor_meshes(self) -> dict[str, ActorMesh]:
        return {a.name: ActorMesh(a) for a in self._state.actor_meshes.values() if not a.stopped}

    def interrupt(self, call: Future | None = None) -> None:
        """Raise KeyboardInterrupt in whatever each proc of this view runs now on its main
        thread (a sync endpoint or a cell); idle procs ignore it."""
        rt = runtime()
        st = self._state
        for r in self._view.ranks:
            ref = st.procs[r]
            if ref.key not in rt.dead and not st.stopped:
                rt.send(ref.ctrl, st.key, Interrupt.make(None))

    def states(self, timeout: float = 5.0) -> ValueMesh:
        """Each proc's state ('idle', 'in Trainer.step', ...), pid, actors: a ValueMesh of
        dicts, answered by the procs' I/O threads even while they run user code. A dead proc
        shows as {'state': 'dead'}."""
        rt = runtime()
        st, view = self._state, self._view
        refs = [st.procs[r] for r in view.ranks]
        live = [r for r in refs if r.key not in rt.dead]
        call_id, pending = rt.new_call([r.key for r in live], Extent(("ranks",), (len(live),)), "mesh",
                                       "state query")
        for ref in live:
            rt.send(ref.ctrl, st.key, Query.make(rt.address, call_id))
        # A proc answers from its I/O thread in a millisecond, unless native code holds its GIL:
        # once some have answered, wait at most a second for the rest, then say which are stuck.
        t0 = time.monotonic()
        while True:
            try:
                got = dict(zip([r.key for r in live], pending.future.get(0.05).values()))
                break
            except TimeoutError:
                waited = time.monotonic() - t0
                if waited >= timeout or (waited >= 1.0 and any(pending.answered)):
                    rt.abandon(call_id)
                    got = {k: pending.results[i] for k, i in pending.index.items() if pending.answered[i]}
                    break
        silent = [r for r in live if r.key not in got and not st.stopped]
        said = silent_procs.os_states(silent, st.key) if silent else {}
        out = []
        for ref in refs:
            if ref.key in rt.dead and not st.stopped and silent_procs.host_silent(rt, ref):
                out.append({"state": "unreachable", "pid": ref.pid, "host": ref.host, "rank": ref.rank,
                            "why": silent_procs.UNREACHABLE})
            elif ref.key in rt.dead or st.stopped:
                out.append({"state": "dead", "pid": ref.pid, "host": ref.host, "rank": ref.rank})
            elif ref.key in got:
                out.append(got[ref.key])
            else:
                os_state = said.get(ref.key)
                out.append({"state": "unresponsive", "pid": ref.pid, "host": ref.host, "rank": ref.rank,
                            "os_state": os_state, "why": silent_procs.why(os_state, ref.pid)})
        return ValueMesh(view.extent, out)

    def dead_ranks(self) -> list[int]:
        dead = runtime().dead
        return [r for r in self._view.ranks if self._state.procs[r].key in dead]

    def stop(self, reason: str = "stopped by client") -> Future[None]:
        """Stop every proc of this mesh (the whole mesh, even from a slice). Done when it
        returns (Monarch's returns at once); the Future it returns is for Monarch code that
        awaits it or calls ``.get()``."""
        st = self._state
        if not st.stopped:
            hm = st.host_mesh
            if hm is None:
                raise MeshGoneError("stop() is for the controller that spawned or attached this mesh")
            hm.stop_proc_mesh(st)
        return _quiet(_done(None, f"stop of '{st.name}'"))

    @property
    def initialized(self) -> Future:
        """Monarch's ``await procs.initialized``: our procs are up when spawn_procs returns."""
        return _done(True, f"proc mesh '{self._state.name}'")

    @property
    def host_mesh(self):
        """The HostMesh these procs run on (None in a process that did not spawn or attach it)."""
        return self._state.host_mesh

    async def __aenter__(self) -> ProcMesh:
        return self

    async def __aexit__(self, *exc) -> None:
        self.stop()

    def logging_option(self, stream_to_client: bool = True, aggregate_window_sec: int | None = None,
                       level: int = logging.INFO) -> Future[None]:
        """Monarch's output options for the procs of this mesh, applied when this returns:
        ``stream_to_client`` sends their stdout/stderr to the controller (ours does by
        default; False leaves it in the procs' log file), ``level`` sets their root logger's
        level. ``aggregate_window_sec`` is accepted and recorded; merging identical lines
        across ranks is not done yet. Returns a Future, so ``await``, ``.get()`` and
        ``asyncio.run(...)`` all work as with Monarch's coroutine."""
        if aggregate_window_sec is not None and not stream_to_client:
            raise ValueError("aggregate_window_sec needs stream_to_client=True (there is nothing to "
                             "aggregate when output is not streamed)")
        if not isinstance(level, int):
            raise TypeError(f"level must be a logging level (an int such as logging.INFO), got {level!r}")
        rt = runtime()
        st = self._state
        live = [st.procs[r] for r in self._view.ranks if st.procs[r].key not in rt.dead]
        st.check(self._view.ranks[:0])
        call_id, pending = rt.new_call([r.key for r in live], Extent(("ranks",), (len(live),)), "mesh",
                                       "logging_option")
        for ref in live:
            rt.send(ref.ctrl, st.key, LoggingOption.make(bool(stream_to_client), aggregate_window_sec, level,
                                                         rt.address, call_id))
        pending.future.get(30)
        return _applied("logging_option")

    def respawn(self) -> ProcMesh:
        """Replace dead procs in place, re-creating the actors that lived on them (their
        ``__init__`` runs again with the original arguments). Live ranks keep their state."""
        st = self._state
        hm = st.host_mesh
        if hm is None:
            raise MeshGoneError("respawn() is for the controller that spawned or attached this mesh")
        hm.respawn_dead(st)
        for hook in respawn_hooks():   # extensions.register_respawn_hook (e.g. tensor re-forms its group)
            hook(self)
        return self

    # Members that reach a feature (sync_workspace, init_process_group, distribute, tensor,
    # telemetry) are added by monarch_kernel/features.py through
    # extensions.register_proc_mesh_member: the core imports no feature.

    def __repr__(self):
        return f"<ProcMesh '{self.name}' {self._view.describe()}{_dead_note(self)}>"

    def _repr_html_(self):
        from .reprs import proc_mesh_html

        return proc_mesh_html(self)



def state_of(mesh):
    """The shared state a ProcMesh or ActorMesh handle views (ProcMeshState /
    ActorMeshState), for features that need it. A function, not an attribute: a name on
    ActorMesh would shadow (and refuse) an endpoint of that name."""
    return mesh._state


def view_of(mesh) -> MeshView:
    """Which ranks (and dims) of its state a ProcMesh or ActorMesh handle selects."""
    return mesh._view

install_proc_mesh_members(ProcMesh)   # what features registered before this module loaded


def _dead_note(pm: ProcMesh) -> str:
    if pm._state.stopped:
        return " (stopped)"
    d = pm.dead_ranks()
    return f" (dead ranks: {d})" if d else ""


class ActorMeshState:
    def __init__(self, id, name, class_name, endpoints, proc_state: ProcMeshState, view: MeshView,
                 methods: tuple = ()):
        self.id, self.name, self.class_name = id, name, class_name
        self.endpoints: dict = endpoints
        self.methods = tuple(methods)   # public non-endpoint methods, for as_endpoint
        self.proc_state = proc_state
        self.view = view
        self.stopped = False
        self.body: bytes | None = None   # the pickled (class, args, kwargs): re-sent by respawn
        self.initialized: Future | None = None   # the spawn, on the process that spawned it
        self.spawn_thread: int | None = None
        self.init_error: BaseException | None = None
        self.failed_ranks: set | None = None   # with init_error: the ranks it is about (None: all)
        self.used = False   # a call was sent: an __init__ failure is reported by that call

    def __reduce__(self):
        if self.initialized is not None and not self.initialized.done():
            _wait_initialized(self)   # whoever gets the handle may call it from elsewhere at once
        return (_am_from_wire, (self.id, self.name, self.class_name, self.endpoints, self.proc_state,
                                self.view, self.methods))

    def record(self) -> dict:
        return {"name": self.name, "class_name": self.class_name, "endpoints": self.endpoints,
                "view": self.view, "body": self.body, "methods": self.methods}


def _am_from_wire(id, name, class_name, endpoints, proc_state, view, methods=()):
    am = proc_state.actor_meshes.get(id)
    if am is None:
        am = proc_state.actor_meshes[id] = ActorMeshState(id, name, class_name, endpoints, proc_state, view,
                                                          methods)
    return am


def _on_initialized(am: ActorMeshState, refs, fut: Future) -> None:
    """The spawn's replies are in (I/O thread, or a thread waiting on it)."""
    e = fut.exception() if fut.done() else None
    if e is None:
        return
    rt = runtime()
    if isinstance(e, ActorError) and e.results is not None:
        # As in Monarch, the ranks whose __init__ ran stay usable through slices without the others.
        am.failed_ranks = {r.rank for r, v in zip(refs, e.results.values()) if v is not None}
        failure = MeshFailure(am.name, e.rank, e.host or "", None, f"actor failed to start: {e.message}")
        err = SupervisionError(failure, f"the actors of its other ranks run: slice them out to use them "
                                        f"(failed: {sorted(am.failed_ranks)}).\n\n"
                                        f"Remote traceback:\n{e.remote_traceback}")
    else:
        err = e
        failure = getattr(e, "failure", None) or MeshFailure(am.name, None, "", None, str(e))
    am.init_error = err
    if am.stopped or am.proc_state.stopped:
        return   # stopped on purpose before __init__ answered: nothing failed
    if rt.role == "controller" and not am.used:
        from .supervision import deliver_unhandled

        deliver_unhandled(failure, err)


class ActorMesh(_Sliceable, Generic[T]):
    def __init__(self, state: ActorMeshState, view: MeshView | None = None):
        object.__setattr__(self, "_state", state)
        object.__setattr__(self, "_view", view or state.view)

    def _with_view(self, view):
        return ActorMesh(self._state, view)

    def __reduce__(self):
        return (ActorMesh, (self._state, self._view))

    @property
    def name(self) -> str:
        return self._state.name

    def __getattr__(self, name: str) -> Endpoint:
        if name.startswith("__"):
            raise AttributeError(name)
        st = self.__dict__.get("_state") or object.__getattribute__(self, "_state")
        if name in st.endpoints:
            ep = self.__dict__[name] = Endpoint(self, name)   # later accesses skip __getattr__
            return ep
        if name in st.methods:
            return NotAnEndpoint(self, name)
        eps = ", ".join(sorted(st.endpoints)) or "none"
        raise AttributeError(f"actor mesh '{st.name}' ({st.class_name}) has no endpoint {name!r}; "
                             f"its endpoints are: {eps}. Mark methods with @endpoint to call them")

    def __dir__(self):
        return sorted(set(super().__dir__()) | set(self._state.endpoints))

    def _least_busy(self) -> ActorMesh:
        """The one-member view of the live member with the fewest calls of ours in flight."""
        rt = runtime()
        ps = self._state.proc_state
        live = [r for r in self._view.ranks if ps.procs[r].key not in rt.dead]
        if not live:
            ps.check(self._view.ranks)
        out = rt.outstanding
        best = min(live, key=lambda r: out.get(ps.procs[r].key, 0))
        return ActorMesh(self._state, MeshView((), (), (best,)))

    @property
    def initialized(self) -> Future[None]:
        """Done once every member's ``__init__`` ran (fails with the SupervisionError of an
        ``__init__`` that raised)."""
        st = self._state
        st.used = True   # who waits on it is told of a failed __init__: not raised again later
        if st.init_error is not None:
            _consume_unhandled(runtime(), st.init_error)
            return _failed(st.init_error, f"spawn of '{st.name}'")
        if st.initialized is None:
            return _done(None, f"spawn of '{st.name}'")
        return chained(st.initialized, lambda _v: None, f"spawn of '{st.name}'")

    def stop(self, reason: str = "stopped by client") -> Future[None]:
        """Stop every member (the whole mesh, even from a slice): each runs
        ``__cleanup__(None)``. Returns at once; the Future is done when all cleaned up."""
        st = self._state
        if st.stopped:
            return _quiet(_done(None, f"stop of '{st.name}'"))
        st.stopped = True
        rt = runtime()
        ps = st.proc_state
        live = [ps.procs[r] for r in st.view.ranks if ps.procs[r].key not in rt.dead and not ps.stopped]
        # Stopped means gone: from this controller's listing and from the agents' registry,
        # so a controller that attaches later does not see it either.
        ps.actor_meshes.pop(st.id, None)
        hm = getattr(ps, "host_mesh", None)
        if hm is not None and not ps.stopped:
            hm.register_actor_mesh(ps, st, forget=True)
        if not live:
            return _quiet(_done(None, f"stop of '{st.name}'"))
        call_id, pending = rt.new_call([r.key for r in live], Extent(("ranks",), (len(live),)), "mesh",
                                       f"stop of '{st.name}'")
        for ref in live:
            rt.send(ref.work, ps.key, StopActor.make(st.id, str(reason), rt.address, call_id))
        return _quiet(chained(pending.future, lambda _v: None, f"stop of '{st.name}'"))

    def __repr__(self):
        return f"<ActorMesh '{self.name}' {self._state.class_name} {self._view.describe()}>"

    def _repr_html_(self):
        from .reprs import actor_mesh_html

        return actor_mesh_html(self)


# ActorMesh's own public names: an endpoint called so would be hidden behind them.
_MESH_ATTRS = frozenset(n for n in dir(ActorMesh) if not n.startswith("_"))


def _refuse_colliding_endpoints(cls) -> None:
    clash = sorted(set(cls._endpoints) & _MESH_ATTRS)
    if clash:
        raise ValueError(f"{cls.__qualname__} has endpoint(s) named {', '.join(map(repr, clash))}, which an "
                         f"ActorMesh already uses ({', '.join('ActorMesh.' + c for c in clash)}): the mesh "
                         "could not reach them. Rename the endpoint(s), e.g. "
                         f"{clash[0]!r} -> {clash[0] + '_'!r}")


def _owner():
    """Who supervises a mesh spawned here: None for the controller, else the spawning
    actor's (work address, key, actor id) so its proc can deliver failures to it."""
    from .context import _CTX

    ctx = _CTX.get()
    if ctx is None or not ctx.actor_instance.actor_id or ctx.actor_instance.actor_id == "client":
        return None
    from .context import proc_worker

    w = proc_worker()
    if w is None:
        return None
    return (w.work_addr, w.key, ctx.actor_instance.actor_id)


def _note_owner(aid: str, keys) -> None:
    """Inside an actor: remember who spawned this mesh, for __supervise__."""
    from .context import _CTX

    ctx = _CTX.get()
    if ctx is None:
        return
    from .context import proc_worker

    worker = proc_worker()
    if worker is not None:
        worker.owned[aid] = (ctx.actor_instance.actor_id, set(keys))


def _esc(s) -> str:
    return html.escape(str(s))
