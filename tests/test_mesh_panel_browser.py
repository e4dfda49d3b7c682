"""The JupyterLab extension in a real JupyterLab and headless Chromium: the Mesh sidebar,
the status-bar item, "insert connect cell", the "on mesh" cell button, a killed proc
turning dead (red), respawn, logs, a rank paused in the debugger (amber), ``%mesh top``
refreshing, and the panel's stop button.

Screenshots go to ``$MONARCH_KERNEL_SCREENSHOTS`` (default: the test's tmp dir). Needs
/usr/bin/chromium, playwright, and the built extension (scripts/build_extension.sh, run
by scripts/setup.sh when npm is there); skips, saying which is missing, otherwise.
"""
from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
from lab_harness import (
    CHROMIUM,
    CHROMIUM_ARGS,
    READY,
    RUN_ALL,
    extension_installed,
    jupyter_lab,
    notebook_page,
    write_notebook,
)

MESH = "kt-mesh-panel"
CELLS = [f"%mesh connect {MESH} --procs 2", "%mesh top",
         'import os\nprint("hello from", os.environ.get("RANK", "here"))']

pytestmark = [
    pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"no Chromium at {CHROMIUM} (scripts/setup.sh "
                                                            "installs it with apt-get when it can)"),
    pytest.mark.skipif(not extension_installed(), reason="the JupyterLab extension is not built (scripts/"
                                                         "build_extension.sh needs npm and the npm registry)"),
]


