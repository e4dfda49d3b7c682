"""Hosts on one machine that are really different hosts: one network namespace each, with
its own address on a bridge whose address is this machine's side (the controller's).

    with BridgedHosts(["n1", "n2"]) as net:
        net.ip["n1"], net.bridge_ip, net.netns["n1"]
        net.link("n2", up=False)        # cut n2 off
        net.enter("n1", ["cmd", ...])   # argv that runs cmd inside n1 (own hostname too)

Names carry a random suffix (under 15 characters); ``close()`` deletes them all. A run
killed before its teardown (SIGKILL, a machine cut off) cannot: each set is registered with
its creator's pid under ``REGISTRY``, and the next set made on the machine deletes those of
creators that are gone (``sweep_stale``).
"""
from __future__ import annotations

import os
import random
import secrets
import subprocess

REGISTRY = "/run/mk-test-netns"   # tag -> the pid of the test process that made that set


def ip_cmd(*args, check=True):
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def sweep_stale() -> None:
    """Delete the namespaces and bridge of every set whose creator no longer runs."""
    from monarch_kernel.core.transport import pid_alive

    try:
        tags = os.listdir(REGISTRY)
    except FileNotFoundError:
        return
    for tag in tags:
        try:
            with open(os.path.join(REGISTRY, tag)) as f:
                pid = int(f.read())
        except (OSError, ValueError):
            pid = 0
        if pid and pid_alive(pid):
            continue
        for ns in os.listdir("/run/netns") if os.path.isdir("/run/netns") else ():
            if ns.startswith(f"mkn{tag}"):
                ip_cmd("netns", "del", ns, check=False)   # (its veth pair goes with it)
        ip_cmd("link", "del", f"mkb{tag}", check=False)
        os.remove(os.path.join(REGISTRY, tag))


class BridgedHosts:
    def __init__(self, names: list[str]):
        self.tag = secrets.token_hex(3)
        self.net = random.randint(1, 250)
        self.bridge_ip = f"10.213.{self.net}.1"
        self.bridge = f"mkb{self.tag}"
        self.names = list(names)
        self.ip: dict[str, str] = {}
        self.netns: dict[str, str] = {}
        self.veth: dict[str, str] = {}
        self._next = 1
        for n in names:
            self._plan(n)

    def _plan(self, node: str) -> None:
        i = self._next
        self._next += 1
        self.ip[node] = f"10.213.{self.net}.{10 + i}"
        self.netns[node] = f"mkn{self.tag}{i}"
        self.veth[node] = f"mkv{self.tag}{i}"

    def __enter__(self) -> BridgedHosts:
        try:
            self.open()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()

    def open(self) -> None:
        sweep_stale()
        os.makedirs(REGISTRY, exist_ok=True)
        with open(os.path.join(REGISTRY, self.tag), "w") as f:
            f.write(str(os.getpid()))
        ip_cmd("link", "add", self.bridge, "type", "bridge")
        ip_cmd("addr", "add", f"{self.bridge_ip}/24", "dev", self.bridge)
        ip_cmd("link", "set", self.bridge, "up")
        for node in self.names:
            self._make(node)

    def add(self, node: str) -> str:
        """A new host on the running bridge (a pod, say); its address."""
        self._plan(node)
        self._make(node)
        return self.ip[node]

    def remove(self, node: str) -> None:
        ns = self.netns.pop(node, None)
        if ns:
            ip_cmd("netns", "del", ns, check=False)
            ip_cmd("link", "del", self.veth.pop(node), check=False)
            self.ip.pop(node, None)

    def _make(self, node: str) -> None:
        ns, peer = self.netns[node], self.veth[node].replace("mkv", "mkp", 1)
        ip_cmd("netns", "add", ns)
        ip_cmd("link", "add", self.veth[node], "type", "veth", "peer", "name", peer)
        ip_cmd("link", "set", peer, "netns", ns)
        ip_cmd("link", "set", self.veth[node], "master", self.bridge)
        ip_cmd("link", "set", self.veth[node], "up")
        ip_cmd("-n", ns, "addr", "add", f"{self.ip[node]}/24", "dev", peer)
        ip_cmd("-n", ns, "link", "set", "lo", "up")
        ip_cmd("-n", ns, "link", "set", peer, "up")

    def enter(self, node: str, argv: list[str]) -> list[str]:
        """argv run inside ``node``'s namespace with its own hostname (``nsenter``, not
        ``ip netns exec``, which remounts /sys and kills slurmd)."""
        import shlex

        return ["nsenter", f"--net=/run/netns/{self.netns[node]}", "unshare", "-u", "sh", "-c",
                f"hostname {node} && exec {shlex.join(argv)}"]

    def link(self, node: str, up: bool) -> None:
        """Cut a host off the network (its bridge-side veth down), or bring it back."""
        ip_cmd("link", "set", self.veth[node], "up" if up else "down", check=False)

    def close(self) -> None:
        for ns in self.netns.values():
            ip_cmd("netns", "del", ns, check=False)
        ip_cmd("link", "del", self.bridge, check=False)
        try:
            os.remove(os.path.join(REGISTRY, self.tag))
        except FileNotFoundError:
            pass
