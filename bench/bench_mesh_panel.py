"""How fast the JupyterLab Mesh panel shows a proc's death (JSON lines).

  python bench/bench_mesh_panel.py [--kills 5]

A real JupyterLab (loopback, bounded) and headless Chromium, as in
tests/test_mesh_panel_browser.py: a notebook connects a 2-proc mesh, the panel is shown;
then, ``--kills`` times: SIGKILL rank 1, time until its row says ``dead``, respawn it with
the panel's button. The panel asks the server once a second, so the figure is at most a
period plus one answer; it also prints the server's answer time for /monarch/meshes.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
from lab_harness import CHROMIUM, CHROMIUM_ARGS, READY, jupyter_lab, write_notebook  # noqa: E402

MESH = "bench-mesh-panel"


def emit(metric: str, value, unit: str, **extra) -> None:
    print("JSON " + json.dumps({"system": "monarch-kernel", "metric": metric, "value": value, "unit": unit, **extra}),
          flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kills", type=int, default=5)
    a = ap.parse_args()
    from playwright.sync_api import sync_playwright

    tmp = Path(tempfile.mkdtemp(prefix="mk-bench-panel-"))
    (tmp / "root").mkdir()
    write_notebook(tmp / "root" / "b.ipynb", [f"%mesh connect {MESH} --procs 2"])
    with jupyter_lab(tmp, "b.ipynb") as (url, _home), sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(str(tmp / "chromium"), executable_path=CHROMIUM, headless=True,
                                                   args=CHROMIUM_ARGS)
        try:
            page = ctx.pages[0] if ctx.pages else ctx.new_page()
            page.on("dialog", lambda d: d.accept())
            page.goto(url)
            page.wait_for_function(READY, timeout=90_000, polling=250)
            page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
            page.evaluate("() => window.jupyterapp.commands.execute('monarch:show-meshes')")
            sel = f".mk-mesh[data-mesh='{MESH}'] .mk-proc[data-rank='1']"
            page.wait_for_selector(f"{sel}[data-state='idle']", timeout=90_000)
            api = url.split("/lab/")[0] + "/monarch/meshes?token=" + url.split("token=")[1]
            answers = []
            for _ in range(10):
                t0 = time.perf_counter()
                urllib.request.urlopen(api, timeout=10).read()
                answers.append(time.perf_counter() - t0)
            emit("panel_api_answer_ms", round(statistics.median(answers) * 1e3, 1), "ms", runs=10)
            took = []
            for _ in range(a.kills):
                pid = int(page.get_attribute(sel, "data-pid"))
                t0 = time.perf_counter()
                os.kill(pid, signal.SIGKILL)
                page.wait_for_selector(f"{sel}[data-state='dead']", timeout=10_000, state="attached")
                took.append(time.perf_counter() - t0)
                page.locator(f".mk-mesh[data-mesh='{MESH}']").get_by_role("button", name="respawn dead").click()
                page.wait_for_selector(f"{sel}[data-state='idle']", timeout=30_000)
                time.sleep(0.37)   # vary the phase against the panel's 1 s period
            emit("panel_death_shown_s_median", round(statistics.median(took), 3), "s", kills=a.kills,
                 max=round(max(took), 3), min=round(min(took), 3))
            page.locator(f".mk-mesh[data-mesh='{MESH}']").get_by_role("button", name="stop").click()
            page.wait_for_selector(f".mk-mesh[data-mesh='{MESH}']", state="detached", timeout=20_000)
        finally:
            ctx.close()


if __name__ == "__main__":
    main()
