"""RDMABuffer: a handle to memory in one process that other processes read and write
one-sided, with the data kept off the control plane.

    buf = RDMABuffer(tensor)              # in the proc that owns the memory
    return buf                            # it pickles into messages and results
    buf.read_into(dst).get()              # elsewhere: copy the owner's bytes into dst
    buf.write_from(src).get()             # or overwrite them with src
    buf.drop()                            # unregister (waits for transfers in flight)

Transfers run on a small thread pool and return a core Future, so they never block the
caller's event loop or I/O thread. The backend is chosen per transfer (see backends.py).
"""
from __future__ import annotations

import html
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

from monarch_kernel.core.errors import MonarchError
from monarch_kernel.core.future import Future

from . import backends, cuda_ipc, shm, tcp
from . import owner as owner_mod

log = logging.getLogger(__name__)


class RDMAError(MonarchError):
    """A transfer failed: the buffer was dropped, its owner died, sizes differ, ..."""


class RDMATimeoutError(RDMAError, TimeoutError):
    """A transfer did not finish within its ``timeout``."""


_pool: ThreadPoolExecutor | None = None
_pool_pid = 0


def _executor() -> ThreadPoolExecutor:
    global _pool, _pool_pid
    if _pool is None or _pool_pid != os.getpid():
        _pool, _pool_pid = ThreadPoolExecutor(8, thread_name_prefix="monarch-rdma"), os.getpid()
    return _pool


def _describe(data, writable: bool, what: str):
    """-> (keep, memoryview of bytes or None, address, nbytes, dtype, device)."""
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and isinstance(data, torch.Tensor):
        if not data.is_contiguous():
            raise ValueError(f"{what}: the tensor is not contiguous (strides {tuple(data.stride())}); "
                             "pass tensor.contiguous() (or register a contiguous buffer and copy into it)")
        if data.layout != torch.strided:
            raise ValueError(f"{what}: only dense (strided) tensors can be registered, not {data.layout}")
        dtype = str(data.dtype).removeprefix("torch.")
        nbytes = data.numel() * data.element_size()
        if data.device.type == "cpu":
            view = memoryview(data.detach().reshape(-1).view(torch.uint8).numpy()) if nbytes else None
            return data, view, data.data_ptr(), nbytes, dtype, "cpu"
        if data.device.type == "cuda":
            return data, None, data.data_ptr(), nbytes, dtype, str(data.device)
        raise ValueError(f"{what}: tensors on {data.device} are not supported; use a CPU or CUDA tensor")
    try:
        mv = memoryview(data)
    except TypeError:
        raise TypeError(f"{what}: expected a torch.Tensor or a buffer (memoryview, bytearray, numpy "
                        f"array), got {type(data).__name__}") from None
    if not mv.c_contiguous:
        raise ValueError(f"{what}: the memoryview is not contiguous; pass a contiguous buffer")
    if writable and mv.readonly:
        raise ValueError(f"{what}: the destination is read-only ({type(data).__name__}); pass a "
                         "bytearray, a writable numpy array or a tensor")
    view = mv.cast("B") if mv.nbytes else mv
    return data, view, _address(view), mv.nbytes, mv.format if mv.format != "B" else "uint8", "cpu"


def _address(mv: memoryview) -> int:
    if mv.nbytes == 0:
        return 0
    import numpy as np

    return int(np.frombuffer(mv, dtype=np.uint8).ctypes.data)


