"""Who is running: the actor (or cell) context on a proc, behind a ContextVar so sync
endpoints (main thread) and async endpoints (the proc's event-loop thread) each see
their own. On the controller, code runs as the *client* actor, as in Monarch."""
from __future__ import annotations

import contextvars
import socket

from .shape import Extent, Point

_CTX: contextvars.ContextVar = contextvars.ContextVar("monarch_kernel_context", default=None)

# Set by the proc worker: an object with stop_actor(actor_id, reason) and
# abort_actor(actor_id, reason), so an actor can end itself.
SELF_CONTROL = None
_PROC_WORKER = None


def set_proc_worker(worker) -> None:
    """Called once by the proc worker (the node side) when this process becomes a proc."""
    global _PROC_WORKER
    _PROC_WORKER = worker


def proc_worker():
    """This process's proc worker (its ``proc_key``, ``work_addr``, ``key``, ``sink``,
    ``owned``...), or None in a controller."""
    return _PROC_WORKER


class ActorInstance:
    """The running actor: its rank in its mesh, its mesh's name and its proc."""

    __slots__ = ("rank", "actor_id", "name", "proc_key", "proc_rank", "host")

    def __init__(self, rank: Point, actor_id: str, name: str, proc_key: str, proc_rank: int, host: str):
        self.rank, self.actor_id, self.name = rank, actor_id, name
        self.proc_key, self.proc_rank, self.host = proc_key, proc_rank, host

    @property
    def proc(self):
        """The one-member ProcMesh this actor runs on (``this_proc()``)."""
        from .local_proc import this_proc

        return this_proc()

    proc_mesh = proc

    def stop(self, reason: str | None = None) -> None:
        """Stop this actor after the message it handles now: ``__cleanup__(None)`` runs and
        later calls fail with 'stopped'."""
        self._control("stop_actor", reason or "stopped itself")

    def abort(self, reason: str | None = None) -> None:
        """Fail this actor after the message it handles now: its owner's ``__supervise__``
        (or the controller's unhandled_fault_hook) gets the failure."""
        self._control("abort_actor", reason or "aborted itself")

    def _control(self, what: str, reason: str) -> None:
        if SELF_CONTROL is None or self.actor_id == "client":
            raise RuntimeError(f"{what.split('_')[0]}() is for an actor on a proc; the client (this "
                               "controller) cannot stop itself this way")
        getattr(SELF_CONTROL, what)(self.actor_id, reason)

    def __repr__(self):
        return f"<actor {self.name} {self.rank} on {self.host}>"


class Context:
    __slots__ = ("actor_instance", "message_rank")

    def __init__(self, actor_instance: ActorInstance, message_rank: Point | None = None):
        self.actor_instance = actor_instance
        self.message_rank = message_rank or actor_instance.rank


_CLIENT: Context | None = None


def _client_context() -> Context:
    global _CLIENT
    if _CLIENT is None:
        inst = ActorInstance(Point(0, Extent((), ())), "client", "client", "", 0, socket.gethostname())
        _CLIENT = Context(inst)
    return _CLIENT


def context() -> Context:
    """The running actor's context; on the controller, the client's (rank 0 of a
    one-member mesh, name 'client')."""
    c = _CTX.get()
    if c is None:
        from .runtime import current_runtime

        rt = current_runtime()
        if rt is not None and rt.role == "proc":
            raise RuntimeError("context() is only defined inside an actor endpoint or an %%on_mesh cell; "
                               "this thread runs outside any (a thread you started does not inherit it: "
                               "pass what it needs from the endpoint)")
        return _client_context()
    return c


def current_rank() -> Point:
    """This actor's Point in its mesh (``.rank``, and coords by dim name)."""
    return context().actor_instance.rank


def current_size() -> dict:
    """Sizes of this actor's mesh by dim name."""
    return dict(context().actor_instance.rank.extent)


def current_actor_name() -> str:
    """The running actor's name and rank, e.g. ``trainers[3]``; ``client`` on the controller."""
    inst = context().actor_instance
    if inst.actor_id == "client":
        return "client"
    return f"{inst.name}[{inst.rank.rank}]"
