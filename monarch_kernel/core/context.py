"""Who is running: the actor (or cell) context on a proc, behind a ContextVar so sync
endpoints (main thread) and async endpoints (the proc's event-loop thread) each see
their own."""
from __future__ import annotations

import contextvars

from .shape import Point

_CTX: contextvars.ContextVar = contextvars.ContextVar("monarch_kernel_context", default=None)


class ActorInstance:
    """The running actor: its rank in its mesh, its mesh's name and its proc."""

    __slots__ = ("rank", "actor_id", "name", "proc_key", "proc_rank", "host")

    def __init__(self, rank: Point, actor_id: str, name: str, proc_key: str, proc_rank: int, host: str):
        self.rank, self.actor_id, self.name = rank, actor_id, name
        self.proc_key, self.proc_rank, self.host = proc_key, proc_rank, host

    def __repr__(self):
        return f"<actor {self.name} {self.rank} on {self.host}>"


class Context:
    __slots__ = ("actor_instance", "message_rank")

    def __init__(self, actor_instance: ActorInstance, message_rank: Point | None = None):
        self.actor_instance = actor_instance
        self.message_rank = message_rank or actor_instance.rank


def context() -> Context:
    c = _CTX.get()
    if c is None:
        raise RuntimeError("context() is only defined inside an actor endpoint or an %%on_mesh cell; "
                           "this code runs on the controller")
    return c


def current_rank() -> Point:
    """This actor's Point in its mesh (``.rank``, and coords by dim name)."""
    return context().actor_instance.rank


def current_size() -> dict:
    """Sizes of this actor's mesh by dim name."""
    return dict(context().actor_instance.rank.extent)
