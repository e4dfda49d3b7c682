"""Drive a real Monarch kernel through jupyter_client, for the kernel and magics tests.

A test module keeps one kernel (and one mesh) for all its tests. The kernel and the
mesh processes it starts carry the module's own MONARCH_KERNEL_HOME, so the session's
per-test orphan check (tests/conftest.py) does not count them as leaked between tests
of the module; ``KernelHarness.close`` makes the same check for the whole module: after
``%mesh stop`` and the kernel's shutdown, no process started under that home may remain.
"""
from __future__ import annotations

import contextlib
import os
import queue
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field

import pytest
from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel
from jupyter_client.manager import KernelManager


def ensure_kernelspec() -> None:
    """scripts/setup.sh installs it; install it here too when a checkout skipped that."""
    try:
        KernelSpecManager().get_kernel_spec("monarch")
    except NoSuchKernel:
        from monarch_kernel.install import install

        install(prefix=sys.prefix)


@dataclass
class Reply:
    status: str
    outputs: list = field(default_factory=list)   # iopub messages of the cell, in order
    reply: dict = field(default_factory=dict)     # the execute_reply message

    @property
    def kernel_seconds(self) -> float:
        """Kernel-side time: from the kernel starting on the request to its reply."""
        from dateutil.parser import isoparse

        started = isoparse(self.reply["metadata"]["started"]) if isinstance(
            self.reply["metadata"]["started"], str) else self.reply["metadata"]["started"]
        return (self.reply["header"]["date"] - started).total_seconds()

    @property
    def stdout(self) -> str:
        return "".join(m["content"]["text"] for m in self.outputs
                       if m["msg_type"] == "stream" and m["content"]["name"] == "stdout")

    @property
    def stderr(self) -> str:
        return "".join(m["content"]["text"] for m in self.outputs
                       if m["msg_type"] == "stream" and m["content"]["name"] == "stderr")

    @property
    def result(self) -> str:
        """text/plain of the execute_result ('' if none)."""
        for m in self.outputs:
            if m["msg_type"] == "execute_result":
                return m["content"]["data"]["text/plain"]
        return ""

    def data(self, kind: str = "execute_result") -> list[dict]:
        return [m["content"] for m in self.outputs if m["msg_type"] == kind]

    @property
    def error(self) -> dict:
        for m in self.outputs:
            if m["msg_type"] == "error":
                return m["content"]
        return {}


def home_processes(home: str) -> set[int]:
    needle = f"MONARCH_KERNEL_HOME={home}".encode()
    out = set()
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{d}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
        except OSError:
            continue
        out.add(int(d))
    return out


class KernelHarness:
    def __init__(self, prewarm: bool = False, env: dict | None = None, kernel_name: str = "monarch"):
        ensure_kernelspec()
        self.home = tempfile.mkdtemp(prefix="mk-kernel-test-")
        self.env = {**os.environ, "MONARCH_KERNEL_HOME": self.home,
                    "MONARCH_KERNEL_PREWARM": "1" if prewarm else "0", **(env or {})}
        self.km = KernelManager(kernel_name=kernel_name)
        self.km.start_kernel(env=self.env)
        self._client()

    def _client(self):
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)

    def run(self, code: str, timeout: float = 60) -> Reply:
        return self.wait(self.submit(code), timeout)

    def submit(self, code: str) -> str:
        return self.kc.execute(code)

    def wait(self, msg_id: str, timeout: float = 60, on_output=None) -> Reply:
        """Collect the cell's iopub messages until it is idle; ``on_output(msg)`` sees
        each as it arrives (to react while the cell still runs)."""
        outs = []
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"cell {msg_id} did not finish within {timeout} s; got {outs}")
            try:
                msg = self.kc.get_iopub_msg(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            t = msg["msg_type"]
            if t == "status" and msg["content"]["execution_state"] == "idle":
                break
            if t in ("stream", "display_data", "update_display_data", "execute_result", "error"):
                outs.append(msg)
                if on_output is not None:
                    on_output(msg)
        reply = self.kc.get_shell_msg(timeout=max(1.0, deadline - time.monotonic()))
        while reply["parent_header"].get("msg_id") != msg_id:
            reply = self.kc.get_shell_msg(timeout=max(1.0, deadline - time.monotonic()))
        return Reply(reply["content"]["status"], outs, reply)

    def ok(self, code: str, timeout: float = 60) -> Reply:
        r = self.run(code, timeout)
        assert r.status == "ok", f"{code!r} failed: {r.error or r.stderr}"
        return r

    def value(self, expr: str):
        """A controller-side Python value, through its repr."""
        import ast

        return ast.literal_eval(self.ok(expr).result)

    def restart(self) -> None:
        self.kc.stop_channels()
        self.km.restart_kernel(now=False, env=self.env)
        self._client()

    def close(self, stop_meshes: tuple[str, ...] = ()) -> None:
        kernel_pid = getattr(self.km.provisioner, "pid", None)
        try:
            for name in stop_meshes:
                self.run(f"%mesh stop {name}", timeout=30)
        except BaseException:
            # A stop that failed (a kernel stuck by the failing test): its processes are still
            # ended and its home removed, then the failure goes on (it left both behind).
            self._end(kernel_pid, check=False)
            raise
        self._end(kernel_pid, check=True)

    def _end(self, kernel_pid, check: bool) -> None:
        """Shut the kernel down, end what it left under its home, remove the home; with
        ``check``, fail the test if anything was left."""
        try:
            self.kc.stop_channels()
            self.km.shutdown_kernel(now=False)
        except Exception:
            with contextlib.suppress(Exception):
                self.km.shutdown_kernel(now=True)
        if kernel_pid:   # ipykernel's own folder of cells dumped for a debugger (JupyterLab's does)
            shutil.rmtree(os.path.join(tempfile.gettempdir(), f"ipykernel_{kernel_pid}"), ignore_errors=True)
        deadline = time.monotonic() + 8
        left = home_processes(self.home)
        while left and time.monotonic() < deadline:
            time.sleep(0.1)
            left = home_processes(self.home)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        shutil.rmtree(self.home, ignore_errors=True)   # its meshes' files and its procs' logs
        if left and check:
            pytest.fail(f"the kernel tests left {len(left)} process(es) behind: {sorted(left)}")


@contextlib.contextmanager
def kernel_with_mesh(mesh: str, connect_args: str = "", timeout: float = 120):
    """A kernel after ``%mesh connect MESH ARGS`` (its reply is ``h.connect_reply``); the
    mesh is stopped and the kernel shut down afterwards, whatever happened."""
    h = KernelHarness()
    try:
        h.connect_reply = h.ok(f"%mesh connect {mesh} {connect_args}".rstrip(), timeout=timeout)
        yield h
    finally:
        h.close(stop_meshes=(mesh,))
