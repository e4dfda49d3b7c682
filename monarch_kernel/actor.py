"""The public actor API, with PyTorch Monarch's names.

    from monarch_kernel.actor import Actor, endpoint, this_host
    procs = this_host().spawn_procs(per_host={"gpus": 4})
    class Trainer(Actor):
        @endpoint
        def step(self, n: int) -> float: ...
    trainers = procs.spawn("trainers", Trainer)
    trainers.step.call(n=0).get()          # ValueMesh
"""
import os

from .core.actors import Actor, endpoint
from .core.context import Context, context, current_rank, current_size
from .core.errors import ActorError, MeshFailure, MeshGoneError, MonarchError, SupervisionError
from .core.future import Future
from .core.hosts import HostMesh, attach, attach_to_workers, this_host
from .core.mesh import ActorMesh, Endpoint, ProcMesh
from .core.shape import Extent, Point
from .core.values import ValueMesh


def this_proc() -> ProcMesh:
    """Inside an actor (or an ``%%on_mesh`` cell): a one-member ProcMesh of the proc it runs
    on, to spawn helpers beside it (``this_proc().spawn("helper", Helper)``)."""
    import workers.proc as proc_mod

    from .core.mesh import ProcMeshState
    from .core.runtime import ProcRef, runtime
    from .core.shape import MeshView

    w = proc_mod.WORKER
    if w is None:
        raise RuntimeError("this_proc() is only defined on a proc (inside an actor or an %%on_mesh cell); "
                           "on the controller, spawn on a ProcMesh from this_host().spawn_procs()")
    rt = runtime()
    sid = f"self-{w.proc_key}"
    st = rt.mesh_states.get(sid)
    if st is None:
        ref = ProcRef(w.proc_key, w.rank, w.host, os.getpid(), w.work_addr, rt.address, w.agent,
                      w.work_ipc, rt.ipc_address, rt.host_id)
        st = rt.mesh_states[sid] = ProcMeshState(sid, w.mesh_name, w.key, (), (), [ref])
    return ProcMesh(st, MeshView((), (), (0,)))


__all__ = [
    "Actor", "ActorError", "ActorMesh", "Context", "Endpoint", "Extent", "Future", "HostMesh",
    "MeshFailure", "MeshGoneError", "MonarchError", "Point", "ProcMesh", "SupervisionError", "ValueMesh",
    "attach", "attach_to_workers", "context", "current_rank", "current_size", "endpoint", "this_host",
    "this_proc",
]
