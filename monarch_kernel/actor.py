"""The public actor API, with PyTorch Monarch's names.

    from monarch_kernel.actor import Actor, endpoint, this_host
    procs = this_host().spawn_procs(per_host={"gpus": 4})
    class Trainer(Actor):
        @endpoint
        def step(self, n: int) -> float: ...
    trainers = procs.spawn("trainers", Trainer)
    trainers.step.call(n=0).get()          # ValueMesh

Monarch code runs with only its import changed (``monarch.actor`` ->
``monarch_kernel.actor``); the README's "Coming from Monarch" table lists where we
differ on purpose.
"""
from __future__ import annotations

import os

from .core.actors import Actor, concurrent_endpoint, endpoint
from .core.bootstrap import attach_to_workers, default_per_host
from .core.channels import Accumulator, Channel, Port, PortReceiver
from .core.context import Context, context, current_actor_name, current_rank, current_size
from .core.controllers import get_or_spawn_controller
from .core.endpoint import Endpoint, as_endpoint
from .core.errors import ActorError, MeshFailure, MeshGoneError, MonarchError, SupervisionError
from .core.future import Future
from .core.hosts import HostMesh, attach, this_host
from .core.local_proc import this_proc
from .core.mesh import ActorMesh, ProcMesh
from .core.shape import Extent, Point
from .core.supervision import default_unhandled_fault_hook
from .core.values import ValueMesh

# Replaceable, as in Monarch: ``monarch_kernel.actor.unhandled_fault_hook = fn``. Ours
# raises the failure at the next interaction instead of exiting (see core/supervision.py).
unhandled_fault_hook = default_unhandled_fault_hook

def send(endpoint: Endpoint, args: tuple = (), kwargs: dict | None = None, port: Port | None = None,
         selection: str = "all") -> None:
    """Monarch's ``send``: call ``endpoint`` on its mesh without waiting; each member's
    result (or error) goes to ``port`` when given (see ``Channel.open()``)."""
    if not isinstance(endpoint, Endpoint):
        raise TypeError(f"send() takes an actor mesh's endpoint (mesh.method), got {endpoint!r}")
    if selection not in ("all", "choose"):
        raise ValueError(f"send(selection=...) is 'all' or 'choose', got {selection!r}")
    kwargs = kwargs or {}
    if selection == "choose":   # one member, the least busy (as Endpoint.choose picks)
        endpoint = Endpoint(endpoint._mesh._least_busy(), endpoint._name, endpoint._explicit)
    if port is None:
        endpoint.broadcast(*args, **kwargs)
    else:
        endpoint._send_to_port(args, kwargs, port)


def hosts_from_config(var: str = "MONARCH_HOSTS") -> HostMesh:
    """Monarch's (not yet implemented there) ``hosts_from_config``: the agents listed in
    the environment variable ``var`` (comma-separated addresses, key in
    ``MONARCH_KERNEL_KEY``), or this machine when it is unset."""
    addrs = [a.strip() for a in os.environ.get(var, "").split(",") if a.strip()]
    return attach_to_workers(addrs, name=var.lower()) if addrs else this_host()


__all__ = [
    "Accumulator", "Actor", "ActorError", "ActorMesh", "Channel", "Context", "Endpoint", "Extent", "Future",
    "HostMesh", "MeshFailure", "MeshGoneError", "MonarchError", "Point", "Port", "PortReceiver", "ProcMesh",
    "SupervisionError", "ValueMesh", "as_endpoint", "attach", "attach_to_workers", "concurrent_endpoint",
    "context", "current_actor_name", "current_rank", "current_size", "default_per_host", "endpoint",
    "get_or_spawn_controller", "hosts_from_config", "send", "this_host", "this_proc", "unhandled_fault_hook",
]
