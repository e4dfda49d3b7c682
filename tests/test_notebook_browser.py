"""What a user sees in JupyterLab (headless Chromium): figures from ranks, the debugger
widget's Enter path and rank switch, the busy indicator, a saved notebook without dead
widgets, the kernel's logo in the launcher.

One JupyterLab and one notebook for the module, run once; the tests then look at it in
order. Screenshots go to ``$MONARCH_KERNEL_SCREENSHOTS`` (default: a temp dir, removed when the run passes).
Needs /usr/bin/chromium and playwright (scripts/setup.sh installs both when it can).
"""
from __future__ import annotations

import json
import time

import pytest
from lab_harness import READY, RUN_ALL, needs_chromium, notebook_page, screenshots_dir, wait_for_text

MESH = "kt-nb-browser"
CELLS = [
    f"%mesh connect {MESH} --procs 5",
    "%%on_mesh --ranks 0,1\nimport matplotlib.pyplot as plt\nplt.figure(figsize=(4, 2.5))\n"
    "plt.plot([0, rank + 1]); plt.title(f'rank {rank}')\nplt.show()",
    "%%on_mesh\nimport matplotlib.pyplot as plt\nfig = plt.figure(figsize=(4, 2.5))\n"
    "plt.bar(['a', 'b'], [1, rank + 1]); plt.title(f'rank {rank}')\ndisplay(fig)\nplt.close(fig)",
    "%mesh debug",
    "%%on_mesh --ranks 0,1\nx = rank * 10\nbreakpoint()\nx += 1\nprint('finished', rank, x)\nx",
    f"%mesh stop {MESH}",
]
pytestmark = [needs_chromium, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    with notebook_page(tmp_path_factory.mktemp("nb-browser"), "user.ipynb", CELLS) as pg:
        pg.evaluate(RUN_ALL)
        yield pg


SHOTS = screenshots_dir()


def shot(page, name: str, **kw) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"notebook-{name}.png"), **kw)


def cell(page, i: int):
    return page.locator(".jp-Notebook .jp-Cell").nth(i)


def test_figures_from_ranks_appear_under_the_cell_side_by_side(page):
    out = cell(page, 1).locator(".jp-OutputArea")
    out.locator(".monarch-rank-grid img").nth(1).wait_for(timeout=90_000)
    assert out.locator("img").count() == 2   # was: "Figure(640x480)" printed by each rank
    assert out.locator(".monarch-rank-label").all_inner_texts() == ["rank 0", "rank 1"]
    cell(page, 1).scroll_into_view_if_needed()
    shot(page, "1-figures-grid")


def test_figures_of_many_ranks_are_tabs_and_a_tab_switches(page):
    out = cell(page, 2).locator(".jp-OutputArea")
    out.locator(".monarch-rank-tabs img").nth(4).wait_for(state="attached", timeout=120_000)
    assert out.locator("img").count() == 5   # display(fig); plt.close(fig) on 5 ranks
    visible = out.locator(".monarch-rank-tab:visible")
    assert visible.count() == 1 and visible.get_attribute("data-rank") == "0"
    out.get_by_text("rank 3", exact=True).first.click()
    assert visible.count() == 1 and visible.get_attribute("data-rank") == "3"
    cell(page, 2).scroll_into_view_if_needed()
    shot(page, "2-figures-tabs")


def test_debugger_widget_enter_rank_switch_and_busy_indicator(page):
    rows = page.locator(".monarch-debugger-row")
    rows.nth(1).wait_for(timeout=90_000)   # ranks 0 and 1 paused
    try:
        select = page.locator(".monarch-debugger select")
        select.select_option(index=1)   # rank 1 in the list ...
        page.locator('.monarch-debugger-pane[data-rank="1"]').wait_for(timeout=10_000)   # ... switches the pane
        box = page.get_by_placeholder("pdb command for the selected ranks")
        box.fill("p x")
        box.press("Enter")   # was: "type a pdb command first"; a second Enter worked
        pane = page.locator('.monarch-debugger-pane[data-rank="1"]', has_text="(rank 1 pdb) p x")
        pane.wait_for(timeout=30_000)
        assert "(rank 1 pdb) p x\n10" in wait_for_text(pane, "(rank 1 pdb) p x\n10")
        assert "type a pdb command first" not in page.locator(".monarch-debugger").inner_text()
        states = []
        for _ in range(10):   # the cell still runs: JupyterLab must say busy, not idle
            states.append(page.evaluate("() => window.jupyterapp.shell.currentWidget.sessionContext"
                                        ".session.kernel.status"))
            time.sleep(0.1)
        assert set(states) == {"busy"}, states
        page.locator(".monarch-debugger").scroll_into_view_if_needed()
        shot(page, "3-debugger")
        setting_state = [e for e in page.console_errors if "Error setting state" in e]
        assert not setting_state, setting_state   # was: "Cannot set properties of undefined (setting 'selected')"
    finally:   # the ranks go on even when a check above fails: the next test needs the kernel idle
        page.get_by_role("button", name="continue all", exact=True).click()
    page.get_by_text("finished 1 11").first.wait_for(timeout=30_000)
    page.get_by_text(f"mesh '{MESH}' stopped").first.wait_for(timeout=60_000)


