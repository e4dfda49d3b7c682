"""ProcMesh, ActorMesh and Endpoint: the handles users call.

Handles are cheap views (a MeshView over a shared state). They pickle, so an actor can
hold a mesh and call it; such calls go proc to proc, never through the controller.
"""
from __future__ import annotations

import html
import uuid
from collections.abc import Iterator

from . import wire
from .actors import Actor
from .errors import ActorError, MeshFailure, MeshGoneError, SupervisionError
from .future import Future
from .runtime import PendingCall, ProcRef, Runtime, runtime
from .shape import Extent, MeshView
from .values import ValueMesh

SPAWN_TIMEOUT_S = 120.0
# Called as ``hook(proc_mesh)`` after ``respawn()`` replaced dead procs (features that keep
# per-mesh state on the procs register here, e.g. monarch_kernel.tensor re-forms its group).
RESPAWN_HOOKS: list = []


class ProcMeshState:
    """What a ProcMesh and all its slices share: its procs (index = rank) and actors."""

    def __init__(self, id: str, name: str, key: bytes, labels, sizes, procs: list[ProcRef]):
        self.id, self.name, self.key = id, name, key
        self.labels, self.sizes = tuple(labels), tuple(sizes)
        self.procs = list(procs)
        self.stopped = False
        self.actor_meshes: dict[str, ActorMeshState] = {}
        self.host_mesh = None   # the controller's HostMesh, when this process spawned or attached it

    def __reduce__(self):
        return (_state_from_wire, (self.id, self.name, self.key, self.labels, self.sizes, self.procs))

    def check(self, ranks) -> list[ProcRef]:
        """The procs of ``ranks``, or the error a call to them would meet."""
        if self.stopped:
            raise MeshGoneError(f"proc mesh '{self.name}' was stopped; spawn a new one with "
                                "spawn_procs(...)")
        procs = self.procs
        refs = [procs[r] for r in ranks]
        dead = runtime().dead
        if dead:
            for ref in refs:
                err = dead.get(ref.key)
                if err is not None:
                    raise err
        return refs

    def agents(self) -> dict[str, list[ProcRef]]:
        out: dict[str, list[ProcRef]] = {}
        for ref in self.procs:
            out.setdefault(ref.agent, []).append(ref)
        return out

    def record(self) -> dict:
        return {"name": self.name, "labels": self.labels, "sizes": self.sizes, "procs": self.procs}


def _state_from_wire(id, name, key, labels, sizes, procs):
    rt = runtime()
    st = rt.mesh_states.get(id)
    if st is None:
        st = rt.mesh_states[id] = ProcMeshState(id, name, key, labels, sizes, procs)
        rt.register_procs(procs, key)
        _watch_replacements(rt)
    return st


