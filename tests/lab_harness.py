"""A bounded JupyterLab on loopback for browser tests (headless Chromium via Playwright),
with its own config, runtime and MONARCH_KERNEL_HOME; see ../shared/RECIPES.md."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from kernel_harness import ensure_kernelspec, home_processes

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
READY = """() => {
  const app = window.jupyterapp; const w = app && app.shell.currentWidget;
  const ctx = w && w.sessionContext; const k = ctx && ctx.session && ctx.session.kernel;
  return !!(ctx && ctx.isReady && k && k.connectionStatus === 'connected' && k.status === 'idle');
}"""


SCREENSHOTS_TMP: Path | None = None   # the run's own screenshot folder (conftest removes it if the run passed)


def screenshots_dir() -> Path:
    """Where browser tests save their screenshots: ``$MONARCH_KERNEL_SCREENSHOTS`` (kept),
    else one temporary folder for the run, removed at its end when every test passed and
    named in the summary when one failed (each run had left 1 MB of them in /tmp)."""
    global SCREENSHOTS_TMP
    if os.environ.get("MONARCH_KERNEL_SCREENSHOTS"):
        return Path(os.environ["MONARCH_KERNEL_SCREENSHOTS"])
    if SCREENSHOTS_TMP is None:
        SCREENSHOTS_TMP = Path(tempfile.mkdtemp(prefix="mk-screens-"))
    return SCREENSHOTS_TMP


def wait_for_text(locator, text: str, timeout: float = 30) -> str:
    """The locator's inner text once it holds ``text`` (or as it stands at the deadline).

    A debugger pane shows the echoed command at once and the rank's answer a moment later:
    waiting for the echo and then reading the answer raced (round 19's CI).
    """
    deadline = time.monotonic() + timeout
    seen = locator.inner_text()
    while text not in seen and time.monotonic() < deadline:
        time.sleep(0.1)
        seen = locator.inner_text()
    return seen


def write_notebook(path: Path, cells: list[str]) -> None:
    nb = {"cells": [{"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [], "source": src}
                    for src in cells],
          "nbformat": 4, "nbformat_minor": 5,
          "metadata": {"kernelspec": {"name": "monarch", "display_name": "Monarch (Python 3)", "language": "python"}}}
    path.write_text(json.dumps(nb))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def jupyter_lab(tmp_path: Path, notebook: str, home: str | None = None):
    """Yields (url of ``notebook`` under ``tmp_path/root``, MONARCH_KERNEL_HOME); stops Lab
    and kills whatever it left under that home."""
    ensure_kernelspec()
    home = home or tempfile.mkdtemp(prefix="mk-lab-test-")
    port, token = _free_port(), "labtest"
    env = {**os.environ, "MONARCH_KERNEL_HOME": home, "MONARCH_KERNEL_PREWARM": "0",
           "JUPYTER_CONFIG_DIR": str(tmp_path / "config"), "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime")}
    jupyter = str(Path(sys.executable).parent / "jupyter")
    no_news = tmp_path / "config" / "lab" / "user-settings" / "@jupyterlab" / "apputils-extension"
    no_news.mkdir(parents=True, exist_ok=True)
    (no_news / "notification.jupyterlab-settings").write_text('{"fetchNews": "false", "checkForUpdates": false}')
    log = open(tmp_path / "lab.log", "w")
    proc = subprocess.Popen(
        ["timeout", "600", jupyter, "lab", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
         f"--IdentityProvider.token={token}", "--allow-root", f"--ServerApp.root_dir={tmp_path / 'root'}",
         "--LabApp.news_url=None", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
         "--LabApp.expose_app_in_browser=True"], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status?token={token}", timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"JupyterLab did not start: {(tmp_path / 'lab.log').read_text()[-2000:]}")
                time.sleep(0.3)
        yield f"http://127.0.0.1:{port}/lab/tree/{notebook}?token={token}", home
    finally:
        proc.send_signal(signal.SIGTERM)   # `timeout` passes it on; the server shuts its kernels down
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        _stop_leftovers(home)


def _stop_leftovers(home: str) -> None:
    left = home_processes(home)
    deadline = time.monotonic() + 8
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = home_processes(home)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    shutil.rmtree(home, ignore_errors=True)


def extension_installed() -> bool:
    return (Path(sys.prefix) / "share" / "jupyter" / "labextensions" / "monarch-kernel" / "package.json").exists()


needs_chromium = __import__("pytest").mark.skipif(
    not os.path.exists(CHROMIUM), reason=f"no Chromium at {CHROMIUM} (scripts/setup.sh installs it with apt-get "
                                         "when it can)")


def browser(p, tmp: Path, width: int = 1280, height: int = 1000):
    """Headless system Chromium through Playwright, with a fresh profile under ``tmp``."""
    return p.chromium.launch_persistent_context(
        str(tmp / "chromium"), executable_path=CHROMIUM, headless=True, viewport={"width": width, "height": height},
        args=CHROMIUM_ARGS)


RUN_ALL = "() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }"   # not awaited: it
# resolves only once every cell ran


@contextlib.contextmanager
def notebook_page(tmp: Path, name: str, cells: list[str]):
    """A JupyterLab with one notebook of ``cells`` (``tmp/root/name``) open in headless
    Chromium, its kernel ready: yields the Playwright page, with ``page.notebook`` (the
    file) and ``page.console_errors`` (what the page logged as errors)."""
    import pytest

    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install "
                                                                 "playwright; it uses the system Chromium)")
    (tmp / "root").mkdir()
    notebook = tmp / "root" / name
    write_notebook(notebook, cells)
    with jupyter_lab(tmp, name) as (url, _home), sync_api.sync_playwright() as p:
        ctx = browser(p, tmp)
        try:
            pg = ctx.pages[0] if ctx.pages else ctx.new_page()
            pg.notebook = notebook
            pg.home = _home   # (its MONARCH_KERNEL_HOME: the meshes' connection files)
            pg.console_errors = []
            pg.on("console", lambda m: m.type == "error" and pg.console_errors.append(m.text))
            pg.goto(url)
            pg.wait_for_function(READY, timeout=90_000, polling=250)
            yield pg
        finally:
            ctx.close()
