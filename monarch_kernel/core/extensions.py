"""What features plug into the core, by name.

``monarch_kernel.core`` is the ground floor: it imports no feature package (debug, rdma,
sync, tensor, telemetry, launch, job, jupyter, the node side, nor the public facade
``monarch_kernel.actor``); ``tests/test_layers.py`` fails when a core module does. A
feature that needs the core to do something for it registers it here, once per process,
when ``monarch_kernel`` is imported (``monarch_kernel/features.py`` lists them all):

    register_message_kind("dbg", handler)        # a runtime inbox message kind
    register_large_tensor_hook(fn)               # same-host tensors by handle (rdma)
    register_local_agent_starter(fn)             # how this_host() starts an agent (launch)
    register_proc_mesh_member("sync_workspace", fn)   # procs.sync_workspace(...) (sync)
    register_respawn_hook(fn)                    # after ProcMesh.respawn() (tensor)

Every call refuses a duplicate (``DuplicateRegistration``): two features claiming one
message kind, or one feature registered twice, is a bug to see at import, not a handler
silently replaced. Handlers a *runtime instance* installs for its own role (a proc
worker's "interrupt") go through ``Runtime.on_message`` instead, which refuses the same way.
This module imports nothing at the top, so registering costs no import.
"""
from __future__ import annotations

from typing import Callable


class DuplicateRegistration(ValueError):
    """A name registered twice with the core (see the module docstring)."""


_message_kinds: dict[str, Callable] = {}
_proc_mesh_members: dict[str, object] = {}
_respawn_hooks: list[Callable] = []
_local_agent_starter: list[Callable] = []
_large_tensor_hook: list[Callable] = []


def refuse_duplicate(what: str, name: str, existing) -> None:
    raise DuplicateRegistration(
        f"{what} {name!r} is already registered (by {_owner(existing)}); a feature registers it once, "
        "when monarch_kernel is imported. Pick another name, or remove the other registration")


def _owner(fn) -> str:
    fn = getattr(fn, "fget", fn)
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


# ------------------------------------------------------------------ message kinds
def register_message_kind(kind: str, handler: Callable) -> None:
    """Every runtime of this process passes inbox messages of ``kind`` (``msg[0]``) to
    ``handler(msg)`` on the thread that reads its inbox, unless the runtime itself
    handles that kind (its own kinds, and those installed with ``Runtime.on_message``)."""
    if not isinstance(kind, str) or not kind:
        raise TypeError(f"a message kind is a non-empty str, got {kind!r}")
    if kind in _message_kinds:
        refuse_duplicate("message kind", kind, _message_kinds[kind])
    _message_kinds[kind] = handler


def message_handler(kind) -> Callable | None:
    """The process-wide handler of ``kind`` (None if no feature registered it)."""
    return _message_kinds.get(kind)


# ------------------------------------------------------------------ large tensors
def register_large_tensor_hook(hook: Callable) -> None:
    """``hook(tensor, receivers)`` -> a pickle reduction, or None for the socket path: how
    a large CPU tensor travels when every receiver is on this host (core/wire.py)."""
    if _large_tensor_hook:
        refuse_duplicate("the large-tensor hook", "large_tensor", _large_tensor_hook[0])
    _large_tensor_hook.append(hook)
    import sys

    wire = sys.modules.get(__package__ + ".wire")
    if wire is not None and wire.SHM_TENSORS:   # else wire.py takes it when it loads
        wire.LARGE_TENSOR_HOOK = hook


def large_tensor_hook() -> Callable | None:
    return _large_tensor_hook[0] if _large_tensor_hook else None


# ------------------------------------------------------------------ local agents
def register_local_agent_starter(start: Callable) -> None:
    """``start(key, *, name, persistent, lease=None, python=None)`` -> (agent info dict,
    process or None): how ``this_host()`` starts a host agent on this machine."""
    if _local_agent_starter:
        refuse_duplicate("the local agent starter", "start_local_agent", _local_agent_starter[0])
    _local_agent_starter.append(start)


def start_local_agent(key: bytes, **kwargs):
    """Start a host agent on this machine with the registered starter."""
    if not _local_agent_starter:
        raise RuntimeError("no launcher is registered to start a host agent on this machine: import "
                           "monarch_kernel (monarch_kernel/features.py registers monarch_kernel.launch.local)")
    return _local_agent_starter[0](key, **kwargs)


# ------------------------------------------------------------------ ProcMesh members
def register_proc_mesh_member(name: str, member) -> None:
    """Add ``name`` to ProcMesh (a function taking the mesh first, or a ``property``), so
    ``procs.name(...)`` reaches a feature without the core importing it."""
    if name in _proc_mesh_members:
        refuse_duplicate("ProcMesh member", name, _proc_mesh_members[name])
    import sys

    mesh_mod = sys.modules.get(__package__ + ".mesh")
    if mesh_mod is not None:
        _install_member(mesh_mod.ProcMesh, name, member)
    _proc_mesh_members[name] = member


def install_proc_mesh_members(cls) -> None:
    """Called once by core/mesh.py when it defines ProcMesh: adds what was registered before."""
    for name, member in _proc_mesh_members.items():
        _install_member(cls, name, member)


def _install_member(cls, name: str, member) -> None:
    if name in cls.__dict__:
        refuse_duplicate("ProcMesh member", name, cls.__dict__[name])
    setattr(cls, name, member)


# ------------------------------------------------------------------ respawn hooks
def register_respawn_hook(hook: Callable) -> None:
    """``hook(proc_mesh)`` runs after ``ProcMesh.respawn()`` replaced dead procs (a feature
    that keeps per-mesh state on the procs re-forms it)."""
    if hook in _respawn_hooks:
        refuse_duplicate("respawn hook", _owner(hook), hook)
    _respawn_hooks.append(hook)


def respawn_hooks() -> list[Callable]:
    return list(_respawn_hooks)
