"""``Actor`` and ``@endpoint``: what a user subclasses and decorates."""
from __future__ import annotations

import inspect


class Actor:
    """Base class of everything spawned on a mesh.

    ``__init__`` runs on every rank before the first message. Methods marked
    ``@endpoint`` (sync or ``async``) can be called through the ActorMesh.
    Optional hooks: ``__supervise__(self, failure)`` handles the failure of a mesh this
    actor spawned (return truthy when handled; ``async def`` is awaited);
    ``__cleanup__(self, exc)`` runs when the actor stops (``exc`` is None on a normal stop,
    the error when it failed; ``async def`` is awaited).
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


def endpoint(fn=None, *, explicit_response_port: bool = False, **options):
    """Mark a method of an Actor as callable from the mesh (``@endpoint`` or
    ``@endpoint(...)``). ``explicit_response_port=True``: the method gets a ``Port`` after
    ``self`` and answers through it (``port.send(value)``), now or later, from any thread,
    or hands it on. Monarch's other options (``propagate``, ``instrument``) are accepted."""

    def mark(f):
        f._monarch_endpoint = True
        f._monarch_explicit_port = bool(explicit_response_port)
        return f

    return mark(fn) if fn is not None else mark


def concurrent_endpoint(fn=None, **options):
    """Monarch's ``@concurrent_endpoint``: an async endpoint that lets the actor take other
    messages while it awaits. Every async endpoint here already runs that way (all on the
    proc's one event loop), so this is ``@endpoint`` that insists on ``async def``."""

    def mark(f):
        if not inspect.iscoroutinefunction(f):
            raise ValueError(f"concurrent_endpoint can only wrap async endpoints; {f.__qualname__} is not "
                             "`async def`")
        return endpoint(f, **options)

    return mark(fn) if fn is not None else mark


def endpoint_signature(fn) -> tuple:
    """(is_async, parameter names after self (and after the port of an explicit-response
    endpoint)) — enough to name a bad argument."""
    try:
        params = list(inspect.signature(fn).parameters)[1:]
    except (TypeError, ValueError):
        params = []
    if getattr(fn, "_monarch_explicit_port", False):
        params = params[1:]
    return (inspect.iscoroutinefunction(fn), tuple(params))


def plain_methods(cls) -> tuple:
    """Public methods that are not endpoints (callable through ``as_endpoint``)."""
    return tuple(n for n in dir(cls) if not n.startswith("_") and n not in cls._endpoints
                 and callable(getattr(cls, n, None)))