def test_a_saved_and_reopened_notebook_shows_no_widget_error(page):
    page.wait_for_function(READY, timeout=60_000, polling=250)
    page.get_by_text("mesh debugger: drove ranks 0-1 in this cell").first.wait_for(timeout=30_000)
    page.evaluate("() => window.jupyterapp.commands.execute('docmanager:save')")
    deadline = time.monotonic() + 20
    while "mesh debugger: drove" not in page.notebook.read_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    saved = json.loads(page.notebook.read_text())
    kinds = [k for c in saved["cells"] for o in c["outputs"] for k in o.get("data", {})]
    assert "application/vnd.jupyter.widget-view+json" not in kinds   # the progress bar and the debugger
    connect = saved["cells"][0]["outputs"]
    assert "".join(connect[0]["data"]["text/plain"]) == "starting 5 procs"   # the progress bar, settled
    assert f"mesh '{MESH}': 5 procs (gpus=5) started in" in "".join(connect[1]["text"])
    page.reload()
    page.wait_for_function(READY, timeout=90_000, polling=250)
    cell(page, 2).locator("img").first.wait_for(state="attached", timeout=30_000)
    assert "Error displaying widget" not in page.locator(".jp-Notebook").inner_text()
    shot(page, "4-reopened")
    cell(page, 4).scroll_into_view_if_needed()   # where the debugger widget was
    cell(page, 4).get_by_text("mesh debugger: drove ranks 0-1 in this cell").wait_for(timeout=10_000)
    for i in (0, 4):
        assert "Error displaying widget" not in cell(page, i).inner_text()
    shot(page, "4b-reopened-debugger-cell")


def _open_launcher(page):
    page.evaluate("""async () => { const app = window.jupyterapp;
      const w = await app.commands.execute('launcher:create'); app.shell.activateById(w.id); }""")


# The src of the logo on a shown Monarch launcher card, read in one step in the page: round 11's
# CI counted the card's <img> and then timed out reading its src, the card having been redrawn
# between the two reads (a locator is looked up again on every use).
_MONARCH_CARD_LOGO = """() => Array.from(document.querySelectorAll('.jp-LauncherCard'))
  .filter(c => (c.title || '').includes('Monarch') && c.offsetParent !== null)
  .map(c => c.querySelector('img')).map(i => i && i.getAttribute('src'))
  .find(src => src && src.includes('logo')) || null"""
_LAUNCHER_CARDS = """() => Array.from(document.querySelectorAll('.jp-LauncherCard'))
  .filter(c => (c.title || '').includes('Monarch')).map(c => c.outerHTML.slice(0, 300))"""
_SPEC_RESOURCES = """() => { const s = window.jupyterapp.serviceManager.kernelspecs.specs;
  return JSON.stringify(s && s.kernelspecs.monarch ? s.kernelspecs.monarch.resources : s); }"""


def _wait_for_logo(page, timeout_ms):
    try:
        return page.wait_for_function(_MONARCH_CARD_LOGO, timeout=timeout_ms, polling=250).json_value()
    except Exception:
        return None


def test_the_launcher_shows_the_kernels_logo(page):
    _open_launcher(page)
    page.locator(".jp-LauncherCard[title*='Monarch']:visible").first.wait_for(timeout=30_000)
    src = _wait_for_logo(page, 20_000)   # the card is drawn before its kernelspec logo loads
    if src is None:
        # Seen in CI under load, never alone: the card drew a letter. Say what the page knew of
        # the kernelspec then, and look once more after a refresh of the specs and a new launcher
        # (a letter again fails the test).
        first = (page.evaluate(_LAUNCHER_CARDS), page.evaluate(_SPEC_RESOURCES))
        page.evaluate("() => window.jupyterapp.serviceManager.kernelspecs.refreshSpecs()")
        shot(page, "5-launcher-letter")
        _open_launcher(page)
        src = _wait_for_logo(page, 30_000)
        assert src is not None, f"no logo on the Monarch card twice; the first time: {first}"
    assert "logo" in src   # was: a letter "M" like Markdown's
    shot(page, "5-launcher")
