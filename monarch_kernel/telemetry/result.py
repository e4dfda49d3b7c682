"""What a telemetry query returns: a list of row tuples that knows its column names."""
from __future__ import annotations

import datetime
import html

SHOW_ROWS = 50   # rows a repr shows; the list holds them all


class QueryResult(list):
    """Rows as tuples (``result[0]``, ``for time, rank, cpu in result``), with ``.columns``,
    a table repr in the notebook, and ``.to_pandas()`` when pandas is installed."""

    def __init__(self, rows, columns: tuple[str, ...]):
        super().__init__(rows)
        self.columns = tuple(columns)

    def to_pandas(self):
        try:
            import pandas as pd
        except ImportError:
            raise ImportError("to_pandas() needs pandas: pip install pandas (the rows are here as tuples "
                              "meanwhile, with .columns)") from None
        return pd.DataFrame(list(self), columns=list(self.columns))

    def _cells(self, row) -> list[str]:
        return [_fmt(c, v) for c, v in zip(self.columns, row)]

    def __repr__(self):
        shown = [list(self.columns)] + [self._cells(r) for r in self[:SHOW_ROWS]]
        widths = [max(len(r[i]) for r in shown) for i in range(len(self.columns))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in shown]
        if len(self) > SHOW_ROWS:
            lines.append(f"... {len(self)} rows in all")
        return "\n".join(lines) if self.columns else f"QueryResult({list(self)!r})"

    def _repr_pretty_(self, p, cycle):
        p.text(repr(self))

    def _repr_html_(self):
        head = "".join(f"<th>{html.escape(c)}</th>" for c in self.columns)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in self._cells(r)) + "</tr>"
                       for r in self[:SHOW_ROWS])
        more = f"<div>{len(self)} rows in all</div>" if len(self) > SHOW_ROWS else ""
        return f"<table><tr>{head}</tr>{body}</table>{more}"


def _fmt(column: str, v) -> str:
    if v is None:
        return ""
    if column == "time" and isinstance(v, float):
        return datetime.datetime.fromtimestamp(v).strftime("%H:%M:%S.%f")[:-3]
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)
