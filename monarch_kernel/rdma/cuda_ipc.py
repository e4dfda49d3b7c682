"""Same-host transfers of CUDA buffers through CUDA IPC: what shm is for host memory.

The owner exports its allocation once, at registration (``cuIpcGetMemHandle`` on the
allocation's base, plus the tensor's offset in it and the GPU's UUID); a reader on the same
host maps it (``cuIpcOpenMemHandle``, once per buffer and process) and copies on the GPU,
with no Python running in the owner. Without this a CUDA buffer went through the owner's
tcp server, staged through host memory: 0.5-1 GB/s on an H100.

The driver API through ctypes rather than torch's ``reduce_tensor``: torch's CUDA IPC counts
one consumer per share (a second open of one share drives the owner's reference count
negative, and its memory is then never freed after ``drop()``); here the owner's memory is
held by the registry until ``drop()``, and every use checks the buffer's generation under
the owner's slot lock first (backends.slot_locked), so a mapping of a dropped buffer is never
read. Unusable (no driver, another GPU set, memory from expandable segments, a container
without shared IPC): the transfer goes over tcp as before.
"""
from __future__ import annotations

import ctypes
import sys
import threading
import warnings

_LAZY_ENABLE_PEER_ACCESS = 0x1
_lib = None
_lock = threading.Lock()
_mapped: dict = {}      # handle -> [device pointer, keys using it]: one allocation, mapped once
_keys: dict = {}        # (owner pid, slot, gen) -> the handle it maps
_uuid_index: dict = {}  # GPU UUID -> this process's device index
_contexts: dict = {}    # device index -> its primary context (retained once per process)
copies = 0              # transfers done over CUDA IPC in this process (tests read it)


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


class IpcError(OSError):
    """The driver refused an IPC step; the caller falls back to tcp."""


def _driver():
    global _lib
    if _lib is None:
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuMemGetAddressRange_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t),
                                                ctypes.c_uint64]
        lib.cuIpcGetMemHandle.argtypes = [ctypes.POINTER(_Handle), ctypes.c_uint64]
        lib.cuIpcOpenMemHandle_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), _Handle, ctypes.c_uint]
        lib.cuIpcCloseMemHandle.argtypes = [ctypes.c_uint64]
        lib.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
        lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
        lib.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
        _lib = lib
    return _lib


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise IpcError(f"{what} failed (CUDA driver error {rc})")


def export(tensor) -> tuple | None:
    """(uuid, handle bytes, offset in the allocation) for a CUDA tensor, or None where IPC
    cannot export it (the buffer then goes over tcp)."""
    try:
        import torch

        torch.cuda.synchronize(tensor.device)   # its allocation is made, on this thread's context
        lib = _driver()
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        _check(lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), tensor.data_ptr()),
               "cuMemGetAddressRange")
        h = _Handle()
        _check(lib.cuIpcGetMemHandle(ctypes.byref(h), base.value), "cuIpcGetMemHandle")
        uuid = str(torch.cuda.get_device_properties(tensor.device).uuid)
        return uuid, ctypes.string_at(ctypes.addressof(h), 64), tensor.data_ptr() - base.value   # NULs too
    except Exception:
        return None


def local_index(uuid: str) -> int | None:
    """This process's index of the GPU with ``uuid``, or None (no CUDA, or not visible)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return None
    if not _uuid_index:
        for i in range(torch.cuda.device_count()):
            _uuid_index[str(torch.cuda.get_device_properties(i).uuid)] = i
    return _uuid_index.get(uuid)


def available() -> tuple[bool, str]:
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return False, "no CUDA device in this process"
    try:
        _driver()
    except OSError as e:
        return False, f"no CUDA driver library: {e}"
    return True, "same-host CUDA buffers, mapped with cuIpcOpenMemHandle, copied on the GPU"


class _Device:
    """A uint8 view of device memory that torch.as_tensor accepts."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}


def _make_current(index: int) -> None:
    """The driver API needs the device's context current on this thread (a pool thread
    that torch never used has none: cuIpcOpenMemHandle then fails with 201)."""
    lib = _driver()
    with _lock:
        ctx = _contexts.get(index)
        if ctx is None:
            dev, c = ctypes.c_int(), ctypes.c_void_p()
            _check(lib.cuDeviceGet(ctypes.byref(dev), index), "cuDeviceGet")
            _check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(c), dev.value), "cuDevicePrimaryCtxRetain")
            ctx = _contexts[index] = c.value
    _check(lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


def _map(key: tuple, handle: bytes) -> int:
    """The allocation behind ``handle``, mapped once per process: the caching allocator
    puts several tensors in one allocation, and the driver maps a handle once."""
    with _lock:
        m = _mapped.get(handle)
        if m is None:
            p = ctypes.c_uint64()
            _check(_driver().cuIpcOpenMemHandle_v2(ctypes.byref(p), _Handle.from_buffer_copy(handle),
                                                    _LAZY_ENABLE_PEER_ACCESS),
                   "cuIpcOpenMemHandle")
            m = _mapped[handle] = [p.value, set()]
        m[1].add(key)
        _keys[key] = handle
        return m[0]


def forget(key: tuple) -> None:
    """A buffer its owner dropped (found at the generation check), or a tensor pulled once:
    unmap its allocation when no other buffer of this process uses it."""
    with _lock:
        handle = _keys.pop(key, None)
        m = _mapped.get(handle)
        if m is None:
            return
        m[1].discard(key)
        if m[1]:
            return
        del _mapped[handle]
    _driver().cuIpcCloseMemHandle(m[0])


def transfer(ipc: tuple, key: tuple, nbytes: int, local, write: bool) -> None:
    """Copy between the owner's CUDA memory and ``local`` (a tensor on any device, or a
    contiguous host buffer), on the GPU; returns when the copy is done."""
    import torch

    uuid, handle, offset = ipc
    index = local_index(uuid)
    if index is None:
        raise IpcError(f"GPU {uuid} is not visible in this process")
    global copies
    torch.cuda.set_device(index)
    _make_current(index)
    ptr = _map(key, handle)
    remote = torch.as_tensor(_Device(ptr + offset, nbytes), device=f"cuda:{index}")
    if isinstance(local, torch.Tensor):
        mine = local.detach().reshape(-1).view(torch.uint8)
    else:
        with warnings.catch_warnings():   # a read-only source: we only read it
            warnings.simplefilter("ignore", UserWarning)
            mine = torch.frombuffer(local, dtype=torch.uint8)
    if write:
        remote.copy_(mine)
    else:
        mine.copy_(remote)
    torch.cuda.synchronize(index)
    copies += 1
