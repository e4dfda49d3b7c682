"""The test networks themselves: a set of network namespaces left by a test run killed
before its teardown (SIGKILL, a machine cut off) is deleted by the next set made here."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import scale_hosts  # noqa: E402
from netns_hosts import BridgedHosts, ip_cmd  # noqa: E402

pytestmark = pytest.mark.skipif(bool(scale_hosts.unavailable()), reason=scale_hosts.unavailable() or "")


def _netns() -> set[str]:
    return {line.split()[0] for line in ip_cmd("netns", "list").stdout.splitlines() if line.strip()}


def test_the_namespaces_of_a_killed_run_are_deleted_by_the_next_set_made():
    # A set made by a process that is then killed with SIGKILL: its teardown never runs.
    code = ("import os, sys; sys.path.insert(0, sys.argv[1]); from netns_hosts import BridgedHosts\n"
            "net = BridgedHosts(['a', 'b']); net.open(); print(' '.join(net.netns.values()), net.bridge, flush=True)\n"
            "os.kill(os.getpid(), 9)")
    out = subprocess.run([sys.executable, "-c", code, os.path.dirname(__file__)], capture_output=True, text=True,
                         timeout=60).stdout.split()
    *left, bridge = out
    assert left and set(left) <= _netns(), (out, _netns())
    with BridgedHosts(["c"]) as net:   # the next set, in a later run
        assert not set(left) & _netns() and net.netns["c"] in _netns()
        assert bridge not in ip_cmd("link", "show").stdout
    assert net.netns["c"] not in _netns()
