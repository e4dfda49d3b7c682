"""Tables of many ranks stay readable (issue 11: 256 ranks from one notebook): a result of
256 values, a cell's values, a ProcMesh. Small meshes keep a row a rank."""
from __future__ import annotations

import re

from monarch_kernel.core.mesh_tables import BIG_TABLE, HEAD_ROWS, TAIL_ROWS
from monarch_kernel.core.shape import Extent
from monarch_kernel.core.values import ValueMesh
from monarch_kernel.jupyter.display import CellValues

EIGHT_BY_32 = Extent(("hosts", "gpus"), (8, 32))


def _rows(html: str) -> list[list[str]]:
    return [re.findall(r"<td>(?:<code>)?(.*?)(?:</code>)?</td>", tr) for tr in re.findall(r"<tr>(<td>.*?)</tr>", html)]


def test_256_alike_values_are_one_row_with_their_ranks_and_coordinate_ranges():
    html = ValueMesh(EIGHT_BY_32, [None] * 256)._repr_html_()
    assert _rows(html) == [["0-255", "0-7", "0-31", "None"]]
    assert "256 ranks: neighbours that read alike share a row" in html


def test_runs_of_values_keep_rank_order_and_a_lone_odd_rank_its_own_row():
    values = [0] * 37 + ["failed"] + [0] * 90 + [1] * 128
    html = ValueMesh(EIGHT_BY_32, values)._repr_html_()
    assert _rows(html) == [["0-36", "0-1", "0-31", "0"], ["37", "1", "5", "&#x27;failed&#x27;"],
                           ["38-127", "1-3", "0-31", "0"], ["128-255", "4-7", "0-31", "1"]]


def test_256_distinct_values_show_the_first_and_last_rows_and_say_how_many_are_left_out():
    html = ValueMesh(EIGHT_BY_32, list(range(256)))._repr_html_()
    rows = _rows(html)
    assert len(rows) == HEAD_ROWS + 1 + TAIL_ROWS
    assert [r[0] for r in rows[:3]] == ["0", "1", "2"] and rows[HEAD_ROWS][0] == "…"
    assert rows[-1] == ["255", "7", "31", "255"]
    assert f"{256 - HEAD_ROWS - TAIL_ROWS} rows not shown" in html and ".values()</code> has every rank" in html


def test_a_small_mesh_keeps_a_row_per_rank_even_when_values_are_alike():
    n = BIG_TABLE
    html = ValueMesh(Extent(("gpus",), (n,)), [None] * n)._repr_html_()
    assert [r[0] for r in _rows(html)] == [str(i) for i in range(n)] and "share a row" not in html


def test_a_cells_values_text_names_rank_runs_and_keeps_the_mesh_ranks():
    ranks = list(range(100, 164))   # a cell on --ranks 100-163 of a bigger mesh
    text = repr(CellValues(Extent(("gpus",), (64,)), ["ok"] * 63 + ["slow"], ranks))
    assert text.splitlines() == ["ValueMesh(gpus=64)", "  ranks 100-162: 'ok'", "  rank 163: 'slow'",
                                 "  (64 ranks: neighbours that read alike share a row; .values() has every rank's)"]
    assert repr(CellValues(Extent(("gpus",), (2,)), [1, 1])) == "ValueMesh(gpus=2)\n  rank 0: 1\n  rank 1: 1"


def test_a_value_meshs_one_line_text_stays_short_at_256_ranks():
    odd = repr(ValueMesh(EIGHT_BY_32, [None] * 255 + ["diverged"]))
    assert odd == ("ValueMesh(hosts=8, gpus=32) {ranks 0-254: None, rank 255: 'diverged'} "
                   "(256 ranks: neighbours that read alike share an entry; .values() has every rank's)")
    distinct = repr(ValueMesh(EIGHT_BY_32, list(range(256))))
    assert distinct.count("rank ") == HEAD_ROWS + TAIL_ROWS and "rank 23: 23, …, rank 248: 248" in distinct
    assert distinct.endswith(f"({256 - HEAD_ROWS - TAIL_ROWS} entries not shown; .values() has every rank's)")
    small = repr(ValueMesh(Extent(("gpus",), (BIG_TABLE,)), [None] * BIG_TABLE))   # a member each, as before
    assert small.count(": None") == BIG_TABLE and small.startswith("ValueMesh(gpus=32) {gpus=0: None, gpus=1: None")
