"""RDMA buffers: one-sided reads and writes of another process's memory.

    from monarch_kernel.rdma import RDMABuffer, get_rdma_backend

    buf = RDMABuffer(tensor)           # in the proc that owns the memory; return it, send it
    buf.read_into(dst).get()           # anywhere: owner's bytes -> dst (a Future)
    buf.write_from(src).get()          # anywhere: src -> owner's bytes
    get_rdma_backend()                 # which data paths (ibverbs, shm, tcp) work here
"""
from .backends import BackendReport, get_rdma_backend
from .buffer import RDMABuffer, RDMAError, RDMATimeoutError
from .owner import OwnerInfo

__all__ = ["BackendReport", "OwnerInfo", "RDMABuffer", "RDMAError", "RDMATimeoutError", "get_rdma_backend"]
