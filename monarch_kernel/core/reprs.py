"""HTML reprs of meshes for notebooks: shape, dims, ranks and their state."""
from __future__ import annotations

import html

from .mesh import state_of, view_of
from .mesh_tables import ranges, rank_rows
from .runtime import runtime


def _table(head: list[str], rows: list[list]) -> str:
    th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{th}</tr>{body}</table>"


def proc_mesh_html(pm) -> str:
    """Rank, coords, host, pid, state; past 32 ranks the neighbours on one host in one state
    share a row (core/mesh_tables.py)."""
    st, view = state_of(pm), view_of(pm)
    dead = runtime().dead
    ranks, coords, cells, pids = [], [], [], []
    for i, point in enumerate(view.points()):
        ref = st.procs[view.ranks[i]]
        ranks.append(ref.rank)
        coords.append(point.coords)
        cells.append((ref.host, "stopped" if st.stopped else ("dead" if ref.key in dead else "alive")))
        pids.append(ref.pid)
    labels = list(coords[0]) if coords else []
    merged, note = rank_rows(ranks, coords, cells, pids)
    rows = [[rank, ", ".join(f"{k}={v}" for k, v in zip(labels, where) if v), host, pid, state]
            for rank, *where, pid, host, state in merged]
    title = f"<b>ProcMesh</b> '{html.escape(st.name)}' ({html.escape(view.describe())})"
    note = f"<div>{html.escape(note)} (<code>%mesh status</code> lists each)</div>" if note else ""
    return f"<div>{title}{_table(['rank', 'coords', 'host', 'pid', 'state'], rows)}{note}</div>"


def actor_mesh_html(am) -> str:
    """What the actors are: their class, endpoints, ranks, and the procs and hosts they
    live on (``%mesh status`` has the per-proc detail)."""
    st, view = state_of(am), view_of(am)
    ps = st.proc_state
    dead = runtime().dead
    refs = [ps.procs[r] for r in view.ranks]
    gone = [r.rank for r in refs if r.key in dead]
    state = "stopped" if st.stopped or ps.stopped else (f"alive; dead: {ranges(gone)}" if gone else "alive")
    hosts = sorted({r.host for r in refs})
    rows = [("class", f"<code>{html.escape(st.class_name)}</code>"),
            ("endpoints", html.escape(", ".join(sorted(st.endpoints)) or "none")),
            ("ranks", f"{html.escape(ranges([r.rank for r in refs]))} ({html.escape(view.describe())})"),
            ("on", f"ProcMesh '{html.escape(ps.name)}' (host{'s' if len(hosts) != 1 else ''} "
                   f"{html.escape(_some(hosts))})"),
            ("state", html.escape(state))]
    body = "".join(f"<tr><th style='text-align:left'>{k}</th><td style='text-align:left'>{v}</td></tr>"
                   for k, v in rows)
    return (f"<div><b>ActorMesh</b> '{html.escape(st.name)}': {len(refs)} "
            f"actor{'s' if len(refs) != 1 else ''}<table>{body}</table></div>")


def _some(names: list[str], most: int = 4) -> str:
    """'a, b, c' or, for many, 'a, b, c, … (256 in all)'."""
    if len(names) <= most:
        return ", ".join(names)
    return ", ".join(names[:most - 1]) + f", … ({len(names)} in all)"


def host_mesh_html(hm) -> str:
    rows = [[i, info["host"], info["addr"], info["pid"]] for i, (_, info) in enumerate(hm.agents_and_infos())]
    return (f"<div><b>HostMesh</b> '{html.escape(hm.name)}' "
            f"({'persistent' if hm.persistent else 'private'})"
            f"{_table(['host', 'name', 'agent', 'pid'], rows)}</div>")
