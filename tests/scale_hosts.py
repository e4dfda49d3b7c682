"""Several hosts on this one machine, each a host agent of its own, for the 256-proc test and
``bench/bench_scale.py`` (issue 11: "network namespaces where root allows, else loopback
ports").

    with AgentHosts(8) as hosts:            # agents n1..n8, started and attached to nothing
        hm = attach_to_workers(hosts.addrs, key=hosts.key)
        hosts.cut("n8")                     # a lost host
        hosts.write_connection_file("scale")   # `%mesh connect scale` in a kernel attaches

Two ways, ``mode()`` says which (``MK_SCALE_HOSTS=netns|loopback`` picks one):
- ``netns`` (root, iproute2, nsenter, unshare): each agent in its own network namespace, with
  its own address and hostname on a bridge; ``cut`` takes its link down.
- ``loopback`` (anyone): each agent on 127.0.0.1 with a port of its own; ``cut`` freezes the
  host (SIGSTOP to its agent, zygote and procs), which the controller cannot tell from a cut
  link: nothing answers.
Either way each agent, its zygote and its procs see ``MK_SCALE_HOST=nK``, the host's name.
The controller must listen on ``hosts.bridge_ip`` (the agents' procs reply there): the
class calls ``runtime().listen_on`` for this process; a kernel gets MONARCH_KERNEL_BIND.
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from netns_hosts import BridgedHosts

ROOT = Path(__file__).resolve().parents[1]


LOOPBACK = "127.0.0.1"


def unavailable() -> str | None:
    """Why network namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "needs root to make network namespaces (one per host)"
    missing = [t for t in ("ip", "nsenter", "unshare") if not shutil.which(t)]
    if missing:
        return f"missing {', '.join(missing)} (iproute2, util-linux)"
    return None


def mode() -> str:
    """``netns`` where this machine allows it, else ``loopback``; ``MK_SCALE_HOSTS`` picks."""
    asked = os.environ.get("MK_SCALE_HOSTS", "")
    if asked not in ("", "netns", "loopback"):
        raise ValueError(f"MK_SCALE_HOSTS={asked!r}: use netns or loopback")
    if asked == "netns" and unavailable():
        raise RuntimeError(f"MK_SCALE_HOSTS=netns, but {unavailable()}")
    return asked or ("loopback" if unavailable() else "netns")


class AgentHosts:
    def __init__(self, n: int, env: dict | None = None, how: str | None = None):
        self.names = [f"n{i + 1}" for i in range(n)]
        self.mode = how or mode()
        self.net = BridgedHosts(self.names) if self.mode == "netns" else None
        self.frozen: set[str] = set()
        self.key = secrets.token_bytes(32)
        self.env = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
        self.agents: dict[str, subprocess.Popen] = {}
        self.addrs: list[str] = []
        self._dir = tempfile.mkdtemp(prefix="mk-scale-hosts-")
        self.key_file = os.path.join(self._dir, "key")
        fd = os.open(self.key_file, os.O_WRONLY | os.O_CREAT, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.key.hex())

    @property
    def bridge_ip(self) -> str:
        return self.net.bridge_ip if self.net else LOOPBACK

    def __enter__(self) -> AgentHosts:
        try:
            self.open()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()

    def open(self) -> None:
        from monarch_kernel.core.runtime import runtime

        if self.net:
            self.net.open()
        for node in self.names:   # all started at once: each zygote imports torch meanwhile
            bind = self.net.ip[node] if self.net else LOOPBACK
            argv = [sys.executable, "-m", "workers.agent", "--bind", bind, "--key-file",
                    self.key_file, "--name", f"scale-{node}", "--lease", "120"]
            with open(os.path.join(self._dir, f"{node}.log"), "w") as log:   # (the agent's own: warnings())
                self.agents[node] = subprocess.Popen(self.net.enter(node, argv) if self.net else argv,
                                                     stdout=subprocess.PIPE, stderr=log,
                                                     env={**self.env, "MK_SCALE_HOST": node,
                                                          # (in a namespace it is that namespace's hostname)
                                                          **({} if self.net else {"MONARCH_KERNEL_HOST_NAME": node})},
                                                     cwd=str(ROOT),
                                                     text=True)
        for node in self.names:
            line = self.agents[node].stdout.readline().strip()
            if not line.startswith("MONARCH_AGENT_READY "):
                raise RuntimeError(f"agent on {node} did not start: {line!r}")
            self.addrs.append(line.split(" ", 1)[1])
        runtime().listen_on(self.bridge_ip)

    def cut(self, node: str, up: bool = False) -> None:
        """Take ``node`` off the network (or bring it back): its link down (netns), or the
        host frozen, agent, zygote and procs (loopback)."""
        if self.net:
            self.net.link(node, up=up)
            return
        if up == (node not in self.frozen):
            return
        if up:
            self.frozen.discard(node)
        else:
            self.frozen.add(node)
        try:
            agent = psutil.Process(self.agents[node].pid)
            tree = [agent, *agent.children(recursive=True)]
        except psutil.Error:
            return
        for p in reversed(tree) if up else tree:   # the agent stops first: it sees nothing stop
            try:
                p.send_signal(signal.SIGCONT if up else signal.SIGSTOP)
            except psutil.Error:
                pass

    def write_connection_file(self, name: str) -> None:
        """A connection file naming every agent, so ``%mesh connect NAME`` attaches to them."""
        from monarch_kernel.core.connection import connection_path, write_connection_file

        write_connection_file(connection_path(name), {
            "name": name, "key": self.key.hex(), "persistent": False, "lease": 120,
            "agents": [{"addr": a, "host": n, "pid": p.pid} for n, a, p in
                       zip(self.names, self.addrs, self.agents.values())]})

    def warnings(self) -> list[str]:
        """What the agents logged as warnings (a controller detached after a silence, a lost
        proc...), ``node: line``: for a failing test's message."""
        out = []
        for node in self.names:
            try:
                with open(os.path.join(self._dir, f"{node}.log"), errors="replace") as f:
                    out += [f"{node}: {line.rstrip()}" for line in f if "WARNING" in line or "ERROR" in line]
            except OSError:
                pass
        return out

    def close(self) -> None:
        for node in self.names:
            self.cut(node, up=True)
        for p in self.agents.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for p in self.agents.values():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            if p.stdout:
                p.stdout.close()
        if self.net:
            self.net.close()
        shutil.rmtree(self._dir, ignore_errors=True)
