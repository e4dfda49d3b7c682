"""What the controller does with a failure nobody handled: Monarch's ``unhandled_fault_hook``.

Failures reach the controller when an actor it spawned dies (a proc crash, an ``__init__``
that raised, an endpoint that raised a BaseException, any raise under ``broadcast``), or
when an actor's ``__supervise__`` declined a failure of a mesh it owns. Each is handed to
``monarch_kernel.actor.unhandled_fault_hook(failure)``, looked up at call time so users
can replace it exactly as in Monarch (``monarch_kernel.actor.unhandled_fault_hook = fn``).

Our default differs on purpose: Monarch's exits the client process; a notebook must never
lose its kernel, so ours logs the failure and raises it as a SupervisionError at the next
interaction with the runtime (a call, a spawn), once. A replacement hook that returns
drops the failure; one that raises has its exception raised at the next interaction.
"""
from __future__ import annotations

import logging
import sys

from .errors import MeshFailure, SupervisionError

log = logging.getLogger("monarch_kernel")


def default_unhandled_fault_hook(failure: MeshFailure) -> None:
    """Log, then raise a SupervisionError at the next interaction (never exit the kernel)."""
    raise SupervisionError(failure, "nothing handled it (no __supervise__ on its owner, or it returned "
                                    "a falsy value)")


_surfaced: set = set()   # actor meshes (ids) whose failure our default hook already queued


def deliver_unhandled(failure: MeshFailure, error: BaseException | None = None, seen: bool = False,
                      mesh_id: str | None = None) -> None:
    """Run the (possibly user-replaced) hook on the controller; what it raises is queued to
    surface at the next interaction. ``error``: what our default hook raises instead of a
    generic SupervisionError (e.g. the endpoint's own ActorError). ``seen``: a caller
    already got this error, so our default only logs it. Our default also raises one error
    per failed mesh, not one per failed rank. Any thread."""
    from .runtime import runtime

    mod = sys.modules.get("monarch_kernel.actor")
    hook = getattr(mod, "unhandled_fault_hook", default_unhandled_fault_hook) if mod else \
        default_unhandled_fault_hook
    log.error("unhandled supervision failure: %s", failure)
    from .calls import already_surfaced

    if already_surfaced(error):
        return   # a cell showed it already (the report raced the cell's own wait)
    if hook is default_unhandled_fault_hook:
        queued = runtime().unhandled()
        if seen or mesh_id in _surfaced or any(_mesh_of(e) == failure.mesh for e in queued):
            return
        if mesh_id is not None:
            _surfaced.add(mesh_id)
        if error is not None:
            runtime().queue_unhandled(error)
            return
    try:
        hook(failure)
    except BaseException as e:   # noqa: B036  (SystemExit from a Monarch-style hook: surface it)
        runtime().queue_unhandled(e)


def _mesh_of(err: BaseException) -> str | None:
    f = getattr(err, "failure", None)
    if isinstance(f, MeshFailure):
        return f.mesh
    actor = getattr(err, "actor", None)
    return actor.split(".")[0] if actor else None


def failure_of(err: BaseException, mesh: str = "") -> MeshFailure:
    """The MeshFailure behind an error a proc reported."""
    f = getattr(err, "failure", None)
    if isinstance(f, MeshFailure):
        return f
    return MeshFailure(_mesh_of(err) or mesh, getattr(err, "rank", None),
                       getattr(err, "host", "") or "", None, str(err).split("\n\nRemote traceback")[0])
