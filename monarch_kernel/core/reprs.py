"""HTML reprs of meshes for notebooks: shape, dims, ranks and their state."""
from __future__ import annotations

import html

from .mesh import state_of, view_of
from .runtime import runtime


def _table(head: list[str], rows: list[list]) -> str:
    th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{th}</tr>{body}</table>"


def proc_mesh_html(pm) -> str:
    st, view = state_of(pm), view_of(pm)
    dead = runtime().dead
    rows = []
    for i, point in enumerate(view.points()):
        ref = st.procs[view.ranks[i]]
        state = "stopped" if st.stopped else ("dead" if ref.key in dead else "alive")
        rows.append([ref.rank, ", ".join(f"{k}={v}" for k, v in point.coords.items()), ref.host, ref.pid, state])
    title = f"<b>ProcMesh</b> '{html.escape(st.name)}' ({html.escape(view.describe())})"
    return f"<div>{title}{_table(['rank', 'coords', 'host', 'pid', 'state'], rows)}</div>"


def actor_mesh_html(am) -> str:
    """What the actors are: their class, endpoints, ranks, and the procs and hosts they
    live on (``%mesh status`` has the per-proc detail)."""
    st, view = state_of(am), view_of(am)
    ps = st.proc_state
    dead = runtime().dead
    refs = [ps.procs[r] for r in view.ranks]
    gone = [r.rank for r in refs if r.key in dead]
    state = "stopped" if st.stopped or ps.stopped else (f"alive; dead: {_ranges(gone)}" if gone else "alive")
    hosts = sorted({r.host for r in refs})
    rows = [("class", f"<code>{html.escape(st.class_name)}</code>"),
            ("endpoints", html.escape(", ".join(sorted(st.endpoints)) or "none")),
            ("ranks", f"{html.escape(_ranges([r.rank for r in refs]))} ({html.escape(view.describe())})"),
            ("on", f"ProcMesh '{html.escape(ps.name)}' (host{'s' if len(hosts) != 1 else ''} "
                   f"{html.escape(', '.join(hosts))})"),
            ("state", html.escape(state))]
    body = "".join(f"<tr><th style='text-align:left'>{k}</th><td style='text-align:left'>{v}</td></tr>"
                   for k, v in rows)
    return (f"<div><b>ActorMesh</b> '{html.escape(st.name)}': {len(refs)} "
            f"actor{'s' if len(refs) != 1 else ''}<table>{body}</table></div>")


def _ranges(ranks) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    ranks, parts, i = sorted(ranks), [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ",".join(parts)


def host_mesh_html(hm) -> str:
    rows = [[i, info["host"], info["addr"], info["pid"]] for i, (_, info) in enumerate(hm.agents_and_infos())]
    return (f"<div><b>HostMesh</b> '{html.escape(hm.name)}' "
            f"({'persistent' if hm.persistent else 'private'})"
            f"{_table(['host', 'name', 'agent', 'pid'], rows)}</div>")
