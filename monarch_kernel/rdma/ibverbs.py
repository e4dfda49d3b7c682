"""The ibverbs backend: RDMA READ/WRITE through a *verbs layer*.

The layer is pyverbs (Debian's python3-pyverbs) unless MONARCH_KERNEL_VERBS_LAYER names
another as ``module:Class`` (the tests use ``monarch_kernel.rdma.fake_verbs:FakeVerbs``:
this machine has no RDMA device). A layer offers::

    devices() -> list[str]                      # [] or raising: no device
    register(addr, nbytes) -> dict              # memory region: rkey, addr, len, ...
    deregister(info) -> None
    queue_pair() -> (qp, info)                  # a new RC queue pair and what the peer needs
    connect(qp, peer_info) -> None              # move it to ready-to-send against the peer
    post(qp, write, local_addr, nbytes, remote, deadline) -> None   # one-sided, waits for completion

The reader creates a queue pair, trades its info with the owner's (the owner answers on
its data-server thread, the control path of this backend, so no Python of the owner's
main thread runs), then posts the READ or WRITE against the region's rkey.
"""
from __future__ import annotations

import importlib
import json
import os
import threading

from monarch_kernel import config

ENV = config.VERBS_LAYER.env
_layer = None
_layer_pid = 0
_layer_lock = threading.Lock()
_qps: dict = {}   # (owner tcp address) -> connected qp, reused per reader process


def layer():
    global _layer, _layer_pid
    with _layer_lock:
        if _layer_pid != os.getpid():
            spec = config.VERBS_LAYER.get()
            if spec:
                mod, _, cls = spec.partition(":")
                _layer = getattr(importlib.import_module(mod), cls or "Layer")()
            else:
                _layer = PyverbsLayer()
            _layer_pid = os.getpid()
            _qps.clear()
        return _layer


def available() -> tuple[bool, str]:
    try:
        devs = layer().devices()
    except Exception as e:   # Debian's pyverbs raises PyverbsRDMAError without devices
        return False, f"no RDMA device ({type(e).__name__}: {e})"
    if not devs:
        return False, "no RDMA device"
    return True, f"RDMA device {devs[0]} via {getattr(layer(), 'name', 'verbs')}"


def register(addr: int, nbytes: int, device: str) -> dict:
    return layer().register(addr, nbytes)


def deregister(info: dict) -> None:
    layer().deregister(info)


def accept(peer_info: dict) -> dict:
    """Owner side of the queue-pair exchange (called by the data server)."""
    qp, info = layer().queue_pair()
    layer().connect(qp, peer_info)
    return info


def transfer(remote: dict, owner, local_addr: int, nbytes: int, write: bool, deadline) -> None:
    from . import tcp

    lay = layer()
    qp = _qps.get(owner.tcp)
    if qp is None:
        qp, info = lay.queue_pair()
        lay.connect(qp, tcp.exchange_qp(owner, info))
        _qps[owner.tcp] = qp
    lay.post(qp, write, local_addr, nbytes, remote, deadline)


class PyverbsLayer:
    """Real verbs through pyverbs: RC queue pairs, one protection domain per process.
    Not exercised on this project's CI machine (no RDMA device)."""

    name = "pyverbs"

    def __init__(self):
        self._ctx = self._pd = self._cq = None
        self._mrs: dict[int, object] = {}

    def devices(self) -> list[str]:
        import pyverbs.device as d

        return [x.name.decode() if isinstance(x.name, bytes) else x.name for x in d.get_device_list()]

    def _open(self):
        if self._ctx is None:
            from pyverbs.cq import CQ
            from pyverbs.device import Context
            from pyverbs.pd import PD

            self._ctx = Context(name=self.devices()[0])
            self._pd = PD(self._ctx)
            self._cq = CQ(self._ctx, 256)
            self._port = self._ctx.query_port(1)
            self._gid = self._ctx.query_gid(1, 0)

    def register(self, addr: int, nbytes: int) -> dict:
        import pyverbs.enums as e
        from pyverbs.mr import MR

        self._open()
        access = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE
        mr = MR(self._pd, nbytes, access, address=addr)
        self._mrs[mr.rkey] = mr
        return {"rkey": mr.rkey, "lkey": mr.lkey, "addr": addr, "len": nbytes}

    def deregister(self, info: dict) -> None:
        mr = self._mrs.pop(info["rkey"], None)
        if mr is not None:
            mr.close()

    def queue_pair(self):
        import pyverbs.enums as e
        from pyverbs.qp import QP, QPCap, QPInitAttr

        self._open()
        qp = QP(self._pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self._cq, rcq=self._cq,
                                     cap=QPCap(max_send_wr=64, max_recv_wr=1, max_send_sge=1)))
        return qp, {"qpn": qp.qp_num, "lid": self._port.lid, "gid": str(self._gid), "psn": 0}

    def connect(self, qp, peer: dict) -> None:
        import pyverbs.enums as e
        from pyverbs.addr import GID, AHAttr, GlobalRoute
        from pyverbs.qp import QPAttr

        attr = QPAttr(qp_state=e.IBV_QPS_INIT, port_num=1)
        attr.qp_access_flags = e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_LOCAL_WRITE
        qp.to_init(attr)
        attr = QPAttr(qp_state=e.IBV_QPS_RTR, path_mtu=e.IBV_MTU_4096)
        attr.dest_qp_num, attr.rq_psn = peer["qpn"], peer["psn"]
        attr.max_dest_rd_atomic, attr.min_rnr_timer = 16, 12
        gr = GlobalRoute(dgid=GID(peer["gid"]), sgid_index=0)
        attr.ah_attr = AHAttr(gr=gr, is_global=1, dlid=peer["lid"], port_num=1)
        qp.to_rtr(attr)
        attr = QPAttr(qp_state=e.IBV_QPS_RTS, timeout=14, retry_cnt=7, rnr_retry=7, sq_psn=0,
                      max_rd_atomic=16)
        qp.to_rts(attr)

    def post(self, qp, write: bool, local_addr: int, nbytes: int, remote: dict, deadline) -> None:
        import time

        import pyverbs.enums as e
        from pyverbs.mr import MR
        from pyverbs.wr import SGE, SendWR

        access = e.IBV_ACCESS_LOCAL_WRITE
        mr = MR(self._pd, nbytes, access, address=local_addr)
        try:
            wr = SendWR(opcode=e.IBV_WR_RDMA_WRITE if write else e.IBV_WR_RDMA_READ, num_sge=1,
                        sg=[SGE(local_addr, nbytes, mr.lkey)], send_flags=e.IBV_SEND_SIGNALED)
            wr.set_wr_rdma(remote["rkey"], remote["addr"])
            qp.post_send(wr)
            while True:
                n, wcs = self._cq.poll()
                if n:
                    if wcs[0].status != e.IBV_WC_SUCCESS:
                        raise OSError(f"RDMA completion failed with status {wcs[0].status}")
                    return
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError("no RDMA completion before the deadline")
        finally:
            mr.close()


def encode(info: dict) -> bytes:
    return json.dumps(info).encode()
