"""HTML reprs of meshes for notebooks: shape, dims, ranks and their state."""
from __future__ import annotations

import html

from .runtime import runtime


def _table(head: list[str], rows: list[list]) -> str:
    th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{th}</tr>{body}</table>"


def proc_mesh_html(pm) -> str:
    st, view = pm._state, pm._view
    dead = runtime().dead
    rows = []
    for i, point in enumerate(view.points()):
        ref = st.procs[view.ranks[i]]
        state = "stopped" if st.stopped else ("dead" if ref.key in dead else "alive")
        rows.append([ref.rank, ", ".join(f"{k}={v}" for k, v in point.coords.items()), ref.host, ref.pid, state])
    title = f"<b>ProcMesh</b> '{html.escape(st.name)}' ({html.escape(view.describe())})"
    return f"<div>{title}{_table(['rank', 'coords', 'host', 'pid', 'state'], rows)}</div>"


def actor_mesh_html(am) -> str:
    st = am._state
    eps = ", ".join(sorted(st.endpoints)) or "none"
    inner = proc_mesh_html(type("_PM", (), {"_state": st.proc_state, "_view": am._view})())
    return (f"<div><b>ActorMesh</b> '{html.escape(st.name)}' of <code>{html.escape(st.class_name)}</code>; "
            f"endpoints: {html.escape(eps)}{inner}</div>")


def host_mesh_html(hm) -> str:
    rows = [[i, info["host"], info["addr"], info["pid"]] for i, info in enumerate(hm._infos)]
    return (f"<div><b>HostMesh</b> '{html.escape(hm.name)}' "
            f"({'persistent' if hm.persistent else 'private'})"
            f"{_table(['host', 'name', 'agent', 'pid'], rows)}</div>")
