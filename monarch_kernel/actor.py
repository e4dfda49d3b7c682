"""The public actor API, with PyTorch Monarch's names.

    from monarch_kernel.actor import Actor, endpoint, this_host
    procs = this_host().spawn_procs(per_host={"gpus": 4})
    class Trainer(Actor):
        @endpoint
        def step(self, n: int) -> float: ...
    trainers = procs.spawn("trainers", Trainer)
    trainers.step.call(n=0).get()          # ValueMesh
"""
from .core.actors import Actor, endpoint
from .core.context import Context, context, current_rank, current_size
from .core.errors import ActorError, MeshFailure, MeshGoneError, MonarchError, SupervisionError
from .core.future import Future
from .core.hosts import HostMesh, attach, attach_to_workers, this_host
from .core.mesh import ActorMesh, Endpoint, ProcMesh
from .core.shape import Extent, Point
from .core.values import ValueMesh


def this_proc() -> ProcMesh:
    """Inside an actor: a one-member ProcMesh of the proc it runs on (to spawn helpers
    beside it)."""
    import workers.proc as proc_mod

    from .core.mesh import ProcMesh as _PM
    from .core.runtime import runtime
    from .core.shape import MeshView

    ctx = context()
    rt = runtime()
    worker = proc_mod.WORKER
    for st in rt.mesh_states.values():
        for ref in st.procs:
            if ref.key == ctx.actor_instance.proc_key:
                return _PM(st, MeshView((), (), (ref.rank,)))
    raise RuntimeError(f"this_proc(): proc {worker.proc_key if worker else '?'} is not in a known mesh")


__all__ = [
    "Actor", "ActorError", "ActorMesh", "Context", "Endpoint", "Extent", "Future", "HostMesh",
    "MeshFailure", "MeshGoneError", "MonarchError", "Point", "ProcMesh", "SupervisionError", "ValueMesh",
    "attach", "attach_to_workers", "context", "current_rank", "current_size", "endpoint", "this_host",
    "this_proc",
]
