"""torch.distributed on a proc mesh, with Monarch's names.

    from monarch_kernel.spmd import setup_torch_elastic_env
    setup_torch_elastic_env(procs)       # torchrun's env on every proc; cells init themselves
    procs.init_process_group()           # or: env + init_process_group on every proc, one step

Details (MASTER_ADDR, timeouts, deaths and respawns) in monarch_kernel/tensor/dist.py.
"""
from .tensor.dist import DEFAULT_TIMEOUT_S, init_process_group, setup_torch_elastic_env, torchrun_env

__all__ = ["DEFAULT_TIMEOUT_S", "init_process_group", "setup_torch_elastic_env", "torchrun_env"]
