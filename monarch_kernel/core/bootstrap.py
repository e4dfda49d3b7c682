"""Getting hosts and setting procs up, Monarch's way: ``attach_to_workers`` (positional or
Monarch's keyword form), ``spawn_procs(bootstrap=fn)``, and the per-host default of
``%mesh connect``."""
from __future__ import annotations

import os

from .. import config
from .hosts import HELLO_TIMEOUT_S, HostMesh
from .mesh import ProcMesh
from .transport import gpu_count


def default_per_host() -> dict:
    """What ``%mesh connect`` starts per host: one proc per visible GPU, else per CPU core
    (the dim is ``gpus`` either way, so code written for a GPU host runs unchanged)."""
    return {"gpus": gpu_count() or os.cpu_count() or 1}


def run_bootstrap(pm: ProcMesh, fn) -> None:
    """``spawn_procs(bootstrap=fn)``: run ``fn()`` (sync or async) on every proc, now."""
    from .actors import Actor

    class _Bootstrap(Actor):
        def __init__(self, fn):
            import asyncio
            import inspect

            res = fn()
            if inspect.isawaitable(res):
                asyncio.run(_await(res))

    am = pm.spawn("bootstrap", _Bootstrap, fn)
    try:
        am.initialized.get(120)
    finally:
        am.stop()


async def _await(x):
    return await x


def attach_to_workers(addresses: list[str] | None = None, key: bytes | str | None = None,
                      name: str | None = None, *, workers=None, ca=None, private_key=None) -> HostMesh:
    """A HostMesh of agents started by hand (``python -m workers.agent --bind ADDR``) with
    the same key; dims ``{"hosts": len(addresses)}``. Monarch's keyword form works too:
    ``attach_to_workers(workers=[...], name=..., ca=...)`` (entries may be Futures of
    addresses); the key then comes from ``MONARCH_KERNEL_KEY``. ``ca``/``private_key`` are
    accepted and unused: peers authenticate with the shared key."""
    if workers is not None:
        if addresses is not None:
            raise TypeError("attach_to_workers: pass the addresses once, as workers=[...] or positionally")
        addresses = [w.get(HELLO_TIMEOUT_S) if hasattr(w, "get") and not isinstance(w, str) else w
                     for w in workers]
    if not addresses:
        raise TypeError("attach_to_workers needs the agents' addresses: workers=['tcp://host:port', ...]")
    name = name or "workers"
    if key is None:
        key = config.KEY.get()
        if not key:
            raise ValueError("attach_to_workers needs the agents' key: pass key=... or set MONARCH_KERNEL_KEY "
                             "(the hex key the agents were started with)")
    if isinstance(key, str):
        key = bytes.fromhex(key)
    agents = [{"addr": a if a.startswith("tcp://") else f"tcp://{a}", "host": a, "pid": None}
              for a in addresses]
    return HostMesh(agents, key, name, local=False)
