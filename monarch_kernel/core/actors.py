"""``Actor`` and ``@endpoint``: what a user subclasses and decorates."""
from __future__ import annotations

import inspect


class Actor:
    """Base class of everything spawned on a mesh.

    ``__init__`` runs on every rank before the first message. Methods marked
    ``@endpoint`` (sync or ``async``) can be called through the ActorMesh.
    Optional hooks: ``__supervise__(self, failure)`` handles the failure of a mesh this
    actor spawned (return truthy when handled); ``__cleanup__(self)`` runs on stop.
    """

    _endpoints: dict = {}

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        eps = {}
        for klass in reversed(cls.__mro__):
            for name, fn in vars(klass).items():
                if getattr(fn, "_monarch_endpoint", False):
                    eps[name] = endpoint_signature(fn)
        cls._endpoints = eps


def endpoint(fn=None, **options):
    """Mark a method of an Actor as callable from the mesh (``@endpoint`` or
    ``@endpoint(...)``; options are accepted for Monarch compatibility)."""

    def mark(f):
        f._monarch_endpoint = True
        return f

    return mark(fn) if fn is not None else mark


def endpoint_signature(fn) -> tuple:
    """(is_async, parameter names after self) — enough to name a bad argument."""
    try:
        params = list(inspect.signature(fn).parameters)[1:]
    except (TypeError, ValueError):
        params = []
    return (inspect.iscoroutinefunction(fn), tuple(params))
