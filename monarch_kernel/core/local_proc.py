"""``this_proc()``: the proc this code runs on (Monarch's name), to spawn actors beside it."""
from __future__ import annotations

import os
import threading

from .context import proc_worker
from .hosts import this_host
from .mesh import ProcMesh, ProcMeshState, state_of
from .runtime import ProcRef, runtime
from .shape import MeshView

_client_proc: ProcMesh | None = None
_client_lock = threading.Lock()


def this_proc() -> ProcMesh:
    """The one-member ProcMesh this code runs on, to spawn actors beside it.

    Inside an actor (or an ``%%on_mesh`` cell): its own proc. On the controller (the
    client): the client's proc, a companion proc started on first use on this machine, so
    ``this_proc().spawn(...)`` works as in Monarch (its actors run there, not inside the
    controller's own process)."""
    global _client_proc
    w = proc_worker()
    if w is None:
        with _client_lock:
            if _client_proc is None or state_of(_client_proc).stopped:
                _client_proc = this_host().spawn_procs(per_host={}, name="client")
            return _client_proc
    rt = runtime()
    sid = f"self-{w.proc_key}"
    st = rt.mesh_states.get(sid)
    if st is None:
        ref = ProcRef(w.proc_key, w.rank, w.host, os.getpid(), w.work_addr, rt.address, w.agent,
                      w.work_ipc, rt.ipc_address, rt.host_id, rt.curve_public)
        st = rt.mesh_states[sid] = ProcMeshState(sid, w.mesh_name, w.key, (), (), [ref])
    return ProcMesh(st, MeshView((), (), (0,)))
