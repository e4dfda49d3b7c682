"""Errors a user can catch. Each message names the rank, the host and what to do next."""
from __future__ import annotations


class MonarchError(Exception):
    """Base of every error raised by monarch_kernel."""


class ActorError(MonarchError):
    """An endpoint (or a cell) raised on a remote rank. After an ``Exception`` with a caller
    waiting, the actor keeps serving; a ``BaseException``, or a raise under ``broadcast``,
    also fails the actor (Monarch's supervision: its owner is told).

    ``remote_traceback`` is the worker's formatted traceback; ``__cause__`` is the
    original exception when it could be sent back. ``results`` (a ValueMesh or None) holds
    what the other members of the same call returned, so a raise on some ranks does not
    lose the others' results (failed members hold their exception).
    """

    def __init__(self, message: str, *, rank=None, host: str | None = None, exc_type: str = "",
                 remote_traceback: str = "", actor: str = "", results=None):
        super().__init__(message)
        self.message = message
        self.rank = rank
        self.host = host
        self.exc_type = exc_type
        self.remote_traceback = remote_traceback
        self.actor = actor
        self.results = results
        self.cause_error = ""   # why __cause__ is None although the remote raised something

    def __str__(self) -> str:
        where = f" on rank {self.rank}" if self.rank is not None else ""
        host = f" ({self.host})" if self.host else ""
        head = f"{self.actor}{where}{host}: {self.message}" if self.actor else f"{self.message}"
        if self.remote_traceback:
            return f"{head}\n\nRemote traceback:\n{self.remote_traceback.rstrip()}"
        return head

    def __reduce__(self):
        # __cause__ is not part of an exception's pickled state: carry it explicitly, as a
        # pickle of its own, so that a cause this side cannot rebuild (a class whose __init__
        # wants other arguments, a module only the worker has) costs the cause, not the error.
        cause = self.__cause__
        if cause is not None and not isinstance(cause, _CauseBlob):
            from .wire import dumps_inband

            try:
                cause = _CauseBlob(dumps_inband(cause))
            except Exception:
                cause = None
        return (_rebuild_actor_error, (self.message, self.rank, self.host, self.exc_type,
                                       self.remote_traceback, self.actor, cause))


class _CauseBlob(bytes):
    """An ActorError's original exception, pickled on its own (see ActorError.__reduce__)."""


def _rebuild_actor_error(message, rank, host, exc_type, tb, actor, cause=None):
    err = ActorError(message, rank=rank, host=host, exc_type=exc_type, remote_traceback=tb, actor=actor)
    if isinstance(cause, bytes):
        import pickle

        try:
            cause = pickle.loads(cause)
        except Exception as e:
            # The remote traceback (text) still says what happened; say why the object is missing.
            err.cause_error = f"the original {exc_type or 'exception'} could not be rebuilt here: {e!r}"
            cause = None
    err.__cause__ = cause
    return err


HOST_LOST = "host lost"   # how a MeshFailure's reason starts when its host's agent was lost
# What to do when a host's agent is gone (not silent), for the actor API; the notebook says it its way.
HOST_GONE_HINT = "The whole host is gone: stop this mesh and spawn a new one (this_host(name) starts a new agent)"


class MeshFailure:
    """What went wrong with a mesh, as given to ``Actor.__supervise__`` and carried by
    SupervisionError: which mesh, which rank on which host, and why."""

    def __init__(self, mesh: str, rank: int | None, host: str, pid: int | None, reason: str,
                 proc_key: str = ""):
        self.mesh = mesh
        self.rank = rank
        self.host = host
        self.pid = pid
        self.reason = reason
        self.proc_key = proc_key

    def __str__(self) -> str:
        pid = f", pid {self.pid}" if self.pid else ""
        return f"mesh '{self.mesh}' rank {self.rank} (host {self.host}{pid}): {self.reason}"

    __repr__ = lambda self: f"MeshFailure({self})"

    @property
    def mesh_name(self) -> str:
        """Monarch's name for ``mesh``: the failed mesh's name."""
        return self.mesh

    def report(self) -> str:
        """Monarch's user-readable report of this failure."""
        return str(self)


class SupervisionError(MonarchError):
    """A proc (or a whole host) of the mesh died, or an actor failed to start.

    Futures waiting on it fail with this within about a second; later calls to the same
    mesh raise it at once. Other meshes and other ranks keep their state; ``respawn()``
    replaces the dead procs.
    """

    def __init__(self, failure: MeshFailure | str, hint: str = ""):
        self.failure = failure if isinstance(failure, MeshFailure) else None
        self.hint = hint
        text = str(failure)
        if hint:
            text = f"{text}. {hint}"
        super().__init__(text)

    def __reduce__(self):
        if self.failure is None:
            return (SupervisionError, (self.args[0],))   # the hint is already in the text
        return (SupervisionError, (self.failure, self.hint))


class HostUnreachableError(SupervisionError):
    """A host agent is silent (stalled, cut off, or dead): what waits on it fails now. A
    host that answers again comes back, its procs with their state."""

    def __reduce__(self):
        return (HostUnreachableError, (self.args[0],))


class MeshGoneError(MonarchError):
    """The mesh was stopped, or its agent cannot be reached, or no such mesh exists."""
