"""The rows of a table of a mesh's ranks (a ValueMesh, a cell's values, a ProcMesh), readable
at hundreds of ranks.

Up to ``BIG_TABLE`` ranks every rank has its row, as always. Past that, neighbouring ranks
whose cells read the same share one row (``0-255 | 0-7 | 0-31 | None``: the ranks and each
coordinate as ranges), as identical output lines already do, and at most ``HEAD_ROWS`` +
``TAIL_ROWS`` rows are shown, the first and the last, with a note saying what was left out
(a 256-rank result of distinct values was 256 rows in the notebook).
"""
from __future__ import annotations

BIG_TABLE = 32               # ranks before neighbours that read alike share a row
HEAD_ROWS, TAIL_ROWS = 24, 8  # rows shown of a longer table: its first and its last
GAP = "…"
RANKS_CHARS = 48             # a set of ranks in a line of text past this is cut: '95 ranks (1-3,6,…)'


def rank_rows(ranks: list[int], coords: list[dict], cells: list[tuple], spans: list | None = None,
              unit: tuple[str, str] = ("a row", "rows")) -> tuple[list[list[str]], str]:
    """``[rank, coord..., span?, cell...]`` rows and a note ('' when every rank has a row of
    its own). ``cells``: what a row shows per rank (equal tuples of neighbours merge);
    ``spans`` (optional, e.g. pids): per-rank text that differs anyway, shown as
    ``first…last`` on a merged row; ``unit``: what the note calls a row (one, many)."""
    n = len(ranks)
    groups: list[list[int]] = []
    for i in range(n):
        last = groups[-1] if groups else None
        if (n > BIG_TABLE and last is not None and cells[i] == cells[last[1]]
                and ranks[i] == ranks[last[1]] + 1):
            last[1] = i
        else:
            groups.append([i, i])
    rows = []
    for a, b in groups:
        row = [str(ranks[a]) if a == b else f"{ranks[a]}-{ranks[b]}"]
        for k in coords[a]:
            seen = [c[k] for c in coords[a:b + 1]]
            lo, hi = min(seen), max(seen)
            row.append(str(lo) if lo == hi else f"{lo}-{hi}")
        if spans is not None:
            row.append(str(spans[a]) if a == b else f"{spans[a]}{GAP}{spans[b]}")
        row.extend(str(c) for c in cells[a])
        rows.append(row)
    notes = []
    if len(groups) < n:
        notes.append(f"{n} ranks: neighbours that read alike share {unit[0]}")
    if len(rows) > HEAD_ROWS + TAIL_ROWS:
        left_out = len(rows) - HEAD_ROWS - TAIL_ROWS
        rows = rows[:HEAD_ROWS] + [[GAP] + [""] * (len(rows[0]) - 1)] + rows[-TAIL_ROWS:]
        notes.append(f"{left_out} {unit[1]} not shown")
    return rows, "; ".join(notes)


def alike(said) -> list[tuple[list[int], str]]:
    """``(rank, text)`` pairs -> ``(ranks, text)``, one per distinct text, in the order of
    each text's first rank: what ranks say alike, said once."""
    groups: dict[str, list[int]] = {}
    for rank, text in said:
        groups.setdefault(text, []).append(rank)
    return [(ranks, text) for text, ranks in groups.items()]


def rank_ranges(ranks, limit: int | None = None) -> str:
    """[0, 1, 2, 3, 5] -> 'ranks 0-3,5'; [2] -> 'rank 2'. ``limit``: past that many
    characters of ranges, '95 ranks (1-3,6,11,…)' (ranks scattered over a big mesh)."""
    ranks = list(ranks)
    text = ranges(ranks, limit)
    if text.endswith(GAP):
        return f"{len(ranks)} ranks ({text})"
    return ("rank " if len(ranks) == 1 else "ranks ") + text


def ranges(ranks, limit: int | None = None) -> str:
    """[0, 1, 2, 5] -> '0-2,5' (ranks in order, runs as first-last); ``limit``: cut at the
    last whole range within that many characters, ending ',…'."""
    ranks, parts, i = sorted(ranks), [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    text = ",".join(parts)
    if limit is not None and len(text) > limit and "," in text[:limit]:
        text = text[:text.rfind(",", 0, limit)] + "," + GAP
    return text
