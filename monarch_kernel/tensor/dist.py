"""Controller side of torch.distributed on a proc mesh: torchrun's environment, one
process group over the whole mesh, and what happens when a rank dies or is respawned.

Decisions (the issue leaves them to us):
  * The group always spans the whole proc mesh (a slice cannot form its own); rank =
    the proc's rank, hosts in the order their agents appear, LOCAL_RANK = index on the host.
  * MASTER_ADDR is the address rank 0's proc binds (what the other hosts reach it by),
    MASTER_PORT a free port rank 0 picked there.
  * Collectives time out after ``timeout`` (default 60 s, not torch's 30 min), so a hung
    peer becomes an error. When a rank dies, the controller tells every other rank to shut
    down its group's sockets (worker.abort_group: gloo's abort() does not wake a rank
    blocked in a collective with a live peer) and interrupts them, so every rank's
    collective fails at once.
  * ``respawn()`` forms a NEW group for the whole mesh (survivors destroy theirs), prints
    that collectives in flight failed, and drops the tensors of the old group: handles made
    before say so when used.
"""
from __future__ import annotations

import threading
import time

from ..core.errors import MeshGoneError
from ..core.mesh import ProcMesh, ProcMeshState, state_of, view_of
from ..core.runtime import runtime

WORKER_ACTOR = "__torch__"
DEFAULT_TIMEOUT_S = 60.0


class MeshGroup:
    """The controller's record of one proc mesh's process group (and its tensor engine)."""

    def __init__(self, state: ProcMeshState, workers):
        self.state = state
        self.workers = workers          # ActorMesh of TensorWorker, one per proc
        self.backend: str | None = None
        self.timeout_s = DEFAULT_TIMEOUT_S
        self.generation = 0
        self.keys: tuple = ()           # the procs the group was formed with
        self.engine = None              # engine.TensorEngine, made on first tensor use
        self.broken: str | None = None  # why the group cannot run collectives now

    @property
    def formed(self) -> bool:
        return self.backend is not None

    def stale_ranks(self) -> list[int]:
        """Ranks replaced (respawned) since the group was formed."""
        return [r.rank for r, k in zip(self.state.procs, self.keys) if r.key != k]


_GROUPS: dict[str, MeshGroup] = {}
_LOCK = threading.Lock()


def mesh_group(procs: ProcMesh) -> MeshGroup:
    """The group record of ``procs``'s mesh, spawning the per-proc TensorWorker once."""
    st = state_of(procs)
    if st.stopped:
        raise MeshGoneError(f"proc mesh '{st.name}' was stopped; spawn a new one")
    with _LOCK:
        g = _GROUPS.get(st.id)
    if g is not None:
        return g
    whole = ProcMesh(st)
    try:
        workers = whole.actor_mesh(WORKER_ACTOR)   # re-attached after a kernel restart
    except KeyError:
        from .worker import TensorWorker

        workers = whole.spawn(WORKER_ACTOR, TensorWorker)
    g = MeshGroup(st, workers)
    with _LOCK:
        g = _GROUPS.setdefault(st.id, g)
    _install_listeners()
    return g


def torchrun_env(procs: ProcMesh, master_addr: str, master_port: int) -> list[dict]:
    """Per rank, the variables torchrun sets (hosts = the proc mesh's agents, in order)."""
    refs = state_of(procs).procs
    hosts: dict[str, list[int]] = {}
    for ref in refs:
        hosts.setdefault(ref.agent, []).append(ref.rank)
    world = len(refs)
    envs = []
    for ref in refs:
        on_host = hosts[ref.agent]
        group_rank = list(hosts).index(ref.agent)
        envs.append({
            "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
            "RANK": str(ref.rank), "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(on_host.index(ref.rank)), "LOCAL_WORLD_SIZE": str(len(on_host)),
            "GROUP_RANK": str(group_rank), "GROUP_WORLD_SIZE": str(len(hosts)),
            "ROLE_RANK": str(ref.rank), "ROLE_WORLD_SIZE": str(world), "ROLE_NAME": "default",
            "TORCHELASTIC_RUN_ID": state_of(procs).id,
        })
    return envs


def _require_whole(procs: ProcMesh, what: str) -> None:
    if len(view_of(procs)) != len(state_of(procs).procs):
        raise ValueError(f"{what} spans the whole proc mesh '{procs.name}' ({len(state_of(procs).procs)} procs), "
                         f"not a slice of {len(view_of(procs))}: call it on the mesh itself")


def setup_torch_elastic_env(procs: ProcMesh, master_addr: str | None = None,
                            master_port: int | None = None) -> None:
    """Set torchrun's environment (MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK, ...) on
    every proc of ``procs``; ``%%on_mesh`` cells can then ``init_process_group()``."""
    _require_whole(procs, "setup_torch_elastic_env")
    g = mesh_group(procs)
    _check_live(g)
    envs = _envs(g, procs, master_addr, master_port)
    g.workers.setup_env.call(envs).get(30)


def _envs(g: MeshGroup, procs, master_addr, master_port) -> list[dict]:
    if master_addr is None or master_port is None:
        host, port = g.workers.slice(**_first(procs)).host_and_port.call_one().get(30)
        master_addr = master_addr or host
        master_port = master_port or port
    return torchrun_env(procs, master_addr, master_port)


def _first(procs: ProcMesh) -> dict:
    return {label: 0 for label in view_of(procs).labels}


