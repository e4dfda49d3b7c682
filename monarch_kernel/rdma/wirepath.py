"""Large tensors in ordinary messages, between processes of one host: the receiver pulls
the bytes straight from the sender's memory (process_vm_readv) instead of both sides
pushing them through a socket.

wire.py calls ``reduce_local`` for a CPU tensor of at least ``wire.LARGE_TENSOR_BYTES``
when every receiver of the message is on this host. The sender registers the tensor as
a transient buffer (a *pin*) expecting one release per receiver; each receiver copies
the bytes once into a fresh tensor and releases the pin over the sender's data socket.
A pin whose release never comes (message dropped, receiver died) is dropped after
MONARCH_KERNEL_PIN_TTL_S; pins are memory of the sender, so nothing outlives the sender process.
As with the zero-copy socket path, a tensor must not be changed in place while a call
that carries it is in flight.
"""
from __future__ import annotations

import ctypes
import functools
import mmap
import threading
import weakref

from monarch_kernel import config

from . import backends, cuda_ipc, shm, tcp
from . import owner as owner_mod

_HUGE = 2 << 20


def reduce_local(tensor, receivers: int):
    """The pickle reduction for a large same-host tensor (None: use the socket path)."""
    if tensor.device.type == "cuda":
        return _reduce_local_cuda(tensor, receivers)
    if not shm.permitted()[0] or not tensor.is_contiguous():
        return None
    import torch

    nbytes = tensor.numel() * tensor.element_size()
    reg = owner_mod.registry()
    flat = tensor.detach().reshape(-1).view(torch.uint8)
    e = reg.add(tensor, None, tensor.data_ptr(), nbytes, "uint8", "cpu", True)
    reg.pin(e, receivers, config.PIN_TTL_S.get())
    dtype = str(tensor.dtype).removeprefix("torch.")
    del flat
    return _pull, (reg.info, e.slot, e.gen, e.token, e.addr, nbytes, dtype, tuple(tensor.shape),
                   bool(tensor.requires_grad))


def _pull(o, slot, gen, token, addr, nbytes, dtype, shape, requires_grad):
    import torch

    out = _empty(nbytes)
    dst = torch.frombuffer(out, dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
    try:
        with backends.slot_locked(o, slot, gen):
            shm.copy(o.pid, dst.data_ptr(), addr, nbytes, False, None)
    finally:
        try:
            tcp.release(o, slot, gen, token)
        except OSError:
            pass   # the sender is gone; its pins went with it
    t = dst.view(getattr(torch, dtype)).reshape(shape)
    if requires_grad:
        t.requires_grad_(True)
    return t


def _reduce_local_cuda(tensor, receivers: int):
    """A large CUDA tensor for receivers on this host: pinned like a CPU one, exported with
    CUDA IPC; a receiver that sees the GPU copies it on the GPU, any other pulls it over
    the sender's data socket (which stages it through host memory)."""
    ipc = cuda_ipc.export(tensor) if tensor.is_contiguous() else None
    if ipc is None:
        return None
    nbytes = tensor.numel() * tensor.element_size()
    reg = owner_mod.registry()
    e = reg.add(tensor, None, tensor.data_ptr(), nbytes, "uint8", str(tensor.device), True)
    reg.pin(e, receivers, config.PIN_TTL_S.get())
    dtype = str(tensor.dtype).removeprefix("torch.")
    return _pull_cuda, (reg.info, e.slot, e.gen, e.token, ipc, tensor.device.index or 0, nbytes, dtype,
                        tuple(tensor.shape), bool(tensor.requires_grad))


def _pull_cuda(o, slot, gen, token, ipc, index, nbytes, dtype, shape, requires_grad):
    """Lands on ``cuda:index`` as torch's own unpickling would (the CPU where this process
    has no such device)."""
    import torch

    dt = getattr(torch, dtype)
    cuda = torch.cuda.is_available() and index < torch.cuda.device_count()
    try:
        if cuda and cuda_ipc.local_index(ipc[0]) is not None:
            out = torch.empty(shape, dtype=dt, device=f"cuda:{index}")
            try:
                with backends.slot_locked(o, slot, gen):
                    cuda_ipc.transfer(ipc, (o.pid, slot, gen), nbytes, out, False)
                return out.requires_grad_(True) if requires_grad else out
            except cuda_ipc.IpcError:
                pass   # below, over the socket
            finally:
                cuda_ipc.forget((o.pid, slot, gen))   # a pin is read once: do not keep it mapped
        host = torch.empty(shape, dtype=dt)
        view = memoryview(host.reshape(-1).view(torch.uint8).numpy()) if nbytes else memoryview(b"")
        tcp.transfer(o, slot, gen, token, view, False, None)
        out = host.to(f"cuda:{index}") if cuda else host
        return out.requires_grad_(True) if requires_grad else out
    finally:
        try:
            tcp.release(o, slot, gen, token)
        except OSError:
            pass   # the sender is gone; its pins went with it


def _empty(nbytes: int):
    """Memory for a received tensor: a mapping recycled from a freed tensor of the same size
    when there is one (its pages are already faulted in, which is most of the cost of a
    fresh 64 MiB copy), else a fresh one backed by huge pages where the kernel allows.
    The memory returns to the pool when the last tensor viewing it is freed."""
    m = None
    with _pool_lock:
        free = _pool.get(nbytes)
        if free:
            m = free.pop()
            global _pool_bytes
            _pool_bytes -= nbytes
    if m is None:
        m = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if nbytes >= _HUGE and hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                m.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                pass
    buf = _buffer_type(max(nbytes, 1)).from_buffer(m)
    weakref.finalize(buf, _recycle, m, nbytes)
    return buf


def _recycle(m: mmap.mmap, nbytes: int) -> None:
    global _pool_bytes
    with _pool_lock:
        if _pool_bytes + nbytes <= config.RECV_POOL_BYTES.get():
            _pool.setdefault(nbytes, []).append(m)
            _pool_bytes += nbytes
    # else: dropped; the mapping is unmapped once nothing exports it


@functools.lru_cache(maxsize=64)
def _buffer_type(nbytes: int):
    """A ctypes array type of this size that can carry a finalizer (plain ones cannot)."""
    return type(f"_Received{nbytes}", (ctypes.c_ubyte * nbytes,), {})


_pool: dict[int, list[mmap.mmap]] = {}
_pool_bytes = 0
_pool_lock = threading.Lock()
