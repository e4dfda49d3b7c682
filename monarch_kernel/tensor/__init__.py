"""Distributed tensors on a proc mesh, driven from the controller (Monarch's tensor API).

    from monarch_kernel.tensor import Shard, Replicate, fetch_shard, inspect
    dt = mesh.distribute(torch.randn(8, 8), placements=[Shard(0)])   # or mesh.tensor(lambda: ...)
    y = (dt @ dt.T).sum()            # runs on every rank, on its local DTensor; no waiting
    y.full_tensor(); inspect(dt, gpus=1); fetch_shard(dt, gpus=0).get()

The process group is formed on first use (``mesh.init_process_group()`` chooses it
explicitly). Handles passed to actor endpoints arrive there as the local shard.
"""
from __future__ import annotations

from torch.distributed.tensor import Partial, Replicate, Shard

from ..core.future import Future
from .engine import TensorOpError
from .handle import DistributedTensor
from .layout import coords


def _rank_of(h: DistributedTensor, shard: dict | None, kwargs: dict, what: str) -> int:
    sel = {**(shard or {}), **kwargs}
    st = h._engine.group.state
    labels, sizes = st.labels, st.sizes
    unknown = [k for k in sel if k not in labels]
    if unknown:
        raise ValueError(f"{what}: unknown mesh dims {unknown}; mesh '{st.name}' has "
                         f"{', '.join(f'{k}={v}' for k, v in zip(labels, sizes))}")
    missing = [k for k, s in zip(labels, sizes) if k not in sel and s > 1]
    if missing:
        raise ValueError(f"{what}: say which shard: give a coordinate for {', '.join(missing)}, e.g. "
                         f"{what.split('(')[0]}(t, {missing[0]}=0)")
    rank = 0
    for k, s in zip(labels, sizes):
        i = sel.get(k, 0)
        if not isinstance(i, int) or not 0 <= i < s:
            raise IndexError(f"{what}: {k}={i!r} is out of range 0..{s - 1}")
        rank = rank * s + i
    assert coords(rank, sizes) == tuple(sel.get(k, 0) for k in labels)
    return rank


def fetch_shard(obj: DistributedTensor, shard: dict | None = None, **kwargs) -> Future:
    """A Future of the local shard held by the rank at ``shard``/``kwargs`` coordinates
    (``fetch_shard(t, gpus=1)``); errors of earlier ops surface when it resolves."""
    if not isinstance(obj, DistributedTensor):
        raise TypeError(f"fetch_shard() takes a distributed tensor, got {type(obj).__name__}")
    rank = _rank_of(obj, shard, kwargs, "fetch_shard()")
    obj._engine.check_usable(obj._gen, "fetch_shard()")
    return obj._engine.fetch_future(obj._id, "local", rank)


def inspect(obj, shard: dict | None = None, **kwargs):
    """The value now: with coordinates, that rank's local shard; without, the whole tensor."""
    if not isinstance(obj, DistributedTensor):
        return obj
    if shard or kwargs:
        return fetch_shard(obj, shard, **kwargs).get()
    return obj.full_tensor()


__all__ = ["DistributedTensor", "Partial", "Replicate", "Shard", "TensorOpError", "fetch_shard", "inspect"]
