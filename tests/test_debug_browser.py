"""The debugger widget in a real JupyterLab, clicked through in headless Chromium.

A notebook connects a 2-proc mesh, shows ``%mesh debug``, runs an ``%%on_mesh`` cell in
which rank 1 calls ``breakpoint()``, and stops the mesh. The test waits for the widget's
table to show rank 1, types ``p x`` in the command box, sends it, sees rank 1's pane
answer, clicks continue, and sees the cell finish. Screenshots go to
``$MONARCH_KERNEL_SCREENSHOTS`` (default: the test's tmp dir).

Needs /usr/bin/chromium and the playwright package (scripts/setup.sh installs both when
it can); skips, saying which is missing, otherwise.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
from lab_harness import (
    READY,
    RUN_ALL,
    browser,
    jupyter_lab,
    needs_chromium,
    notebook_page,
    screenshots_dir,
    wait_for_text,
    write_notebook,
)

MESH = "kt-debug-browser"
CELLS = [
    f"%mesh connect {MESH} --procs 2",
    "%mesh debug",
    "%%on_mesh\nx = rank * 10\nif rank == 1:\n    breakpoint()\n    x += 1\nprint('finished', rank, x)\nx",
    f"%mesh stop {MESH}",
]

pytestmark = [needs_chromium]


@pytest.fixture
def lab(tmp_path):
    (tmp_path / "root").mkdir()
    write_notebook(tmp_path / "root" / "debug.ipynb", CELLS)
    with jupyter_lab(tmp_path, "debug.ipynb") as (url, _home):
        yield url


@pytest.mark.timeout(300)
def test_widget_in_jupyterlab_drives_a_paused_rank_until_the_cell_finishes(lab, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install "
                                                                 "playwright; it uses the system Chromium)")
    shots = Path(os.environ.get("MONARCH_KERNEL_SCREENSHOTS", tmp_path))
    shots.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as p:
        ctx = browser(p, tmp_path)
        try:
            page = ctx.pages[0] if ctx.pages else ctx.new_page()
            page.goto(lab)
            page.wait_for_function(READY, timeout=90_000, polling=250)
            # Not awaited: the command's promise resolves only once every cell ran.
            page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")

            row = page.locator(".monarch-debugger-row", has_text="<module>")
            row.first.wait_for(timeout=90_000)
            assert row.first.locator("td").first.inner_text().strip() == "1"   # rank 1 paused
            page.screenshot(path=str(shots / "debug-1-paused.png"))

            page.get_by_placeholder("pdb command for the selected ranks").fill("p x")
            page.get_by_role("button", name="send", exact=True).click()
            pane = page.locator(".monarch-debugger-pane", has_text="(rank 1 pdb) p x")
            pane.first.wait_for(timeout=30_000)
            assert "(rank 1 pdb) p x\n10" in wait_for_text(pane.first, "(rank 1 pdb) p x\n10")
            page.screenshot(path=str(shots / "debug-2-command.png"))

            page.get_by_role("button", name="continue", exact=True).click()
            page.get_by_text("finished 1 11").first.wait_for(timeout=30_000)   # the cell ran on
            page.locator(".jp-OutputArea-output table", has_text="11").first.wait_for(timeout=30_000)  # returned
            page.get_by_text(f"mesh '{MESH}' stopped").first.wait_for(timeout=60_000)
            page.screenshot(path=str(shots / "debug-3-finished.png"), full_page=True)
        finally:
            ctx.close()


BIG = 64
BIG_CELLS = [
    f"%mesh connect {MESH}-big --procs {BIG}",
    "%mesh debug",
    "%%on_mesh\ny = rank * 2\nbreakpoint()\ny += 1\ny",
    f"%mesh stop {MESH}-big",
]


@pytest.mark.timeout(300)
def test_widget_with_every_rank_of_64_paused_stays_small_and_continue_all_ends_the_cell(tmp_path):
    """A breakpoint() left in a cell on every rank: the table is one row (0-63), the pane has a
    dozen rank buttons, not 64, and "continue all" lets the cell finish (round 22: each pause
    redrew a row per rank, 27 MB of widget state at 256 ranks)."""
    shots = screenshots_dir()
    shots.mkdir(parents=True, exist_ok=True)
    with notebook_page(tmp_path, "debug-big.ipynb", BIG_CELLS) as page:
        page.evaluate(RUN_ALL)
        row = page.locator(".monarch-debugger-row", has_text=f"0-{BIG - 1}")
        row.first.wait_for(timeout=120_000)
        assert page.locator(".monarch-debugger-row").count() == 1
        assert f"{BIG} ranks paused" in page.locator(".monarch-debugger").inner_text()
        buttons = page.locator(".monarch-debugger .widget-toggle-buttons button")
        assert 1 <= buttons.count() <= 12, buttons.count()
        page.screenshot(path=str(shots / "debug-big-1-paused.png"), full_page=True)

        page.get_by_role("button", name="continue all", exact=True).click()
        page.locator(".jp-OutputArea-output table", has_text=str(2 * (BIG - 1) + 1)).first.wait_for(
            timeout=60_000)   # every rank ran on: rank 63's y
        page.get_by_text(f"mesh '{MESH}-big' stopped").first.wait_for(timeout=60_000)
        page.screenshot(path=str(shots / "debug-big-2-finished.png"), full_page=True)