def init_process_group(procs: ProcMesh, backend: str | None = None,
                       timeout: float | None = None) -> ProcMesh:
    """torchrun's environment and ``torch.distributed.init_process_group`` on every proc,
    in one step. ``backend``: nccl where the procs have CUDA, gloo otherwise. ``timeout``
    (seconds, default 60): how long a collective waits for a missing peer."""
    _require_whole(procs, "init_process_group")
    g = mesh_group(procs)
    _check_live(g)
    timeout_s = float(timeout if timeout is not None else g.timeout_s)
    if timeout_s <= 0:
        raise ValueError(f"timeout must be positive seconds, got {timeout!r}")
    backend = backend or _default_backend(g)
    if backend not in ("gloo", "nccl", "mpi", "ucc") and ":" not in backend:
        raise ValueError(f"unknown backend {backend!r}: use 'gloo' (CPU), 'nccl' (CUDA), or None to choose")
    envs = _envs(g, procs, None, None)
    g.generation += 1
    st = state_of(procs)
    _formed(procs, g.workers.init_group.call(envs, backend, timeout_s, st.labels, st.sizes, g.generation),
            timeout_s + 30)
    g.backend, g.timeout_s, g.keys, g.broken = backend, timeout_s, tuple(r.key for r in st.procs), None
    if g.engine is not None:
        g.engine.reset(g.generation)
    return procs


def _formed(procs: ProcMesh, fut, timeout_s: float) -> None:
    """Wait for every rank's ``init_group``. When it fails, the error says which ranks were
    still busy, and where, at the moment the first rank failed (a rank that never joined the
    rendezvous names no store key of its own; by the end of the call it may be idle)."""
    deadline = time.monotonic() + timeout_s
    note = None
    while True:
        try:
            fut.get(max(0.0, min(0.5, deadline - time.monotonic())))
            return
        except TimeoutError as e:
            if time.monotonic() >= deadline:
                e.add_note(note or _not_joined(procs))
                raise
            if note is None and any(a and isinstance(v, BaseException)
                                    for a, v in runtime().answered_so_far(fut) or ()):
                note = _not_joined(procs)
        except Exception as e:
            e.add_note(note or _not_joined(procs))
            raise


def _not_joined(procs: ProcMesh) -> str:
    """The ranks of a group that did not form that are still busy, and where."""
    try:
        states = procs.states(timeout=2.0).values()
    except Exception as e:   # (a note must not hide the failure it explains)
        return f"(the ranks' states could not be read: {e})"
    busy = [f"rank {s.get('rank', i)}: {s.get('state')}" + (f", at {s['where']}" if s.get("where") else "")
            for i, s in enumerate(states) if s.get("state") != "idle"]
    return ("ranks still busy when the group failed to form: " + "; ".join(busy)) if busy else \
        "every rank was idle when the group failed to form"


def _default_backend(g: MeshGroup) -> str:
    cuda = g.workers.slice(**{k: 0 for k in view_of(g.workers).labels}).cuda_count.call_one().get(30)
    return "nccl" if cuda else "gloo"


def _check_live(g: MeshGroup) -> None:
    rt = runtime()
    dead = [r.rank for r in g.state.procs if r.key in rt.dead]
    if dead:
        raise RuntimeError(f"ranks {dead} of mesh '{g.state.name}' are dead: a process group needs every "
                           "rank. Call mesh.respawn() first (it forms a new group for the whole mesh)")


def ensure_group(procs: ProcMesh) -> MeshGroup:
    """The group of ``procs``'s mesh, formed (with defaults) on first use."""
    g = mesh_group(procs)
    if not g.formed:
        init_process_group(ProcMesh(state_of(procs)))
    return g


# ---------------------------------------------------------------- deaths and respawns
_listening = False


def _install_listeners() -> None:
    global _listening
    if _listening:
        return
    _listening = True
    rt = runtime()
    rt.death_listeners.append(_on_death)
    from ..core.extensions import register_respawn_hook

    register_respawn_hook(_on_respawn)


def _on_death(key: str, err) -> None:
    """(I/O thread) A proc of a mesh with a group died: its collectives in flight fail on
    the other ranks (gloo sees the closed sockets); interrupt those ranks too, so a rank
    waiting in Python (or about to start the next collective) stops rather than hangs."""
    for g in list(_GROUPS.values()):
        if not g.formed or key not in g.keys:
            continue
        rank = g.keys.index(key)
        g.broken = (f"rank {rank} of mesh '{g.state.name}' died; its process group cannot run collectives. "
                    "Call mesh.respawn(): it forms a new group for the whole mesh")
        rt = runtime()
        for ref in g.state.procs:
            if ref.key != key and ref.key not in rt.dead:
                rt.send(ref.ctrl, g.state.key, ("torch_abort", g.generation))
        ProcMesh(g.state).interrupt()


def _on_respawn(procs: ProcMesh) -> None:
    """After ``respawn()``: form a new group for the whole mesh, and say so."""
    g = _GROUPS.get(state_of(procs).id)
    if g is None or not g.formed:
        return
    replaced = g.stale_ranks()
    if not replaced:
        return
    init_process_group(ProcMesh(state_of(procs)), g.backend, g.timeout_s)
    print(f"torch.distributed: ranks {replaced} were respawned, so mesh '{procs.name}' has a new process group "
          f"(generation {g.generation}, {g.backend}) over all {len(g.keys)} ranks. Collectives in flight when "
          "they died failed; distributed tensors made before are gone (make them again)")