@pytest.mark.timeout(300)
def test_mesh_panel_status_bar_and_buttons_follow_the_mesh(tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install "
                                                                 "playwright; it uses the system Chromium)")
    shots = Path(os.environ.get("MONARCH_KERNEL_SCREENSHOTS", tmp_path))
    shots.mkdir(parents=True, exist_ok=True)
    (tmp_path / "root").mkdir()
    write_notebook(tmp_path / "root" / "mesh.ipynb", CELLS)
    with jupyter_lab(tmp_path, "mesh.ipynb") as (url, _home), sync_api.sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(str(tmp_path / "chromium"), executable_path=CHROMIUM,
                                                   headless=True, viewport={"width": 1400, "height": 900},
                                                   args=CHROMIUM_ARGS)
        try:
            page = ctx.pages[0] if ctx.pages else ctx.new_page()
            page.on("dialog", lambda d: d.accept())
            page.goto(url)
            page.wait_for_function(READY, timeout=90_000, polling=250)
            page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
            page.evaluate("() => window.jupyterapp.commands.execute('monarch:show-meshes')")

            # the panel lists the mesh with its 2 procs, marked as this notebook's
            mesh = page.locator(f".mk-mesh[data-mesh='{MESH}']")
            mesh.locator(".mk-proc").nth(1).wait_for(timeout=90_000)
            assert mesh.locator(".mk-badge").inner_text() == "this notebook"
            sparks = f"document.querySelectorAll(\".mk-mesh[data-mesh='{MESH}'] .mk-spark polyline\").length"
            page.wait_for_function(f"() => {sparks} >= 4", timeout=30_000)   # CPU and memory lines of 2 ranks
            status = page.locator(".mk-status-item")
            status.filter(has_text=f"mesh {MESH} · 2 procs").wait_for(timeout=30_000)
            assert re.fullmatch(rf"mesh {MESH} · 2 procs · lease \d+ min", status.inner_text().strip())

            # %mesh top refreshes on its own while the notebook is idle
            top = page.locator(".monarch-top")
            top.first.wait_for(timeout=30_000)
            n0 = int(re.search(r"update (\d+)", top.first.inner_text()).group(1))
            page.wait_for_function(f"""() => {{ const t = document.querySelector('.monarch-top');
                return t && +(/update (\\d+)/.exec(t.innerText) || [0, 0])[1] >= {n0 + 2}; }}""", timeout=10_000)
            page.screenshot(path=str(shots / "mesh-1-panel-and-top.png"))

            # a killed proc turns dead in the panel within 2 s, and the status bar goes red
            row = mesh.locator(".mk-proc[data-rank='1']")
            pid = int(row.get_attribute("data-pid"))
            t0 = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            page.wait_for_selector(f".mk-mesh[data-mesh='{MESH}'] .mk-proc[data-rank='1'][data-state='dead']",
                                   timeout=5_000)
            took = time.monotonic() - t0
            assert took < 2.0, f"the panel showed the death after {took:.2f} s"
            page.locator(".mk-status-item.mk-red").wait_for(timeout=3_000)
            assert "1 dead" in status.inner_text()
            page.screenshot(path=str(shots / "mesh-2-dead-proc.png"))

            # "insert connect cell" puts the connect line into the notebook
            mesh.get_by_role("button", name="insert connect cell").click()
            page.wait_for_function(f"""() => window.jupyterapp.shell.currentWidget.content.widgets
                .some(c => c.model.sharedModel.getSource() === '%mesh connect {MESH}')""", timeout=5_000)

            # "respawn dead" replaces the dead proc (this notebook is attached to the mesh)
            mesh.get_by_role("button", name="respawn dead").click()
            page.wait_for_selector(f".mk-mesh[data-mesh='{MESH}'] .mk-proc[data-rank='1'][data-state='idle']",
                                   timeout=30_000)
            page.locator(".mk-status-item:not(.mk-red)").wait_for(timeout=5_000)

            # the cell button runs a cell on the mesh
            page.evaluate("""() => { const nb = window.jupyterapp.shell.currentWidget.content;
                nb.activeCellIndex = nb.widgets.findIndex(c => c.model.sharedModel.getSource().includes('hello'));
                }""")
            page.locator(".jp-Cell.jp-mod-active .jp-cell-toolbar").get_by_text("on mesh").click()
            page.get_by_text("hello from 1").first.wait_for(timeout=30_000)   # ran on rank 1 (RANK=1 there)
            assert page.evaluate("""() => window.jupyterapp.shell.currentWidget.content.widgets
                .some(c => c.model.sharedModel.getSource().startsWith('%%on_mesh\\nimport os'))""")
            page.screenshot(path=str(shots / "mesh-3-after-respawn-and-on-mesh.png"))

            # "logs" opens the ranks' output kept on the host
            mesh.get_by_role("button", name="logs").click()
            page.locator(".mk-logs pre", has_text="[rank 1] hello from 1").wait_for(timeout=15_000)
            page.screenshot(path=str(shots / "mesh-4-logs.png"))
            page.evaluate("() => window.jupyterapp.shell.activateById(window.jupyterapp.shell.widgets('main')"
                          ".next().value.id)")   # back to the notebook

            # a rank paused in the debugger: amber in the panel and the status bar
            page.evaluate("""async () => { const app = window.jupyterapp; const nb = app.shell.currentWidget.content;
                nb.activeCellIndex = nb.widgets.length - 1;
                await app.commands.execute('notebook:insert-cell-below');
                nb.activeCell.model.sharedModel.setSource('%mesh debug');
                await app.commands.execute('notebook:run-cell-and-select-next');
                nb.activeCell.model.sharedModel.setSource(
                    '%%on_mesh\\nx = rank\\nif rank == 1:\\n    breakpoint()\\nprint("resumed", rank)');
                app.commands.execute('notebook:run-cell'); }""")
            page.wait_for_selector(f".mk-mesh[data-mesh='{MESH}'] .mk-proc[data-rank='1'][data-state^='paused']",
                                   timeout=60_000)
            page.locator(".mk-status-item.mk-amber").wait_for(timeout=5_000)
            assert "1 paused" in status.inner_text()
            page.screenshot(path=str(shots / "mesh-5-paused.png"))
            page.get_by_role("button", name="continue", exact=True).click()   # the %mesh debug widget's
            page.get_by_text("resumed 1").first.wait_for(timeout=30_000)
            page.wait_for_selector(f".mk-mesh[data-mesh='{MESH}'] .mk-proc[data-rank='1'][data-state='idle']",
                                   timeout=10_000)

            # stop, from the panel: the mesh goes away
            mesh.get_by_role("button", name="stop").click()
            mesh.wait_for(state="detached", timeout=20_000)
            page.screenshot(path=str(shots / "mesh-6-stopped.png"))
        finally:
            ctx.close()