class RDMABuffer:
    """A registered region of memory in the process that created it (its *owner*).

    Accepts a contiguous tensor (CPU, or CUDA where present) or a contiguous buffer
    (memoryview, bytearray, numpy array); the buffer keeps it alive until ``drop()``.
    A read-only memoryview can only be read.
    """

    __slots__ = ("_owner", "_slot", "_gen", "_token", "_nbytes", "_dtype", "_device", "_verbs",
                 "_addr", "_dropped", "_ipc")

    def __init__(self, data):
        keep, view, addr, nbytes, dtype, device = _describe(data, False, "RDMABuffer")
        if nbytes == 0:
            raise ValueError("RDMABuffer: the buffer is empty (0 bytes); register at least one byte")
        readonly = bool(getattr(view, "readonly", False)) if device == "cpu" else False
        reg = owner_mod.registry()
        e = reg.add(keep, view, addr, nbytes, dtype, device, readonly)
        self._owner, self._slot, self._gen, self._token = reg.info, e.slot, e.gen, e.token
        self._nbytes, self._dtype, self._device, self._addr = nbytes, dtype, device, addr
        self._verbs = backends.register_verbs(addr, nbytes, device)
        self._ipc = cuda_ipc.export(keep) if device != "cpu" else None
        self._dropped = False

    # ------------------------------------------------------------------ pickling
    def __reduce__(self):
        return (_rebuild, (self._owner, self._slot, self._gen, self._token, self._nbytes,
                           self._dtype, self._device, self._verbs, self._addr, self._ipc))

    # ------------------------------------------------------------------ facts
    def size(self) -> int:
        """Size in bytes."""
        return self._nbytes

    @property
    def owner(self) -> owner_mod.OwnerInfo:
        """The owning process: ``rank`` (None for a controller), ``host``, ``pid``, ``key``."""
        return self._owner

    @property
    def dtype(self) -> str:
        return self._dtype

    @property
    def device(self) -> str:
        return self._device

    @property
    def backend(self) -> str:
        """The backend a transfer from this process would use now."""
        return backends.choose(self._owner, self._device, self._verbs, self._ipc)

    # ------------------------------------------------------------------ transfers
    def read_into(self, dst, timeout: float | None = 60.0) -> Future[int]:
        """Copy the owner's bytes into ``dst`` (same size in bytes); the Future gives the
        number of bytes copied, or fails with RDMAError."""
        return self._start(dst, False, timeout)

    def write_from(self, src, timeout: float | None = 60.0) -> Future[int]:
        """Overwrite the owner's bytes with ``src`` (same size in bytes)."""
        return self._start(src, True, timeout)

    def _start(self, local, write: bool, timeout: float | None) -> Future[int]:
        op = "write_from" if write else "read_into"
        if self._dropped:
            raise RDMAError(f"{op}: this buffer was dropped; register the memory again with RDMABuffer(...)")
        keep, view, addr, nbytes, _, device = _describe(local, not write, f"{op}")
        if nbytes != self._nbytes:
            raise ValueError(f"{op}: size mismatch: the {'source' if write else 'destination'} has "
                             f"{nbytes} bytes, the buffer {self._nbytes}; pass {self._nbytes} bytes "
                             f"(e.g. torch.empty({self._nbytes}, dtype=torch.uint8))")
        fut: Future[int] = Future(f"RDMA {op} of {nbytes} bytes ({_who(self._owner)})")
        deadline = None if timeout is None else time.monotonic() + timeout

        def run():
            try:
                self._transfer(keep, view, addr, device, write, deadline, timeout)
                fut.set_result(nbytes)
            except BaseException as e:
                fut.set_exception(e)

        _executor().submit(run)
        return fut

    def _transfer(self, keep, view, addr, device, write, deadline, timeout):
        o = self._owner
        dead = _dead_error(o)
        if dead:
            raise dead
        staged = None
        kind = backends.choose(o, self._device, self._verbs, self._ipc)
        if kind == "cuda_ipc":
            try:
                torch = __import__("torch")   # a CUDA owner: torch is loaded (the handle needed it)
                return self._ipc_transfer(keep if isinstance(keep, torch.Tensor) else view, write)
            except cuda_ipc.IpcError as e:
                if backends.forced() == "cuda_ipc":
                    raise RDMAError(f"{backends.ENV}=cuda_ipc but {e}; unset it or use tcp") from None
                log.info("RDMA: CUDA IPC to %s failed (%s); using tcp", _who(o), e)
                kind = "tcp"
        if device != "cpu":   # a CUDA tensor on our side: go through host memory
            staged = keep.detach().reshape(-1).cpu() if write else keep.new_empty(
                keep.numel(), device="cpu")
            view = memoryview(staged.view(-1).view(__import__("torch").uint8).numpy())
            addr = staged.data_ptr()
        try:
            try:
                backends.run(kind, self, view, addr, write, deadline)
            except PermissionError:
                if kind != "shm":
                    raise
                shm.refused()
                backends.run("tcp", self, view, addr, write, deadline)
        except TimeoutError as e:
            raise RDMATimeoutError(f"{'write_from' if write else 'read_into'} did not finish within "
                                   f"{timeout} s ({_who(o)}, {self._nbytes} bytes over {kind}): {e}; "
                                   "pass a larger timeout=") from None
        except backends.Dropped:
            raise RDMAError(f"the buffer was dropped by its owner ({_who(o)}); ask the owner for a "
                            "new one") from None
        except tcp.RemoteError as e:
            if "dropped" in str(e):
                raise RDMAError(f"the buffer was dropped by its owner ({_who(o)}); ask the owner for "
                                "a new one") from None
            raise RDMAError(f"the owner refused the transfer ({_who(o)}): {e}") from None
        except (shm.OwnerGone, ConnectionError, FileNotFoundError, ProcessLookupError, OSError) as e:
            if "deregistered" in str(e):   # ibverbs: the owner deregistered the region
                raise RDMAError(f"the buffer was dropped by its owner ({_who(o)}); ask the owner for "
                                "a new one") from None
            raise _dead_error(o, wait=1.0) or RDMAError(
                f"the transfer failed ({_who(o)}, over {kind}): {e!r}") from None
        if staged is not None and not write:
            keep.copy_(staged.view(keep.shape))

    def _ipc_transfer(self, local, write: bool) -> None:
        o, key = self._owner, (self._owner.pid, self._slot, self._gen)
        try:
            with backends.slot_locked(o, self._slot, self._gen):
                cuda_ipc.transfer(self._ipc, key, self._nbytes, local, write)
        except backends.Dropped:
            cuda_ipc.forget(key)
            raise RDMAError(f"the buffer was dropped by its owner ({_who(o)}); ask the owner for a "
                            "new one") from None
        except (shm.OwnerGone, FileNotFoundError, ProcessLookupError) as e:
            cuda_ipc.forget(key)
            raise _dead_error(o, wait=1.0) or RDMAError(f"the transfer failed ({_who(o)}, over "
                                                        f"cuda_ipc): {e!r}") from None

    def drop(self) -> None:
        """Unregister the memory: later transfers through any copy of this handle fail.
        From the owner it waits for transfers in flight; elsewhere it asks the owner."""
        if self._dropped:
            return
        self._dropped = True
        o = self._owner
        if o.pid == os.getpid() and o.host_id == shm.host_id():
            owner_mod.registry().drop(self._slot, self._gen)
            backends.unregister_verbs(self._verbs)
        elif not _dead_error(o):
            try:
                tcp.drop(o, self._slot, self._gen, self._token, 10.0)
            except OSError as e:
                raise _dead_error(o, wait=1.0) or RDMAError(f"drop: the owner ({_who(o)}) did not "
                                                            f"answer: {e!r}") from None

    # ------------------------------------------------------------------ display
    def _facts(self) -> dict:
        return {"owner": _who(self._owner), "size": _human(self._nbytes), "dtype": self._dtype,
                "device": self._device, "backend": "dropped" if self._dropped else self.backend}

    def __repr__(self) -> str:
        f = self._facts()
        return (f"RDMABuffer({f['size']} {f['dtype']} on {f['device']}, owner {f['owner']}, "
                f"backend {f['backend']})")

    def _repr_html_(self) -> str:
        rows = "".join(f"<tr><th style='text-align:left'>{k}</th><td style='text-align:left'>"
                       f"{html.escape(str(v))}</td></tr>" for k, v in self._facts().items())
        return f"<table><caption style='text-align:left'><b>RDMABuffer</b></caption>{rows}</table>"


def _rebuild(owner, slot, gen, token, nbytes, dtype, device, verbs, addr, ipc=None):
    b = object.__new__(RDMABuffer)
    b._ipc = ipc
    b._addr = addr
    b._owner, b._slot, b._gen, b._token = owner, slot, gen, token
    b._nbytes, b._dtype, b._device, b._verbs = nbytes, dtype, device, verbs
    b._dropped = False
    return b


def _who(o: owner_mod.OwnerInfo) -> str:
    who = f"rank {o.rank}" if o.rank is not None else f"pid {o.pid}"
    return f"{who} on {o.host}"


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _dead_error(o: owner_mod.OwnerInfo, wait: float = 0.0) -> RDMAError | None:
    """The owner's death as the runtime knows it (waiting up to ``wait`` s for the notice)."""
    if not o.key:
        return None
    from monarch_kernel.core.runtime import runtime

    rt = runtime()
    end = time.monotonic() + wait
    while True:
        err = rt.dead.get(o.key)
        if err is not None:
            return RDMAError(f"the owner of this buffer (rank {o.rank} on {o.host}, pid {o.pid}) died: {err}")
        if time.monotonic() >= end:
            return None
        time.sleep(0.02)

