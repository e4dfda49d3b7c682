"""A fake verbs layer, for tests only: this machine has no RDMA device.

It behaves like a NIC seen from Python: memory regions with rkeys that a peer must name,
queue pairs that must be connected (through the real exchange) before posting, bounds
and access checks, and a remote-access error for a deregistered region. The "DMA" is a
process_vm_readv/writev on the owner, so no owner Python runs during a transfer. Regions
are published in MONARCH_KERNEL_FAKE_VERBS_DIR (the fake fabric), one file per rkey.
"""
from __future__ import annotations

import json
import os
import secrets
import tempfile

from monarch_kernel import config

from . import shm


class FakeVerbs:
    name = "fake-verbs"

    def __init__(self):
        self.dir = config.FAKE_VERBS_DIR.get() or tempfile.gettempdir()
        self.qps: dict[int, dict] = {}

    def devices(self) -> list[str]:
        return ["fake_mlx5_0"]

    def register(self, addr: int, nbytes: int) -> dict:
        rkey = secrets.randbits(32)
        info = {"rkey": rkey, "addr": addr, "len": nbytes, "pid": os.getpid()}
        with open(os.path.join(self.dir, f"mr-{rkey}.json"), "w") as f:
            json.dump(info, f)
        return info

    def deregister(self, info: dict) -> None:
        try:
            os.unlink(os.path.join(self.dir, f"mr-{info['rkey']}.json"))
        except FileNotFoundError:
            pass

    def queue_pair(self):
        qpn = secrets.randbits(24)
        qp = {"qpn": qpn, "state": "reset", "peer": None}
        self.qps[qpn] = qp
        return qp, {"qpn": qpn, "pid": os.getpid()}

    def connect(self, qp, peer: dict) -> None:
        qp["peer"], qp["state"] = peer, "rts"

    def post(self, qp, write: bool, local_addr: int, nbytes: int, remote: dict, deadline) -> None:
        if qp["state"] != "rts":
            raise OSError("post_send on a queue pair that is not connected (IBV_QPS_RTS)")
        try:
            with open(os.path.join(self.dir, f"mr-{remote['rkey']}.json")) as f:
                mr = json.load(f)
        except FileNotFoundError:
            raise OSError("RDMA completion failed: IBV_WC_REM_ACCESS_ERR (the region was "
                          "deregistered)") from None
        if mr["pid"] != qp["peer"]["pid"] or remote["addr"] + nbytes > mr["addr"] + mr["len"]:
            raise OSError("RDMA completion failed: IBV_WC_REM_ACCESS_ERR (out of the region)")
        shm.copy(mr["pid"], local_addr, remote["addr"], nbytes, write, deadline)
