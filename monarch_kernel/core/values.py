"""ValueMesh: one value per member of a mesh, addressed by named coordinates."""
from __future__ import annotations

import html
from collections.abc import Iterator
from typing import Generic, TypeVar

from .mesh_tables import BIG_TABLE, GAP, rank_rows
from .shape import Extent, Point

T = TypeVar("T")


class ValueMesh(Generic[T]):
    """Results of ``call`` (or of an ``%%on_mesh`` cell), laid out like the mesh called.

    ``items()`` yields ``(Point, value)``; ``values()`` the values in rank order;
    ``item(gpus=1)`` the value at those coords; iterating yields ``(Point, value)``.
    """

    __slots__ = ("_extent", "_values")

    def __init__(self, extent: Extent, values):
        self._extent = extent
        self._values = list(values)
        if len(self._values) != extent.nelements:
            raise ValueError(f"{len(self._values)} values for an extent of {extent.nelements}")

    @property
    def extent(self) -> Extent:
        return self._extent

    def __len__(self):
        return len(self._values)

    def values(self) -> list:
        return list(self._values)

    def items(self) -> Iterator[tuple[Point, object]]:
        for i, v in enumerate(self._values):
            yield Point(i, self._extent), v

    __iter__ = items

    def item(self, **coords):
        labels = self._extent.labels
        unknown = set(coords) - set(labels)
        if unknown:
            raise ValueError(f"unknown dimension(s) {sorted(unknown)}: dims are {list(labels)}")
        missing = [k for k in labels if k not in coords]
        if missing:
            if len(self._values) == 1 and not coords:
                return self._values[0]
            raise ValueError(f"item() needs a coordinate for every dim; missing {missing}")
        rank = 0
        for label, size in zip(labels, self._extent.sizes):
            c = coords[label]
            if not 0 <= c < size:
                raise ValueError(f"{label}={c} is out of range (size {size})")
            rank = rank * size + c
        return self._values[rank]

    def slice(self, **selection) -> ValueMesh:
        """The values of a sub-mesh, as ``mesh.slice(...)`` selects members:
        ``vm.slice(gpus=slice(0, 2))``; an int drops the dim (``vm.slice(hosts=0)``)."""
        from .shape import MeshView

        view = MeshView(self._extent.labels, self._extent.sizes).slice(**selection)
        return ValueMesh(view.extent, [self._values[r] for r in view.ranks])

    def flatten(self, name: str) -> ValueMesh:
        """One dim called ``name`` holding every value in rank order."""
        return ValueMesh(Extent((name,), (len(self._values),)), self._values)

    def get(self, rank: int):
        """The value of the member at ``rank`` (row-major position), as Monarch's ``get``."""
        return self._values[rank]

    def __getitem__(self, rank: int):
        return self._values[rank]

    def __eq__(self, other):
        return isinstance(other, ValueMesh) and (self._extent, self._values) == (other._extent,
                                                                                  other._values)

    def __reduce__(self):
        return (ValueMesh, (self._extent, self._values))

    def __repr__(self):
        """One line: every member's coordinates and value up to 32 members; past that, as
        the table does (core/mesh_tables.py), neighbouring ranks with the same value share
        an entry (``ranks 0-254: None, rank 255: 'diverged'``) and at most 32 entries show."""
        dims = ", ".join(f"{k}={v}" for k, v in self._extent.items())
        if len(self._values) <= BIG_TABLE:
            body = ", ".join(f"{_coord(p)}: {v!r}" for p, v in self.items())
            return f"ValueMesh({dims}) {{{body}}}"
        n = len(self._values)
        rows, note = rank_rows(list(range(n)), [{}] * n, [(repr(v),) for v in self._values],
                               unit=("an entry", "entries"))
        body = ", ".join(GAP if rank == GAP else f"rank{'s' if '-' in rank else ''} {rank}: {value}"
                         for rank, value in rows)
        return f"ValueMesh({dims}) {{{body}}} ({note}; .values() has every rank's)"

    def _repr_html_(self):
        # the same columns as a %%on_mesh cell's ValueMesh: rank, each dim, value
        return values_html(self._extent, range(len(self._values)), self._values)


def values_html(extent: Extent, ranks, values) -> str:
    """A table of ``values`` (rank, each dim, value), read at any size (core/mesh_tables.py):
    past 32 ranks, neighbours with the same value share a row."""
    labels = list(extent.labels)
    points = [Point(i, extent).coords for i in range(len(values))]
    rows, note = rank_rows(list(ranks), points, [(repr(v),) for v in values])
    head = "<th>rank</th>" + "".join(f"<th>{html.escape(k)}</th>" for k in labels) + "<th>value</th>"
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row[:-1])
                   + (f"<td><code>{html.escape(row[-1])}</code></td>" if row[-1] else "<td></td>") + "</tr>"
                   for row in rows)
    dims = ", ".join(f"{k}={v}" for k, v in extent.items())
    note = f"<div>{html.escape(note)} (<code>.values()</code> has every rank's)</div>" if note else ""
    return f"<div><b>ValueMesh</b> ({html.escape(dims)})<table><tr>{head}</tr>{body}</table>{note}</div>"


def _coord(p: Point) -> str:
    c = p.coords
    return ",".join(f"{k}={v}" for k, v in c.items()) if c else str(p.rank)
