"""Two hosts on one machine: two host agents in two network namespaces joined by a veth
pair, and a controller in the first. Real sockets across real (virtual) links.

Needs root and iproute2 (CI has both); skipped with the reason otherwise.
"""
from __future__ import annotations

import json
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
A_IP, B_IP = "10.200.0.1", "10.200.0.2"


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


@pytest.fixture(scope="module")
def two_hosts():
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("needs root and iproute2 to make network namespaces")
    tag = secrets.token_hex(3)
    a, b = f"mkA{tag}", f"mkB{tag}"
    va, vb = f"va{tag}", f"vb{tag}"
    try:
        _ip("netns", "add", a)
        _ip("netns", "add", b)
    except subprocess.CalledProcessError as e:
        pytest.skip(f"cannot create network namespaces here: {e.stderr.strip()}")
    try:
        _ip("link", "add", va, "type", "veth", "peer", "name", vb)
        _ip("link", "set", va, "netns", a)
        _ip("link", "set", vb, "netns", b)
        for ns, dev, addr in ((a, va, A_IP), (b, vb, B_IP)):
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", dev, "up")
        yield {"a": a, "b": b, "va": va, "vb": vb}
    finally:
        _ip("netns", "del", a, check=False)
        _ip("netns", "del", b, check=False)


def _start_agent(ns: str, bind: str, key_file: str) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", "workers.agent", "--bind", bind,
                          "--key-file", key_file, "--name", f"agent-{ns}"],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, cwd=str(ROOT), text=True)
    line = p.stdout.readline().strip()
    assert line.startswith("MONARCH_AGENT_READY "), line
    return p, line.split(" ", 1)[1]


_pending: dict[int, bytes] = {}


def _read_json(p: subprocess.Popen, timeout: float = 60.0) -> dict:
    """The controller's next JSON line. Reads raw chunks and splits lines itself: select()
    on a buffered reader misses a second line that arrived in the same chunk."""
    fd = p.stdout.fileno()
    buf = _pending.get(fd, b"")
    deadline = time.monotonic() + timeout
    while True:
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            line = line.strip()
            if line.startswith(b"{"):
                _pending[fd] = buf
                return json.loads(line)
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise AssertionError("controller did not answer in time")
        chunk = os.read(fd, 65536)
        if not chunk:
            raise AssertionError(f"controller exited early (code {p.poll()})")
        buf += chunk


def test_mesh_across_two_hosts_calls_slices_crosses_and_loses_a_host(two_hosts, tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text(secrets.token_hex(32))
    key_file.chmod(0o600)
    agents = []
    ctl = None
    try:
        agents.append(_start_agent(two_hosts["a"], A_IP, str(key_file)))
        agents.append(_start_agent(two_hosts["b"], B_IP, str(key_file)))
        addrs = ",".join(addr for _, addr in agents)
        env = dict(os.environ, PYTHONPATH=str(ROOT), MONARCH_KERNEL_BIND=A_IP,
                   MONARCH_KERNEL_HOST_TIMEOUT_S="3.0")
        ctl = subprocess.Popen(["ip", "netns", "exec", two_hosts["a"], sys.executable,
                                str(ROOT / "tests/scripts/multihost_controller.py"), addrs, key_file.read_text()],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=str(ROOT))
        assert _read_json(ctl)["sizes"] == {"hosts": 2, "gpus": 2}
        assert _read_json(ctl)["all"] == [A_IP, A_IP, B_IP, B_IP]
        assert _read_json(ctl)["host1"] == [B_IP, B_IP]
        # An actor on host 0 called the actors on host 1 itself: proc to proc across the link.
        assert _read_json(ctl)["cross"] == [B_IP, B_IP]
        assert _read_json(ctl)["ready_for_cut"]
        ctl.stdin.write("go\n")
        ctl.stdin.flush()
        time.sleep(0.5)
        _ip("-n", two_hosts["b"], "link", "set", two_hosts["vb"], "down")
        lost = _read_json(ctl)
        assert lost["lost_after"] is not None and lost["lost_after"] < 5.0, lost
        assert "host lost" in lost["error"] and B_IP in lost["error"], lost
        # The other host keeps working.
        assert _read_json(ctl)["host0_after"] == [A_IP, A_IP]
        assert ctl.wait(10) == 0
    finally:
        if ctl is not None and ctl.poll() is None:
            ctl.kill()
            ctl.wait()
        for p, _ in agents:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)   # its zygote and procs die with it
            p.wait()
        time.sleep(0.3)
