"""Endpoints: ``mesh.method`` and its adverbs (call, call_one, choose, stream,
broadcast), plus the small Futures and checks they share with mesh.py.

A call is one signed message to each member's work inbox; the replies resolve a
PendingCall in the runtime. Arguments are checked here so a bad one is named before
anything is sent.
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Generic, TypeVar

from . import fanout, wire
from .calls import OneCall
from .errors import MeshGoneError
from .future import Future
from .runtime import PendingCall, Runtime, runtime
from .values import ValueMesh

if TYPE_CHECKING:
    from .mesh import ActorMesh, ActorMeshState

SPAWN_TIMEOUT_S = 120.0
T = TypeVar("T")

def _ready_to_send(am, rt):
    """The checks every send makes first: an unhandled failure to raise, a stopped mesh, a
    spawn still running on another thread (wait for it, so sends are ordered after it).
    Returns the mesh's init error (None when it started), for the caller to match against
    the ranks it sends to."""
    if rt.role == "controller" and rt.has_unhandled():
        rt.raise_unhandled()
    if am.stopped:
        raise MeshGoneError(f"actor mesh '{am.name}' was stopped")
    init = am.initialized
    if init is not None and not init.done() and threading.get_ident() != am.spawn_thread:
        _wait_initialized(am)   # another thread's sends are not ordered after the spawn
    am.used = True
    return am.init_error


def _wait_initialized(am: ActorMeshState) -> None:
    try:
        am.initialized.get(SPAWN_TIMEOUT_S)
    except Exception:
        pass   # recorded in am.init_error by _on_initialized


class Endpoint(Generic[T]):
    """``mesh.method``: call it with an adverb (``call``, ``call_one``, ``choose``,
    ``stream``, ``broadcast``)."""

    __slots__ = ("_mesh", "_name", "_explicit", "_method", "_what", "_one")

    def __init__(self, mesh: ActorMesh, name: str, explicit: bool = False):
        self._mesh, self._name, self._explicit = mesh, name, explicit
        self._method = EXPLICIT_PORT_MARK + name if explicit else name
        self._what = f"{mesh._state.name}.{name}"
        self._one: int | None = None   # call_one: the rank of the mesh's only member, once checked

    def __call__(self, *a, **k):
        raise TypeError(f"call an endpoint with an adverb: {self._name}.call(...) (all members, a "
                        f"ValueMesh), .call_one(...) (a single member), .choose(...), .stream(...) "
                        f"or .broadcast(...)")

    def _send(self, ranks, extent, mode, args, kwargs, reply=True, port=None) -> PendingCall | None:
        am = self._mesh._state
        ps = am.proc_state
        rt = runtime()
        err = _ready_to_send(am, rt)
        if err is not None and (am.failed_ranks is None or not am.failed_ranks.isdisjoint(ranks)):
            _consume_unhandled(rt, err)
            raise err
        refs, keys = ps.members(ranks)   # (read-only: kept for the next call)
        what = self._what
        if reply:
            call_id, pending = rt.new_call(keys, extent, mode, what)
        else:
            call_id, pending = port or 0, None
        # messages.Call as a literal, in field order: the hot path of every call
        msg = ("call", am.id, self._method, args, kwargs, rt.address, call_id, wire.SOURCES)
        try:
            fanout.send(rt, ps.key, msg, refs, 5)   # one message per host past a few members
        except BaseException as e:
            if reply:
                rt.abandon(call_id)
            _explain_unpicklable(e, args, kwargs, am.endpoints.get(self._name, (False, ()))[1], what)
            raise
        if pending is not None and rt.dead:
            _fail_if_dead(rt, keys, pending)
        return pending

    def call(self, *args, **kwargs) -> Future[ValueMesh[T]]:
        """Every member; a Future of a ValueMesh shaped like the mesh."""
        view = self._mesh._view
        return self._send(view.ranks, view.extent, "mesh", args, kwargs).future

    def _send_one(self, rank: int, args, kwargs) -> OneCall:
        """``_send`` for a single member, lean (the reference workload's path): the same checks
        and failures, one message to one proc; arguments of plain values are pickled in one C
        call and signed in one pass."""
        am = self._mesh._state
        rt = runtime()
        err = _ready_to_send(am, rt)
        if err is not None and (am.failed_ranks is None or rank in am.failed_ranks):
            _consume_unhandled(rt, err)
            raise err
        ps = am.proc_state
        if ps.stopped:
            ps.check(())   # raises what a call to a stopped proc mesh meets
        ref = ps.procs[rank]
        key = ref.key
        dead = rt.dead
        if dead and key in dead:
            raise dead[key]
        call_id, pending = rt.new_one(key, self._what)
        try:
            if (not args and not kwargs) or wire.plain(args, kwargs):
                # messages.Call as a literal, in field order (no sources: nothing is pickled by value)
                rt.send_plain(ref.work, ps.key, ("call", am.id, self._method, args, kwargs, rt.address, call_id,
                                                 None))
            else:
                msg = ("call", am.id, self._method, args, kwargs, rt.address, call_id, wire.SOURCES)
                rt.send_frames(ref.work, rt.pack(ps.key, msg, (ref.work,)))
        except BaseException as e:
            rt.abandon(call_id)
            _explain_unpicklable(e, args, kwargs, am.endpoints.get(self._name, (False, ()))[1], self._what)
            raise
        if dead and key in dead:   # died between the check and the send: fail it now
            pending.deliver(key, False, dead[key])
        return pending

    def call_one(self, *args, **kwargs) -> Future[T]:
        rank = self._one
        if rank is None:
            view = self._mesh._view
            if len(view) != 1:
                raise ValueError(f"call_one needs a mesh of exactly 1 member; '{self._mesh.name}' has "
                                 f"{len(view)} ({view.describe()}). Slice it first, e.g. "
                                 f"mesh.slice({view.labels[0] if view.labels else 'gpus'}=0), or use call()")
            rank = self._one = view.ranks[0]
        return self._send_one(rank, args, kwargs)   # a OneCall is the call's Future

    def choose(self, *args, **kwargs) -> Future[T]:
        """One member, the least busy (fewest calls of ours in flight)."""
        best = self._mesh._least_busy()._view.ranks[0]
        return self._send_one(best, args, kwargs)

    def stream(self, *args, **kwargs) -> Stream[T]:
        """Every member; yields a (done) Future per member as each reply arrives, as
        Monarch's does (``for f in ep.stream(): f.get()``). ``.values()`` on it yields the
        plain values instead (raising the first error)."""
        view = self._mesh._view
        return Stream(self._send(view.ranks, view.extent, "stream", args, kwargs), f"{self._mesh.name}."
                      f"{self._name}")

    def broadcast(self, *args, **kwargs) -> None:
        """Every member, fire and forget. A raise fails that actor, as in Monarch: its
        owner's ``__supervise__`` (or the controller's unhandled_fault_hook) gets it."""
        view = self._mesh._view
        self._send(view.ranks, view.extent, "mesh", args, kwargs, reply=False)

    def _send_to_port(self, args, kwargs, port) -> None:
        view = self._mesh._view
        self._send(view.ranks, view.extent, "mesh", args, kwargs, reply=False, port=port)


EXPLICIT_PORT_MARK = "!"   # method-name prefix: call it with a response port first (as_endpoint)


class Stream(Generic[T]):
    """What ``stream()`` returns: iterate for Futures (Monarch), ``values()`` for values."""

    def __init__(self, pending: PendingCall, what: str):
        self._pending, self._what = pending, what

    def __iter__(self):
        q = self._pending.queue
        while True:
            item = q.get()
            if item is None:
                return
            ok, value = item
            yield _done(value, self._what) if ok else _failed(value, self._what)

    def values(self):
        for fut in self:
            yield fut.get()


class NotAnEndpoint:
    """A public method of the actor that is not an ``@endpoint``: wrap it with
    ``as_endpoint(mesh.method)`` to call it through the adverbs."""

    def __init__(self, mesh: ActorMesh, name: str):
        self._mesh, self._name = mesh, name

    def __getattr__(self, adverb):
        raise AttributeError(f"{self._mesh._state.class_name}.{self._name} is not an @endpoint; call it with "
                             f"as_endpoint(mesh.{self._name}).{adverb}(...) or mark it @endpoint")

    def __call__(self, *a, **k):
        self.__getattr__("call")


def as_endpoint(not_an_endpoint, *, propagate=None, explicit_response_port: bool = False) -> Endpoint:
    """Monarch's ``as_endpoint(mesh.method)``: call a plain method of a spawned actor with the
    adverbs (``.call()``, ``.call_one()``...)."""
    if isinstance(not_an_endpoint, Endpoint):
        return Endpoint(not_an_endpoint._mesh, not_an_endpoint._name, explicit_response_port)
    if not isinstance(not_an_endpoint, NotAnEndpoint):
        raise ValueError(f"as_endpoint() expects a method of a spawned actor mesh (mesh.method), got "
                         f"{not_an_endpoint!r}")
    return Endpoint(not_an_endpoint._mesh, not_an_endpoint._name, explicit_response_port)


def _done(value, what: str) -> Future:
    f: Future = Future(what)
    f.set_result(value)
    return f


class _QuietFuture(Future):
    """A Future that shows nothing as a notebook cell's value: ``procs.stop()`` as a cell's
    last line returns one (for Monarch code) without printing it."""

    __slots__ = ()

    def _ipython_display_(self):
        pass


def _quiet(fut: Future) -> Future:
    fut.__class__ = _QuietFuture
    return fut


class _AppliedFuture(_QuietFuture):
    """A done Future that is also a coroutine object, for Monarch's ``async def`` methods
    we apply at once (``asyncio.run(pm.logging_option(...))``, ``await``, ``.get()``)."""

    __slots__ = ()

    def send(self, _value):
        raise StopIteration(self.get())

    def throw(self, typ, val=None, tb=None):
        raise typ if val is None else val

    def close(self):
        pass


def _applied(what: str) -> Future:
    f = _AppliedFuture(what)
    f.set_result(None)
    return f


def _failed(error: BaseException, what: str) -> Future:
    f: Future = Future(what)
    f.set_exception(error)
    return f


def _consume_unhandled(rt: Runtime, err: BaseException) -> None:
    """The error is raised to the user now: don't raise it again at the next interaction."""
    rt.consume_unhandled(err)


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