def _watch_replacements(rt: Runtime):
    if getattr(rt, "_mesh_replace_hook", False):
        return
    rt._mesh_replace_hook = True

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
        """Start one ``actor_class(*args, **kwargs)`` per proc; returns once every
        ``__init__`` has run (a raise there is a SupervisionError naming the rank)."""
        if not (isinstance(actor_class, type) and issubclass(actor_class, Actor)):
            raise TypeError(f"spawn() needs a subclass of monarch_kernel.actor.Actor; got {actor_class!r}. "
                            "Define it as `class MyActor(Actor): ...` with @endpoint methods")
        if not isinstance(name, str) or not name:
            raise TypeError(f"spawn() takes the actor mesh's name first (a str), got {name!r}")
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
        frames = rt.pack(st.key, ("spawn", aid, name, body, view, rt.address, call_id))
        for ref in refs:
            rt.send_frames(ref.work, frames)
        _fail_if_dead(rt, keys, pending)
        try:
            pending.future.get(SPAWN_TIMEOUT_S)
        except ActorError as e:
            ok = [r for r, v in zip(refs, (e.results.values() if e.results else [])) if v is None]
            for ref in ok:
                rt.send(ref.work, st.key, ("stop_actor", aid))
            raise SupervisionError(MeshFailure(name, e.rank, e.host or "", None,
                                               f"actor failed to start: {e.message}"),
                                   f"nothing was spawned.\n\nRemote traceback:\n{e.remote_traceback}") from None
        am = ActorMeshState(aid, name, actor_class.__qualname__, dict(actor_class._endpoints), st, view)
        am.body = body
        st.actor_meshes[aid] = am
        _note_owner(aid, keys)
        hm = st.host_mesh
        if hm is not None:
            hm._register_actor(st, am)
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
                rt.send(ref.ctrl, st.key, ("interrupt", None))

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
            rt.send(ref.ctrl, st.key, ("query", rt.address, call_id))
        try:
            got = dict(zip([r.key for r in live], pending.future.get(timeout).values()))
        except TimeoutError:
            rt.abandon(call_id)
            got = {}
        out = []
        for ref in refs:
            if ref.key in rt.dead or st.stopped:
                out.append({"state": "dead", "pid": ref.pid, "host": ref.host, "rank": ref.rank})
            else:
                out.append(got.get(ref.key, {"state": "unresponsive", "pid": ref.pid, "host": ref.host,
                                             "rank": ref.rank}))
        return ValueMesh(view.extent, out)

    def dead_ranks(self) -> list[int]:
        dead = runtime().dead
        return [r for r in self._view.ranks if self._state.procs[r].key in dead]

    def stop(self) -> None:
        """Stop every proc of this mesh (the whole mesh, even from a slice)."""
        st = self._state
        if st.stopped:
            return
        hm = st.host_mesh
        if hm is None:
            raise MeshGoneError("stop() is for the controller that spawned or attached this mesh")
        hm._stop_proc_mesh(st)

    def respawn(self) -> ProcMesh:
        """Replace dead procs in place, re-creating the actors that lived on them (their
        ``__init__`` runs again with the original arguments). Live ranks keep their state."""
        st = self._state
        hm = st.host_mesh
        if hm is None:
            raise MeshGoneError("respawn() is for the controller that spawned or attached this mesh")
        hm._respawn(st)
        for hook in list(RESPAWN_HOOKS):
            hook(self)
        return self

    def sync_workspace(self, paths=None, **kwargs):
        """Push local code to this mesh's hosts; procs reload it (monarch_kernel.sync)."""
        from ..sync import sync_workspace

        return sync_workspace(self, paths, **kwargs)

    # torch.distributed and distributed tensors (monarch_kernel.tensor, imported on first use)
    def init_process_group(self, backend: str | None = None, timeout: float | None = None) -> ProcMesh:
        """torchrun's env and ``init_process_group`` on every proc (nccl with CUDA, else gloo)."""
        from ..tensor.dist import init_process_group

        return init_process_group(self, backend, timeout)

    def distribute(self, tensor, placements=None):
        """A handle to ``tensor`` laid out over this mesh (``placements``: one Shard(d) or
        Replicate() per mesh dim); each rank holds its local DTensor."""
        from ..tensor.handle import distribute

        return distribute(self, tensor, placements)

    def tensor(self, factory, placements=None):
        """A handle to the tensor ``factory()`` makes on the ranks (rank 0's values), laid out
        by ``placements``."""
        from ..tensor.handle import from_factory

        return from_factory(self, factory, placements)

    @property
    def telemetry(self):
        """SQL over its hosts' samples, proc events, calls and cells; its logs
        (monarch_kernel.telemetry): ``mesh.telemetry.query("select ... from samples")``."""
        from ..telemetry.view import MeshTelemetry

        return MeshTelemetry(self._state)

    def __repr__(self):
        return f"<ProcMesh '{self.name}' {self._view.describe()}{_dead_note(self)}>"

    def _repr_html_(self):
        from .reprs import proc_mesh_html

        return proc_mesh_html(self)


def _dead_note(pm: ProcMesh) -> str:
    if pm._state.stopped:
        return " (stopped)"
    d = pm.dead_ranks()
    return f" (dead ranks: {d})" if d else ""


