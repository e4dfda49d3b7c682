"""``fetch_shard`` and ``inspect`` (Monarch's names): bring a distributed tensor's data back."""
from __future__ import annotations

from ..core.future import Future
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

