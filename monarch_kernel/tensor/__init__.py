"""Distributed tensors on a proc mesh, driven from the controller (Monarch's tensor API).

    from monarch_kernel.tensor import Shard, Replicate, fetch_shard, inspect
    dt = mesh.distribute(torch.randn(8, 8), placements=[Shard(0)])   # or mesh.tensor(lambda: ...)
    y = (dt @ dt.T).sum()            # runs on every rank, on its local DTensor; no waiting
    y.full_tensor(); inspect(dt, gpus=1); fetch_shard(dt, gpus=0).get()

The process group is formed on first use (``mesh.init_process_group()`` chooses it
explicitly). Handles passed to actor endpoints arrive there as the local shard.

Names load on first use, so a proc that only needs a process group (``%mesh connect
--dist``) never imports DTensor.
"""
from __future__ import annotations

import importlib

_WHERE = {
    "Partial": "torch.distributed.tensor", "Replicate": "torch.distributed.tensor",
    "Shard": "torch.distributed.tensor", "TensorOpError": "monarch_kernel.tensor.engine",
    "DistributedTensor": "monarch_kernel.tensor.handle", "fetch_shard": "monarch_kernel.tensor.fetch",
    "inspect": "monarch_kernel.tensor.fetch",
}


def __getattr__(name: str):
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'monarch_kernel.tensor' has no attribute {name!r}")
    value = getattr(importlib.import_module(where), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted([*globals(), *_WHERE])


__all__ = ["DistributedTensor", "Partial", "Replicate", "Shard", "TensorOpError", "fetch_shard", "inspect"]