class ActorMeshState:
    def __init__(self, id, name, class_name, endpoints, proc_state: ProcMeshState, view: MeshView):
        self.id, self.name, self.class_name = id, name, class_name
        self.endpoints: dict = endpoints
        self.proc_state = proc_state
        self.view = view
        self.stopped = False
        self.body: bytes | None = None   # the pickled (class, args, kwargs): re-sent by respawn

    def __reduce__(self):
        return (_am_from_wire, (self.id, self.name, self.class_name, self.endpoints, self.proc_state,
                                self.view))

    def record(self) -> dict:
        return {"name": self.name, "class_name": self.class_name, "endpoints": self.endpoints,
                "view": self.view, "body": self.body}


def _am_from_wire(id, name, class_name, endpoints, proc_state, view):
    am = proc_state.actor_meshes.get(id)
    if am is None:
        am = proc_state.actor_meshes[id] = ActorMeshState(id, name, class_name, endpoints, proc_state, view)
    return am


class ActorMesh(_Sliceable):
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
            return Endpoint(self, name)
        eps = ", ".join(sorted(st.endpoints)) or "none"
        raise AttributeError(f"actor mesh '{st.name}' ({st.class_name}) has no endpoint {name!r}; "
                             f"its endpoints are: {eps}. Mark methods with @endpoint to call them")

    def __dir__(self):
        return sorted(set(super().__dir__()) | set(self._state.endpoints))

    def stop(self) -> None:
        st = self._state
        if st.stopped:
            return
        st.stopped = True
        rt = runtime()
        ps = st.proc_state
        for r in st.view.ranks:
            ref = ps.procs[r]
            if ref.key not in rt.dead and not ps.stopped:
                rt.send(ref.work, ps.key, ("stop_actor", st.id))
        # Stopped means gone: from this controller's listing and from the agents' registry,
        # so a controller that attaches later does not see it either.
        ps.actor_meshes.pop(st.id, None)
        hm = getattr(ps, "host_mesh", None)
        if hm is not None and not ps.stopped:
            hm._register_actor(ps, st, forget=True)

    def __repr__(self):
        return f"<ActorMesh '{self.name}' {self._state.class_name} {self._view.describe()}>"

    def _repr_html_(self):
        from .reprs import actor_mesh_html

        return actor_mesh_html(self)


