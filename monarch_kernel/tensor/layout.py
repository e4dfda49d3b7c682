"""Placements: checking what the user asked for, and drawing which rank holds which slice.

Shards follow DTensor's ``torch.chunk`` rule: a dim of length L over n ranks gives each
``ceil(L / n)`` rows, the last ones fewer (or none); uneven shapes are allowed.
"""
from __future__ import annotations

import html
import math

from torch.distributed.tensor import Partial, Placement, Replicate, Shard


def normalize_placements(labels, sizes, placements, ndim: int, what: str) -> tuple:
    """One placement per mesh dim, from a list/tuple (by position) or a dict (by dim name);
    None: replicated everywhere. A bad entry raises naming the dim and the fix."""
    labels = tuple(labels)
    dims = ", ".join(f"{k}={v}" for k, v in zip(labels, sizes)) or "none"
    if placements is None:
        return tuple(Replicate() for _ in labels)
    if isinstance(placements, Placement):
        placements = [placements]
    if isinstance(placements, dict):
        unknown = [k for k in placements if k not in labels]
        if unknown:
            raise ValueError(f"{what}: placements name unknown mesh dims {unknown}; this mesh's dims are "
                             f"{dims}. Use e.g. {{{labels[0]!r}: Shard(0)}}" if labels else "")
        placements = [placements.get(k, Replicate()) for k in labels]
    placements = list(placements)
    if len(placements) != len(labels):
        raise ValueError(f"{what}: {len(placements)} placements for a mesh of {len(labels)} dims ({dims}); give "
                         "one per dim (Shard(d) or Replicate()), or a dict by dim name")
    for label, p in zip(labels, placements):
        if isinstance(p, Partial):
            raise ValueError(f"{what}: Partial() cannot place a local tensor (mesh dim {label!r}); use Shard(d) "
                             "or Replicate()")
        if not isinstance(p, Placement):
            raise TypeError(f"{what}: placement for mesh dim {label!r} is {p!r}; use Shard(d) or Replicate() "
                            "from monarch_kernel.tensor")
        if isinstance(p, Shard) and not -ndim <= p.dim < ndim:
            raise ValueError(f"{what}: Shard({p.dim}) on mesh dim {label!r}, but the tensor has {ndim} dims "
                             f"(0..{ndim - 1})")
    return tuple(Shard(p.dim % ndim) if isinstance(p, Shard) else p for p in placements)


def coords(rank: int, sizes) -> tuple:
    out = []
    for s in reversed(sizes):
        out.append(rank % s)
        rank //= s
    return tuple(reversed(out))


def rank_slices(shape, placements, sizes) -> list[tuple]:
    """For each rank: per tensor dim, the (start, stop) it holds."""
    out = []
    for rank in range(math.prod(sizes)):
        c = coords(rank, sizes)
        spans = [(0, n) for n in shape]
        for mesh_dim, p in enumerate(placements):
            if isinstance(p, Shard):
                start, stop = spans[p.dim]
                length = stop - start
                n = sizes[mesh_dim]
                chunk = -(-length // n) if length else 0
                s = min(c[mesh_dim] * chunk, length)
                spans[p.dim] = (start + s, start + min(s + chunk, length))
        out.append(tuple(spans))
    return out


def _span_text(shape, spans) -> str:
    parts = [":" if (a, b) == (0, n) else f"{a}:{b}" for (a, b), n in zip(spans, shape)]
    return "[" + ", ".join(parts) + "]"


def _describe(h):
    placements, shape, dtype, device = h._fetch_layout()
    st = h._engine.group.state
    places = ", ".join(_place_text(p) for p in placements)
    dims = ", ".join(f"{k}={v}" for k, v in zip(st.labels, st.sizes))
    return placements, tuple(shape), dtype, device, places, dims, st


def _place_text(p) -> str:
    if isinstance(p, Shard):
        return f"Shard({p.dim})"
    if isinstance(p, Replicate):
        return "Replicate()"
    if isinstance(p, Partial):
        return f"Partial({p.reduce_op})"
    return repr(p)


def _cell_text(shape, spans, placements) -> str:
    """What one rank holds: its slice and local shape, or a partial value."""
    part = [p for p in placements if isinstance(p, Partial)]
    note = f" partial {part[0].reduce_op}" if part else ""
    if not spans:
        return "scalar" + note
    return f"{_span_text(shape, spans)} " + "×".join(str(b - a) for a, b in spans) + note


def layout_text(h) -> str:
    placements, shape, dtype, device, places, dims, st = _describe(h)
    spans = rank_slices(shape, placements, st.sizes)
    held = "; ".join(f"rank {r}: {_span_text(shape, s)}" for r, s in enumerate(spans))
    return (f"DistributedTensor(shape={shape}, dtype={dtype}, device={device}, placements=[{places}], "
            f"mesh '{st.name}' ({dims}); {held})")


def layout_html(h) -> str:
    placements, shape, dtype, device, places, dims, st = _describe(h)
    spans = rank_slices(shape, placements, st.sizes)
    sizes = st.sizes or (1,)
    cols = sizes[-1]
    rows = len(spans) // cols if cols else 0
    cells = []
    for r in range(rows):
        tds = []
        for c in range(cols):
            rank = r * cols + c
            tds.append(f"<td style='border:1px solid #999;padding:2px 6px;text-align:center'>"
                       f"<b>rank {rank}</b><br><code>{html.escape(_cell_text(shape, spans[rank], placements))}</code>"
                       "</td>")
        cells.append("<tr>" + "".join(tds) + "</tr>")
    head = (f"<b>DistributedTensor</b> shape <code>{shape}</code>, <code>{dtype}</code>, {device}, "
            f"placements <code>[{html.escape(places)}]</code> on mesh '{html.escape(st.name)}' ({dims})")
    return f"<div>{head}<table style='border-collapse:collapse;margin-top:4px'>{''.join(cells)}</table></div>"
