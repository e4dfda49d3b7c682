"""What a host mesh does after deaths and on re-attach: respawn the dead procs of a proc
mesh with their actors, and rebuild the proc and actor meshes its agents remember (so a
new process, or a restarted kernel, gets the same procs and actors back)."""
from __future__ import annotations

from .errors import HostUnreachableError, MeshFailure, MeshGoneError
from .mesh import ActorMeshState, ProcMeshState
from .messages import Replaced, Spawn
from .runtime import ProcRef, runtime
from .shape import Extent


def respawn_dead(st: ProcMeshState, key: bytes, restart_hint: str) -> None:
    """Replace the dead procs of ``st`` on their live hosts (each agent forks new ones), then
    re-create the actors that lived on them with their original arguments and tell the
    live procs and the agents where the replacements are."""
    rt = runtime()
    dead = [r for r in st.procs if r.key in rt.dead]
    if not dead or st.stopped:
        return
    by_agent: dict[str, list[ProcRef]] = {}
    for r in dead:
        by_agent.setdefault(r.agent, []).append(r)
    futs = [(refs, rt.agent_request(addr, key, "respawn", [r.key for r in refs], rt.contact))
            for addr, refs in by_agent.items()]
    replaced: list[tuple[ProcRef, ProcRef]] = []
    for old, f in futs:
        try:
            new = f.get(60)
        except HostUnreachableError as e:
            raise MeshGoneError(f"cannot respawn proc mesh '{st.name}': {e}. respawn() replaces dead "
                                f"procs on a live host. {restart_hint}") from None
        replaced.extend(zip(sorted(old, key=lambda r: r.rank), sorted(new, key=lambda r: r.rank)))
    rt.forget_procs([old for old, _ in replaced])   # first: a new proc may reuse an old port
    rt.register_procs([n for _, n in replaced], key)
    for old, new in replaced:
        st.procs[new.rank] = new
        rt.dead.pop(old.key, None)
    # Re-create the actors that lived on the replaced procs, with their original arguments.
    new_by_rank = {n.rank: n for _, n in replaced}
    for am in list(st.actor_meshes.values()):
        targets = [new_by_rank[r] for r in am.view.ranks if r in new_by_rank]
        if not targets or am.stopped or am.body is None:
            continue
        keys = [t.key for t in targets]
        call_id, pending = rt.new_call(keys, Extent(("ranks",), (len(keys),)), "mesh",
                                       f"respawn of '{am.name}'")
        frames = rt.pack(key, Spawn.make(am.id, am.name, am.body, am.view, rt.address, call_id))
        for t in targets:
            rt.send_frames(t.work, frames)
        pending.future.get(120)
    # Tell every live proc where the replacements are, and the agents' registries.
    for old, new in replaced:
        for ref in st.procs:
            if ref.key not in rt.dead:
                rt.send(ref.ctrl, key, Replaced.make(old.key, new, key))
    for addr in st.agents():
        rt.agent_send(addr, key, "register", st.id, st.record())


def adopt_registry(hm, infos: list[dict], key: bytes) -> list[ProcMeshState]:
    """On attach: rebuild the states of the proc and actor meshes the agents know (``infos``:
    what each agent said on hello), owned by host mesh ``hm``; returns them."""
    adopted = []
    rt = runtime()
    merged: dict[str, dict] = {}
    for info in infos:
        for mid, rec in info.get("registry", {}).items():
            m = merged.setdefault(mid, {"actors": {}})
            for k, v in rec.items():
                if k == "actors":
                    m["actors"].update(v)
                else:
                    m[k] = v
    dead_keys = {}
    for info in infos:
        dead_keys.update(info.get("dead", {}))
    for mid, rec in merged.items():
        if "procs" not in rec:
            continue
        st = rt.mesh_states.get(mid) or ProcMeshState(mid, rec["name"], key, rec["labels"],
                                                       rec["sizes"], rec["procs"])
        st.host_mesh = hm
        rt.mesh_states[mid] = st
        rt.register_procs(st.procs, key)
        adopted.append(st)
        for aid, arec in rec["actors"].items():
            if aid not in st.actor_meshes:
                am = ActorMeshState(aid, arec["name"], arec["class_name"], arec["endpoints"], st,
                                    arec["view"])
                am.body = arec.get("body")
                st.actor_meshes[aid] = am
        for ref in st.procs:
            if ref.key in dead_keys:
                rt.proc_failed(ref.key, MeshFailure(st.name, ref.rank, ref.host, ref.pid,
                                                    "proc died while no controller was attached", ref.key))
    return adopted
