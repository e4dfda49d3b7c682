"""Shared fixtures: an isolated MONARCH_KERNEL_HOME per session, and the orphan check.

Every process this suite starts carries the session's MONARCH_KERNEL_HOME in its
environment, so the check finds them even after they are re-parented (persistent agents,
agents started by a second controller process). A test fails if, a few seconds after it
ends, a process it started is still alive and not owned by a mesh this test process
still holds on purpose (the session's private ``this_host()`` agent).
"""
from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import time

import pytest

_HOME = tempfile.mkdtemp(prefix="mk-test-home-")
os.environ["MONARCH_KERNEL_HOME"] = _HOME
os.environ.setdefault("MONARCH_KERNEL_HOST_TIMEOUT_S", "3.0")
# Persistent meshes made by tests (and by the kernels they start) expire quickly if a run is
# killed before its teardown; normal teardown stops them at once.
os.environ.setdefault("MONARCH_KERNEL_LEASE_S", "120")
# The interrupt tests press Ctrl-C (a SIGINT to this process or to the tools it starts). A run
# started in the background by a shell without job control (`bash .ci/run &` in a script)
# inherits SIGINT ignored, and Python then keeps it ignored: they would fail, or hang on a
# salloc that ignores it too. Give the suite, and what it starts, the interrupt back.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def marked_processes() -> set[int]:
    """PIDs of live (non-zombie) processes started under this session's home."""
    from kernel_harness import home_processes

    return home_processes(_HOME)


def _descendants(pid: int) -> set[int]:
    import psutil

    try:
        return {pid} | {c.pid for c in psutil.Process(pid).children(recursive=True)}
    except psutil.Error:
        return set()


def held_processes() -> set[int]:
    """Agents (and their zygotes and procs) of meshes this process still holds."""
    from monarch_kernel.core import hosts

    held = set()
    for hm in list(hosts._named.values()):
        if hm._detached:
            continue
        for a in hm._agents:
            if a.get("pid"):
                held |= _descendants(a["pid"])
    return held


@pytest.fixture(autouse=True)
def no_orphans(request):
    """Fail a test that leaves behind a process it started."""
    before = marked_processes()
    yield
    deadline = time.monotonic() + 5.0
    while True:
        left = marked_processes() - before - held_processes()
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    if left:
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        pytest.fail(f"test left {len(left)} process(es) behind: {sorted(left)}")


def pytest_sessionfinish(session, exitstatus):
    """Stop what the session still holds, then remove its home (its meshes' files and the
    procs' logs: a flood test writes ~180 MB of them), so runs do not fill /tmp."""
    from monarch_kernel.core import hosts

    for hm in list(hosts._named.values()):
        try:
            hm.shutdown()
        except Exception:
            pass
    deadline = time.monotonic() + 5.0
    while marked_processes() and time.monotonic() < deadline:   # (they write their logs there)
        time.sleep(0.1)
    shutil.rmtree(_HOME, ignore_errors=True)
    shots = _screenshots_tmp()
    if shots is not None and exitstatus == 0:   # (kept when a test failed: pytest_terminal_summary names it)
        shutil.rmtree(shots, ignore_errors=True)


def pytest_terminal_summary(terminalreporter, exitstatus):
    shots = _screenshots_tmp()
    if shots is not None and exitstatus != 0:
        terminalreporter.write_line(f"browser tests' screenshots: {shots}")


def _screenshots_tmp():
    """The run's own screenshot folder, if a browser test made one (lab_harness.screenshots_dir)."""
    return getattr(sys.modules.get("lab_harness"), "SCREENSHOTS_TMP", None)
