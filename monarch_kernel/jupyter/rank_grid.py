"""Rich outputs of one cell from several ranks, side by side or as tabs (one output).

Figures and HTML from many ranks would otherwise stack down the page. Up to
``GRID_MAX`` ranks sit side by side in a grid, each under its rank label; more become
tabs, one per rank (pure HTML and CSS: a saved notebook shows them without the kernel;
where a renderer drops the ``<style>``, every rank's panel shows, one under the other).
Text output is not gathered here: it stays in the stream, labelled line by line.

A cell shows the rich outputs of ``SHOWN_RANKS`` ranks at most (the lowest ranks that
displayed, live or held): a figure on each of 256 ranks was a 6 MB
output, re-sent whole as each figure arrived (hundreds of MB; the cell never finished in a
browser). The others are kept for ``_on_mesh_displays`` (``KeptDisplays``) and a note says so.
"""
from __future__ import annotations

import html
import itertools

GRID_MAX = 4
SHOWN_RANKS = 16            # ranks whose figures a cell shows; the others are kept, not shown
KEEP_BYTES = 64 * 1024**2   # what a cell keeps of its ranks' displays for `_on_mesh_displays`
_ids = itertools.count(1)


class RankDisplay:
    """One display of one rank, kept: ``display(*_on_mesh_displays[100])`` shows rank 100's."""

    __slots__ = ("rank", "data", "metadata")

    def __init__(self, rank: int, data: dict, metadata: dict):
        self.rank, self.data, self.metadata = rank, data, metadata

    def _repr_mimebundle_(self, include=None, exclude=None):
        from .output import label_display

        return label_display(self.rank, self.data, self.metadata)

    def __repr__(self):
        return f"[rank {self.rank}] {_plain(self.data)}"


class KeptDisplays(dict):
    """``rank -> [RankDisplay, ...]``: every rich display of a cell's ranks (up to
    ``KEEP_BYTES``), shown or not; ``not_kept`` counts those past it."""

    def __init__(self):
        super().__init__()
        self.bytes = 0
        self.not_kept = 0

    def keep(self, rank: int, data: dict, metadata: dict) -> None:
        size = sum(len(v) if isinstance(v, (str, bytes)) else 64 for v in data.values())
        if self.bytes + size > KEEP_BYTES:
            self.not_kept += 1
            return
        self.bytes += size
        self.setdefault(rank, []).append(RankDisplay(rank, data, metadata))


def is_rich(data: dict) -> bool:
    """Anything beyond plain text (an image, HTML, SVG...) goes to the grid."""
    return any(k != "text/plain" for k in data)


def grid_bundle(items: list[tuple[int, dict]]) -> tuple[dict, dict]:
    """One display (text/plain + text/html) for ``(rank, data)`` items, kept in order."""
    by_rank: dict[int, list[dict]] = {}
    for rank, data in items:
        by_rank.setdefault(rank, []).append(data)
    ranks = sorted(by_rank)
    text = "\n".join(f"[rank {r}] {_plain(d)}" for r in ranks for d in by_rank[r])
    body = _grid(by_rank, ranks) if len(ranks) <= GRID_MAX else _tabs(by_rank, ranks)
    return {"text/plain": text, "text/html": body}, {"monarch_kernel": {"ranks": ranks}}


def _plain(data: dict) -> str:
    return data.get("text/plain", "").replace("\n", " ")[:200]


def _label(rank: int) -> str:
    return f'<div class="monarch-rank-label" style="font-size:smaller;opacity:.7">rank {rank}</div>'


def _content(data: dict) -> str:
    if "text/html" in data:
        return data["text/html"]
    for mime in ("image/png", "image/jpeg", "image/gif"):
        if mime in data:
            return f'<img src="data:{mime};base64,{data[mime]}" style="max-width:100%;height:auto"/>'
    if "image/svg+xml" in data:
        return data["image/svg+xml"]
    return f"<pre>{html.escape(data.get('text/plain', ''))}</pre>"


def _panel(rank: int, datas: list[dict], cls: str) -> str:
    return (f'<div class="{cls}" data-rank="{rank}" style="min-width:0">{_label(rank)}'
            + "".join(_content(d) for d in datas) + "</div>")


def _grid(by_rank: dict, ranks: list[int]) -> str:
    cells = "".join(_panel(r, by_rank[r], "monarch-rank-cell") for r in ranks)
    return (f'<div class="monarch-rank-grid" style="display:grid;gap:12px;'
            f'grid-template-columns:repeat({len(ranks)},minmax(0,1fr))">{cells}</div>')


def _tabs(by_rank: dict, ranks: list[int]) -> str:
    gid = f"monarch-tabs-{next(_ids)}"
    css = [f"#{gid}>input{{position:absolute;opacity:0;pointer-events:none}}",
           f"#{gid}>label{{display:inline-block;padding:2px 10px;margin-right:2px;cursor:pointer;"
           "border:1px solid #ccc;border-bottom:none;border-radius:4px 4px 0 0;opacity:.7}",
           f"#{gid}>div.monarch-rank-tab{{display:none;border-top:1px solid #ccc;padding-top:6px}}"]
    for i in range(1, len(ranks) + 1):
        css.append(f"#{gid}>input:nth-of-type({i}):checked~div.monarch-rank-tab:nth-of-type({i}){{display:block}}")
        css.append(f"#{gid}>input:nth-of-type({i}):checked~label:nth-of-type({i})"
                   "{opacity:1;font-weight:bold;background:rgba(128,128,128,.15)}")
    radios = "".join(f'<input type="radio" name="{gid}" id="{gid}-{r}"{" checked" if i == 0 else ""}/>'
                     for i, r in enumerate(ranks))
    labels = "".join(f'<label for="{gid}-{r}">rank {r}</label>' for r in ranks)
    panels = "".join(_panel(r, by_rank[r], "monarch-rank-tab") for r in ranks)
    return (f'<div class="monarch-rank-tabs" id="{gid}"><style>{"".join(css)}</style>'
            f"{radios}{labels}{panels}</div>")
