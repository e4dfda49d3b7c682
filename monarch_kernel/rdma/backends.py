"""Which backend moves the bytes of one transfer, and the same-host/local data paths.

Chosen per transfer, in this order, unless MONARCH_KERNEL_RDMA_BACKEND names one
(``ibverbs``, ``shm`` or ``tcp``; ``auto`` is the default):
  * ``local``   the owner is this process: a memmove;
  * ``ibverbs`` an RDMA device is usable here and the owner registered the memory with one;
  * ``shm``     same kernel and pid namespace, a CPU buffer, process_vm_* permitted;
  * ``cuda_ipc`` same host, a CUDA buffer whose GPU this process sees: mapped with CUDA IPC
                and copied on the GPU (cuda_ipc.py);
  * ``tcp``     anything else (and CUDA owners IPC cannot reach: their server stages through
                host memory).
"""
from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
from typing import NamedTuple

from monarch_kernel import config

from . import cuda_ipc, ibverbs, shm, tcp
from . import owner as owner_mod

ENV = config.RDMA_BACKEND.env
NAMES = ("ibverbs", "shm", "tcp", "cuda_ipc")


class Dropped(Exception):
    """The buffer's generation no longer matches: its owner dropped it."""


def forced() -> str:
    """The backend MONARCH_KERNEL_RDMA_BACKEND names ("auto" when none)."""
    return config.RDMA_BACKEND.get().lower()


def _ipc_reaches(o: owner_mod.OwnerInfo, same_host: bool, ipc) -> bool:
    return same_host and ipc is not None and o.pid != os.getpid() and cuda_ipc.local_index(ipc[0]) is not None


def choose(o: owner_mod.OwnerInfo, device: str, verbs, ipc=None) -> str:
    want = forced()
    same_host = o.host_id == shm.host_id()
    cpu = device == "cpu"
    if want not in ("auto", *NAMES):
        from .buffer import RDMAError

        raise RDMAError(f"{ENV}={want!r} is not a backend; use one of auto, {', '.join(NAMES)}")
    if want == "auto":
        if same_host and o.pid == os.getpid() and cpu:
            return "local"
        if verbs is not None and ibverbs.available()[0]:
            return "ibverbs"
        if same_host and cpu and shm.permitted()[0]:
            return "shm"
        if not cpu and _ipc_reaches(o, same_host, ipc):
            return "cuda_ipc"
        return "tcp"
    if want == "cuda_ipc" and (cpu or not _ipc_reaches(o, same_host, ipc)):
        from .buffer import RDMAError

        why = ("the buffer is in host memory (use shm)" if cpu else "the owner is on another host"
               if not same_host else "this process cannot map the owner's GPU memory "
               f"({cuda_ipc.available()[1]})")
        raise RDMAError(f"{ENV}=cuda_ipc but {why}; unset {ENV} or use tcp")
    if want == "shm" and not (same_host and cpu and shm.permitted()[0]):
        from .buffer import RDMAError

        why = ("the owner is on another host" if not same_host else
               "the buffer is on a GPU" if not cpu else shm.permitted()[1])
        raise RDMAError(f"{ENV}=shm but shm cannot reach this buffer: {why}; unset {ENV} or use tcp")
    if want == "ibverbs" and (verbs is None or not ibverbs.available()[0]):
        from .buffer import RDMAError

        why = ibverbs.available()[1] if verbs is not None else "the owner has no RDMA device"
        raise RDMAError(f"{ENV}=ibverbs but {why}; unset {ENV} or use tcp")
    return want


@contextlib.contextmanager
def slot_locked(o: owner_mod.OwnerInfo, slot: int, gen: int):
    """Hold the owner's slot read lock (so it cannot drop the memory under us) and check
    the buffer is still the one the handle names."""
    fd = os.open(f"/proc/{o.pid}/fd/{o.slot_fd}", os.O_RDONLY)
    try:
        if os.fstat(fd).st_ino != o.slot_ino:
            raise shm.OwnerGone(f"process {o.pid} is no longer the buffer's owner")
        owner_mod.lock(fd, slot, fcntl.F_RDLCK)
        if owner_mod.read_gen(fd, slot) != gen:
            raise Dropped()
        yield
    finally:
        os.close(fd)   # closing the description releases its OFD lock


def run(kind: str, buf, view: memoryview, addr: int, write: bool, deadline: float | None) -> None:
    o, n = buf._owner, buf._nbytes
    if kind == "tcp":
        tcp.transfer(o, buf._slot, buf._gen, buf._token, view, write, deadline)
    elif kind == "ibverbs":
        ibverbs.transfer(buf._verbs, o, addr, n, write, deadline)
    else:
        with slot_locked(o, buf._slot, buf._gen):
            if kind == "local":
                src, dst = (addr, buf._addr) if write else (buf._addr, addr)
                ctypes.memmove(dst, src, n)
            else:
                shm.copy(o.pid, addr, buf._addr, n, write, deadline)


def register_verbs(addr: int, nbytes: int, device: str):
    """Register with the RDMA device when one is usable; the info travels in the handle."""
    if not ibverbs.available()[0]:
        return None
    return ibverbs.register(addr, nbytes, device)


def unregister_verbs(info) -> None:
    if info is not None:
        ibverbs.deregister(info)


class BackendReport(NamedTuple):
    """What ``get_rdma_backend()`` returns: the default for a same-host transfer, and for
    each backend whether it is usable here and why."""

    default: str
    usable: dict

    def __repr__(self) -> str:
        lines = [f"RDMA backends (default for same-host transfers: {self.default}; "
                 f"override with {ENV}):"]
        lines += [f"  {name:8} {'yes' if ok else 'no '}  {why}" for name, (ok, why) in self.usable.items()]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        import html

        rows = "".join(f"<tr><td>{n}</td><td>{'yes' if ok else 'no'}</td><td style='text-align:left'>"
                       f"{html.escape(why)}</td></tr>" for n, (ok, why) in self.usable.items())
        return (f"<table><caption style='text-align:left'>RDMA backends (default: <b>{self.default}</b>)"
                f"</caption><tr><th>backend</th><th>usable</th><th>why</th></tr>{rows}</table>")


def get_rdma_backend() -> BackendReport:
    """Which data paths work in this process (ibverbs needs an RDMA device)."""
    usable = {"ibverbs": ibverbs.available(), "shm": shm.permitted(),
              "tcp": (True, "a data socket per owner process, chunked"), "cuda_ipc": cuda_ipc.available()}
    want = forced()
    if want in NAMES:
        default = want
    else:
        default = next(n for n in NAMES[:3] if usable[n][0])
    return BackendReport(default, usable)
