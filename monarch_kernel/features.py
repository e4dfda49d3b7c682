"""Every feature that plugs into the core, registered once per process.

``monarch_kernel/__init__.py`` imports this module, so anything that imports monarch_kernel
(the actor API in a plain script, the kernel, a proc worker, a host agent) sees the same
behaviour. Registration costs no import: each entry is a thin function that imports its
feature on first use (a proc that never syncs never imports ``monarch_kernel.sync``).
The core never imports a feature (``tests/test_layers.py``); see core/extensions.py for
what can be registered and why duplicates are refused.
"""
from __future__ import annotations

from .core import extensions as ext


# ------------------------------------------------------------------ ProcMesh members
def sync_workspace(self, paths=None, **kwargs):
    """Push local code to this mesh's hosts; procs reload it (monarch_kernel.sync)."""
    from .sync import sync_workspace

    return sync_workspace(self, paths, **kwargs)


# torch.distributed and distributed tensors (monarch_kernel.tensor, imported on first use)
def init_process_group(self, backend: str | None = None, timeout: float | None = None):
    """torchrun's env and ``init_process_group`` on every proc (nccl with CUDA, else gloo)."""
    from .tensor.dist import init_process_group

    return init_process_group(self, backend, timeout)


def distribute(self, tensor, placements=None):
    """A handle to ``tensor`` laid out over this mesh (``placements``: one Shard(d) or
    Replicate() per mesh dim); each rank holds its local DTensor."""
    from .tensor.handle import distribute

    return distribute(self, tensor, placements)


def tensor(self, factory, placements=None):
    """A handle to the tensor ``factory()`` makes on the ranks (rank 0's values), laid out
    by ``placements``."""
    from .tensor.handle import from_factory

    return from_factory(self, factory, placements)


def _telemetry(self):
    """SQL over its hosts' samples, proc events, calls and cells; its logs
    (monarch_kernel.telemetry): ``mesh.telemetry.query("select ... from samples")``."""
    from .telemetry.view import MeshTelemetry

    return MeshTelemetry(self._state)


# ------------------------------------------------------------------ the rest
def _same_host_tensor(tensor, receivers: int):
    """Large tensors between processes of one host travel by handle (rdma/wirepath.py): CPU
    ones pulled with process_vm_readv, CUDA ones mapped with CUDA IPC."""
    from .rdma.wirepath import reduce_local

    return reduce_local(tensor, receivers)


def _start_local_agent(key: bytes, **kwargs):
    from .launch.local import start_local_agent

    return start_local_agent(key, **kwargs)


def _debugger_message(msg) -> None:
    """A rank paused in breakpoint(): load the controller's debugger, which takes over "dbg"."""
    from .debug.registry import registry

    registry().on_message(msg)


def _register() -> None:
    for fn in (sync_workspace, init_process_group, distribute, tensor):
        fn.__qualname__ = f"ProcMesh.{fn.__name__}"
        ext.register_proc_mesh_member(fn.__name__, fn)
    ext.register_proc_mesh_member("telemetry", property(_telemetry))
    ext.register_large_tensor_hook(_same_host_tensor)
    ext.register_local_agent_starter(_start_local_agent)
    ext.register_message_kind("dbg", _debugger_message)


_register()