class Endpoint:
    """``mesh.method``: call it with an adverb (``call``, ``call_one``, ``choose``,
    ``stream``, ``broadcast``)."""

    __slots__ = ("_mesh", "_name")

    def __init__(self, mesh: ActorMesh, name: str):
        self._mesh, self._name = mesh, name

    def __call__(self, *a, **k):
        raise TypeError(f"call an endpoint with an adverb: {self._name}.call(...) (all members, a "
                        f"ValueMesh), .call_one(...) (a single member), .choose(...), .stream(...) "
                        f"or .broadcast(...)")

    def _send(self, ranks, extent, mode, args, kwargs, reply=True) -> PendingCall | None:
        am = self._mesh._state
        ps = am.proc_state
        rt = runtime()
        if rt._unhandled and rt.role == "controller":
            rt.raise_unhandled()
        if am.stopped:
            raise MeshGoneError(f"actor mesh '{am.name}' was stopped")
        refs = ps.check(ranks)
        keys = [r.key for r in refs]
        what = f"{am.name}.{self._name}"
        if reply:
            call_id, pending = rt.new_call(keys, extent, mode, what)
        else:
            call_id, pending = 0, None
        msg = ("call", am.id, self._name, args, kwargs, rt.address, call_id, wire.SOURCES)
        try:
            frames = rt.pack(ps.key, msg, [r.work for r in refs])
        except BaseException as e:
            if reply:
                rt.abandon(call_id)
            _explain_unpicklable(e, args, kwargs, am.endpoints.get(self._name, (False, ()))[1], what)
            raise
        for ref in refs:
            rt.send_frames(ref.work, frames)
        if pending is not None:
            _fail_if_dead(rt, keys, pending)
        return pending

    def call(self, *args, **kwargs) -> Future[ValueMesh]:
        """Every member; a Future of a ValueMesh shaped like the mesh."""
        view = self._mesh._view
        return self._send(view.ranks, view.extent, "mesh", args, kwargs).future

    def call_one(self, *args, **kwargs) -> Future:
        view = self._mesh._view
        if len(view) != 1:
            raise ValueError(f"call_one needs a mesh of exactly 1 member; '{self._mesh.name}' has "
                             f"{len(view)} ({view.describe()}). Slice it first, e.g. "
                             f"mesh.slice({view.labels[0] if view.labels else 'gpus'}=0), or use call()")
        return self._send(view.ranks, view.extent, "one", args, kwargs).future

    def choose(self, *args, **kwargs) -> Future:
        """One member, the least busy (fewest calls of ours in flight)."""
        rt = runtime()
        ps = self._mesh._state.proc_state
        live = [r for r in self._mesh._view.ranks if ps.procs[r].key not in rt.dead]
        if not live:
            ps.check(self._mesh._view.ranks)
        out = rt.outstanding
        best = min(live, key=lambda r: out.get(ps.procs[r].key, 0))
        return self._send([best], Extent((), ()), "one", args, kwargs).future

    def stream(self, *args, **kwargs) -> Iterator:
        """Every member; yields each value as it arrives (an ActorError as it arrives)."""
        view = self._mesh._view
        pending = self._send(view.ranks, view.extent, "stream", args, kwargs)

        def results():
            while True:
                item = pending.queue.get()
                if item is None:
                    return
                ok, value = item
                if not ok:
                    raise value
                yield value

        return results()

    def broadcast(self, *args, **kwargs) -> None:
        """Every member, fire and forget; a failure surfaces on a later interaction."""
        view = self._mesh._view
        self._send(view.ranks, view.extent, "mesh", args, kwargs, reply=False)


def _fail_if_dead(rt: Runtime, keys, pending):
    """A proc that died between our check and our send: fail its part now."""
    dead = rt.dead
    if dead:
        for k in keys:
            if k in dead:
                pending.deliver(k, False, dead[k])


def _init_params(cls) -> tuple:
    from .actors import endpoint_signature

    return endpoint_signature(cls.__init__)[1]


def _pack_args(pack, msg, args, kwargs, params, what):
    """Pickle ``msg``; if that fails, name the argument that cannot be sent and its type."""
    try:
        return pack(msg)
    except Exception as e:
        _explain_unpicklable(e, args, kwargs, params, what)
        raise


def _explain_unpicklable(e: BaseException, args, kwargs, params, what) -> None:
    """After pickling failed: raise a TypeError naming the argument to blame and its type."""
    if not isinstance(e, Exception):
        return
    named = [(params[i] if i < len(params) else f"#{i}", a) for i, a in enumerate(args)]
    for name, value in [*named, *kwargs.items()]:
        if not _picklable(value):
            raise TypeError(f"{what}: argument {name!r} ({type(value).__module__}.{type(value).__qualname__}) "
                            f"cannot be sent to the mesh: it cannot be pickled ({e}). Send plain data, "
                            "tensors, or picklable objects instead") from None
    raise TypeError(f"{what}: the message cannot be pickled: {e}") from e


def _picklable(obj) -> bool:
    try:
        wire.dumps(obj)
        return True
    except Exception:
        return False


def _note_owner(aid: str, keys) -> None:
    """Inside an actor: remember who spawned this mesh, for __supervise__."""
    from .context import _CTX

    ctx = _CTX.get()
    if ctx is None:
        return
    import workers.proc as proc_mod

    worker = proc_mod.WORKER
    if worker is not None:
        worker.owned[aid] = (ctx.actor_instance.actor_id, set(keys))


def _esc(s) -> str:
    return html.escape(str(s))
