"""A bounded JupyterLab on loopback, and headless Chromium on it, for the browser tests.

``start_lab(root, home, tmp)`` starts ``jupyter lab`` (under ``timeout 600``, token,
fresh config and runtime dirs, MONARCH_KERNEL_HOME=home so its meshes are found and
stopped); ``stop_lab`` stops it with TERM and kills what is left under ``home``.
``browser(p, tmp)`` launches the system Chromium through Playwright.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from kernel_harness import home_processes

CHROMIUM = "/usr/bin/chromium"
READY = """() => {
  const app = window.jupyterapp; const w = app && app.shell.currentWidget;
  const ctx = w && w.sessionContext; const k = ctx && ctx.session && ctx.session.kernel;
  return !!(ctx && ctx.isReady && k && k.connectionStatus === 'connected' && k.status === 'idle');
}"""
needs_chromium = pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"no Chromium at {CHROMIUM} "
                                    "(scripts/setup.sh installs it with apt-get when it can)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Lab:
    def __init__(self, root: Path, home: str, tmp: Path, token: str = "labtest"):
        self.root, self.home, self.tmp, self.token = root, home, tmp, token
        self.port = free_port()
        env = {**os.environ, "MONARCH_KERNEL_HOME": home, "MONARCH_KERNEL_PREWARM": "0",
               "JUPYTER_CONFIG_DIR": str(tmp / "config"), "JUPYTER_RUNTIME_DIR": str(tmp / "runtime")}
        jupyter = str(Path(sys.executable).parent / "jupyter")
        self.log = open(tmp / "lab.log", "w")
        self.proc = subprocess.Popen(
            ["timeout", "600", jupyter, "lab", "--no-browser", f"--port={self.port}", "--ip=127.0.0.1",
             f"--IdentityProvider.token={token}", "--allow-root", f"--ServerApp.root_dir={root}",
             "--LabApp.news_url=None", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
             "--LabApp.expose_app_in_browser=True"], env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/api/status?token={token}", timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    pytest.fail(f"JupyterLab did not start: {(tmp / 'lab.log').read_text()[-2000:]}")
                time.sleep(0.3)

    def url(self, path: str = "") -> str:
        return f"http://127.0.0.1:{self.port}/lab/tree/{path}?token={self.token}"

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)   # `timeout` passes it on; the server shuts its kernels down
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()
        stop_leftovers(self.home)


def stop_leftovers(home: str) -> None:
    """A notebook's last cell stops its mesh; if a test failed before it, stop it here."""
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


def browser(p, tmp: Path):
    return p.chromium.launch_persistent_context(
        str(tmp / "chromium"), executable_path=CHROMIUM, headless=True, viewport={"width": 1280, "height": 1000},
        args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
              "--disable-background-networking", "--disable-component-update", "--disable-sync"])