@pytest.mark.timeout(300)
def test_a_mesh_of_40_ranks_shows_a_row_a_host_its_dead_rank_apart_and_every_rank_on_asking(tmp_path):
    """Past 32 ranks the panel has a row a host (256 rows of sparklines redrawn every second
    were a page of their own, and the host column pushed memory out of the narrow sidebar)."""
    shots = Path(os.environ.get("MONARCH_KERNEL_SCREENSHOTS", tmp_path))
    shots.mkdir(parents=True, exist_ok=True)
    big = "kt-mesh-panel-big"
    with notebook_page(tmp_path, "big.ipynb", [f"%mesh connect {big} --hosts 2 --procs 20"]) as page:
        page.on("dialog", lambda d: d.accept())   # stop asks first
        page.evaluate(RUN_ALL)
        page.evaluate("() => window.jupyterapp.commands.execute('monarch:show-meshes')")
        mesh = page.locator(f".mk-mesh[data-mesh='{big}']")
        mesh.locator(".mk-host").nth(1).wait_for(timeout=120_000)
        hosts = mesh.locator(".mk-host")
        assert hosts.count() == 2 and mesh.locator(".mk-proc").count() == 0
        page.wait_for_function(f"""() => [...document.querySelectorAll(".mk-mesh[data-mesh='{big}'] .mk-host")]
            .map(e => e.textContent).join('|').includes('20-39 · 20 idle')""", timeout=30_000)
        assert re.search(r"/hosts0\s*0-19 · 20 idle", hosts.nth(0).text_content())
        table = mesh.locator(".mk-procs").first
        assert table.bounding_box()["width"] <= mesh.bounding_box()["width"]   # memory is not cut off

        # every rank on asking, under a line per host; its pids are what a user can kill
        mesh.get_by_role("button", name="all 40 ranks").click()
        mesh.locator(".mk-proc").nth(39).wait_for(timeout=5_000)
        assert mesh.locator(".mk-host-line").count() == 2
        pid = int(mesh.locator(".mk-proc[data-rank='25']").get_attribute("data-pid"))
        stopped = int(mesh.locator(".mk-proc[data-rank='24']").get_attribute("data-pid"))
        page.screenshot(path=str(shots / "mesh-big-1-all-ranks.png"))
        mesh.get_by_role("button", name="a row a host").click()
        mesh.locator(".mk-host").nth(1).wait_for(timeout=5_000)

        # a rank stopped by a signal: its host's agent says so, amber, a row of its own; back on kill -CONT
        os.kill(stopped, signal.SIGSTOP)
        try:
            page.wait_for_selector(f".mk-mesh[data-mesh='{big}'] .mk-look .mk-proc[data-rank='24']"
                                   "[data-state='stopped (signal)']", timeout=15_000)
            assert "1 stopped (signal)" in hosts.nth(1).text_content()
            assert "mk-paused" in hosts.nth(1).get_attribute("class")
            cell = mesh.locator(".mk-look .mk-proc[data-rank='24'] .mk-state")
            # read whole in the narrow sidebar (it was cut to "stoppe…")
            assert cell.evaluate("e => e.scrollWidth <= e.clientWidth"), cell.evaluate("e => e.outerHTML")
            assert cell.inner_text().split() == ["stopped", "(signal)"]
            page.screenshot(path=str(shots / "mesh-big-2-stopped-rank.png"))
        finally:
            os.kill(stopped, signal.SIGCONT)
        mesh.locator(".mk-look").wait_for(state="detached", timeout=15_000)

        # a killed rank: its host row says so, and the rank has a row of its own, dead
        os.kill(pid, signal.SIGKILL)
        page.wait_for_selector(f".mk-mesh[data-mesh='{big}'] .mk-look .mk-proc[data-rank='25'][data-state='dead']",
                               timeout=5_000)
        assert "19 idle · 1 dead" in hosts.nth(1).text_content()
        assert "mk-dead" in hosts.nth(1).get_attribute("class")
        assert mesh.locator(".mk-proc").count() == 1
        page.screenshot(path=str(shots / "mesh-big-3-dead-rank.png"))

        def status_says(*words: str) -> None:
            page.wait_for_function(f"""() => {{
                const s = document.querySelector(".mk-mesh[data-mesh='{big}'] .mk-status");
                return s && {json.dumps(list(words))}.every(w => s.textContent.includes(w)); }}""", timeout=20_000)

        # a host whose agent does not answer (stopped; on a cluster, cut off): its ranks stay
        # listed, unreachable, amber (they vanished, and nothing said so), its dead rank dead
        with open(os.path.join(page.home, "meshes", f"{big}.json")) as f:
            agent = json.load(f)["agents"][1]["pid"]
        os.kill(agent, signal.SIGSTOP)
        try:
            status_says("40 procs on 2 hosts", "· 1 host not answering (ranks 20-24,26-39)", "· 1 dead")
            assert re.search(r"20-39 · 19 unreachable · 1 dead", hosts.nth(1).text_content())
            # (its host row says it: 32 rows a lost host at 256 ranks would be a page of their own)
            assert [r.get_attribute("data-rank") for r in mesh.locator(".mk-look .mk-proc").all()] == ["25"]
            page.screenshot(path=str(shots / "mesh-big-4-host-not-answering.png"))
        finally:
            # a host lost (its agent killed): the other host's ranks stay listed, the mesh says
            # "1 host gone" with the ranks it had, and its stop still ends the rest (it read
            # "not running", stop disabled)
            os.kill(agent, signal.SIGKILL)
        status_says("20 procs on", "· 1 host gone (ranks 20-39)")
        assert "host gone" in hosts.nth(1).text_content() and "mk-dead" in hosts.nth(1).get_attribute("class")
        assert mesh.get_by_role("button", name="stop").is_enabled()
        assert not mesh.get_by_role("button", name="respawn dead").is_enabled()   # (its host is gone)
        assert "mk-has-dead" in mesh.get_attribute("class")
        page.screenshot(path=str(shots / "mesh-big-5-host-gone.png"))
        mesh.get_by_role("button", name="stop").click()
        mesh.wait_for(state="detached", timeout=30_000)
