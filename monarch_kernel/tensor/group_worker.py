"""Proc side of a mesh's process group: the network details and the abort on a peer's
death (runs in a proc; the actor that drives it is worker.TensorWorker)."""
from __future__ import annotations

import os
import socket
import sys

GROUP: dict = {"generation": 0, "device_mesh": None, "backend": None}


def _bind_address() -> str:
    import monarch_kernel.node.proc as proc_mod

    bind = proc_mod.WORKER.work_addr.split("//", 1)[1].rsplit(":", 1)[0]
    return "127.0.0.1" if bind in ("0.0.0.0", "*") else bind


def _gloo_ifname(address: str) -> str | None:
    """The network interface that holds ``address`` (this proc's bind address), so gloo
    talks on the network the mesh uses rather than whatever the hostname resolves to."""
    try:
        import psutil
    except ImportError:
        return None
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == address for a in addrs):
            return name
    return None


def _tcp_fds(skip_port: int = -1) -> set[int]:
    """This process's established TCP sockets, but those to or from ``skip_port``."""
    import psutil

    return {c.fd for c in psutil.Process().net_connections(kind="tcp")
            if c.fd >= 0 and c.status == psutil.CONN_ESTABLISHED and c.raddr
            and skip_port not in (c.laddr.port, c.raddr.port)}


def abort_group(msg=None) -> None:
    """(I/O thread) A peer of the group died: shut down the group's TCP sockets, so a
    collective blocked in C++ on this rank's main thread fails at once ("Connection closed")
    instead of waiting out the timeout for a peer that will never send. gloo's own
    ``abort()`` does not wake a waiting collective (tried: torch 2.13)."""
    if msg is not None and msg[1] != GROUP["generation"]:
        return
    if GROUP.get("backend") == "nccl":   # NOT RUN: no GPU was lent while this was written
        import torch.distributed as dist

        try:
            dist.distributed_c10d._abort_process_group()   # NCCL's abort does wake a blocked collective
        except Exception as e:
            print(f"torch.distributed: aborting the NCCL group failed: {e!r}", file=sys.stderr)
        return
    for fd in GROUP.get("fds", ()):
        try:
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        finally:
            s.close()
    GROUP["fds"] = set()
