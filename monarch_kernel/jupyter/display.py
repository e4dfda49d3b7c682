"""What ``%%on_mesh`` and ``%mesh`` leave in the notebook: results, grouped errors, tables.

Every object here has a short text repr and an HTML repr, and both are deterministic
for the same values (nbval compares them).
"""
from __future__ import annotations

import html

from ..core.errors import MonarchError
from ..core.mesh_tables import GAP, RANKS_CHARS, rank_ranges, rank_rows
from ..core.shape import Extent
from ..core.values import ValueMesh, values_html


class CellValues(ValueMesh):
    """A ValueMesh from ``%%on_mesh`` that remembers the mesh ranks it came from, so the
    table shows rank 4 as rank 4 even when the cell ran on ``--ranks 1,4,6``."""

    __slots__ = ("ranks",)

    def __init__(self, extent: Extent, values, ranks=None):
        super().__init__(extent, values)
        self.ranks = tuple(ranks) if ranks is not None else tuple(range(len(self)))

    def __reduce__(self):
        return (CellValues, (self._extent, self._values, self.ranks))

    def __repr__(self):
        dims = ", ".join(f"{k}={v}" for k, v in self._extent.items())
        lines = [f"ValueMesh({dims})"]
        coords = [{} for _ in self._values]   # (the text form names ranks only)
        rows, note = rank_rows(list(self.ranks), coords, [(repr(v),) for v in self._values])
        for rank, value in rows:
            lines.append(f"  {GAP}" if rank == GAP else f"  rank{'s' if '-' in rank else ''} {rank}: {value}")
        if note:
            lines.append(f"  ({note}; .values() has every rank's)")
        return "\n".join(lines)

    def _repr_pretty_(self, p, cycle):
        p.text(repr(self))

    def _repr_html_(self):
        return values_html(self._extent, self.ranks, self._values)


SHOWN_GROUPS = 5   # errors of a cell shown in full; the rest one line per exception type


class MeshCellError(MonarchError):
    """A cell (or push/pull) raised on some ranks. Identical errors are shown once with
    their ranks; ``results`` is the ValueMesh of every selected rank's outcome (values,
    or a CellFailure / ActorError where it raised), so no rank's result is lost."""

    def __init__(self, groups: list[tuple[list[int], str, str, str]], results=None, note: str = ""):
        # groups: (ranks, exc_type, message, traceback text)
        self.groups = groups
        self.results = results
        self.note = note
        super().__init__(self._summary())

    def _summary(self) -> str:
        shown, rest = self._split()
        out = "; ".join([f"{rank_ranges(r)}: {t}: {m}" if m else f"{rank_ranges(r)}: {t}"
                         for r, t, m, _ in shown] + rest)
        return f"{out} ({self.note})" if self.note else out

    def _render_traceback_(self) -> list[str]:
        """IPython shows these lines instead of the controller-side traceback."""
        red, reset = "\x1b[31m", "\x1b[0m"
        lines = []
        shown, rest = self._split()
        for ranks, t, m, tb in shown:
            lines.append(f"{red}{rank_ranges(ranks)}: {t}: {m}{reset}" if m else
                         f"{red}{rank_ranges(ranks)}: {t}{reset}")
            if tb:
                lines.append(tb.rstrip("\n"))
        lines += [f"{red}{line}{reset}" for line in rest]
        if self.note:
            lines.append(self.note)
        return lines

    def _split(self) -> tuple[list, list[str]]:
        """The groups shown in full (``SHOWN_GROUPS`` at most), and a line per exception type
        for the rest: 256 ranks raising ``ValueError(f"bad value {x}")`` were 256 paragraphs
        with their tracebacks; now 4 of them and 'ranks 4-255: ValueError: 252 other messages,
        as rank 4's: ...'."""
        if len(self.groups) <= SHOWN_GROUPS:
            return self.groups, []
        shown = self.groups[:SHOWN_GROUPS - 1]
        by_type: dict[str, list] = {}
        for ranks, t, m, _ in self.groups[SHOWN_GROUPS - 1:]:
            g = by_type.setdefault(t, [[], 0, ranks[0], m])
            g[0].extend(ranks)
            g[1] += 1
        rest = []
        for t, (ranks, n, first, m) in by_type.items():
            what = f"{n} other messages, as rank {first}'s: {m}" if n > 1 else m
            rest.append(f"{rank_ranges(sorted(ranks), RANKS_CHARS)}: {t}: {what} ({self._where(first)} "
                        "holds it, with its traceback)")
        return shown, rest

    def _where(self, rank: int) -> str:
        """Where rank ``rank``'s outcome is in ``_on_mesh`` (by position: a cell on
        ``--ranks 100-199`` has rank 100's first)."""
        ranks = list(getattr(self.results, "ranks", ()) or ())
        pos = ranks.index(rank) if rank in ranks else rank
        return f"`_on_mesh[{pos}]`" + (f", rank {rank}'s," if pos != rank else "")


_NAMED: dict[tuple[str, type], type] = {}


def cell_error(groups, results=None, note: str = "", base: type = MeshCellError) -> MeshCellError:
    """A MeshCellError whose class is named after the remote exception when every rank
    raised the same type, so the notebook says ``ZeroDivisionError`` (still catchable
    as MeshCellError)."""
    types = {g[1] for g in groups}
    cls = base
    if len(types) == 1:
        name = types.pop()
        if name.isidentifier():
            cls = _NAMED.get((name, base))
            if cls is None:
                cls = _NAMED[(name, base)] = type(name, (base,), {"__module__": "monarch_kernel.remote"})
    return cls(groups, results, note)


class CellInterrupted(MeshCellError, KeyboardInterrupt):
    """The cell was interrupted (the kernel's interrupt, or ``--timeout``) on every rank."""


class Table:
    """A small table with a text and an HTML form (``%mesh status``, ``%mesh list``)."""

    def __init__(self, title: str, head: list[str], rows: list[list], note: str = ""):
        self.title, self.head, self.rows, self.note = title, head, rows, note

    def __repr__(self):
        cols = [self.head] + [[str(c) for c in r] for r in self.rows]
        widths = [max(len(str(row[i])) for row in cols) for i in range(len(self.head))]
        fmt = lambda row: "  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=False)).rstrip()
        lines = [self.title, fmt(self.head)] + [fmt(r) for r in cols[1:]]
        if self.note:
            lines.append(self.note)
        return "\n".join(lines)

    def _repr_pretty_(self, p, cycle):
        p.text(repr(self))

    def _repr_html_(self):
        th = "".join(f"<th>{html.escape(h)}</th>" for h in self.head)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>"
                       for r in self.rows)
        note = "".join(f"<div>{html.escape(line)}</div>" for line in self.note.split("\n")) if self.note else ""
        return f"<div><b>{html.escape(self.title)}</b><table><tr>{th}</tr>{body}</table>{note}</div>"
