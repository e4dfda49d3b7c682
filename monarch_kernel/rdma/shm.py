"""The same-host backend: one-sided copies between address spaces with process_vm_readv /
process_vm_writev.

Why this and not a shared-memory segment: an RDMABuffer registers memory the user already
has (a tensor's storage), so the bytes must land in *that* memory, not in a copy of it.
``process_vm_readv`` lets the reader's kernel copy straight from the owner's pages to the
reader's, once, with no Python running in the owner — the same-host analogue of an RDMA
READ. It needs ptrace-read permission over the owner (same uid without Yama's
ptrace_scope >= 2, or CAP_SYS_PTRACE); owners call ``prctl(PR_SET_PTRACER_ANY)`` so
Yama's scope 1 allows it too. Where it is refused, transfers fall back to tcp.

Safety against a concurrent ``drop()`` comes from the owner's *slot file* (see owner.py):
a reader holds an OFD read lock on the buffer's slot for the whole copy, and ``drop``
takes the write lock, so memory is never released under a transfer.
"""
from __future__ import annotations

import ctypes
import errno
import os
import threading
import time

CHUNK = 64 << 20   # bytes per system call: bounds the time between deadline checks

_libc = ctypes.CDLL(None, use_errno=True)


class _IOVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


for _name in ("process_vm_readv", "process_vm_writev"):
    _f = getattr(_libc, _name)
    _f.restype = ctypes.c_ssize_t
    _f.argtypes = [ctypes.c_int, ctypes.POINTER(_IOVec), ctypes.c_ulong, ctypes.POINTER(_IOVec),
                   ctypes.c_ulong, ctypes.c_ulong]


class OwnerGone(Exception):
    """The owner process no longer exists (ESRCH)."""


PARALLEL_MIN = 32 << 20   # from this size, two threads copy a half each


def copy(pid: int, local_addr: int, remote_addr: int, nbytes: int, write: bool,
         deadline: float | None) -> None:
    """Copy ``nbytes`` between our ``local_addr`` and ``remote_addr`` in process ``pid``.

    ``write`` False reads remote -> local. Chunked so a deadline is checked every CHUNK
    bytes; raises TimeoutError, OwnerGone, or PermissionError/OSError. Large copies use two
    threads (the kernel walks and pins pages per call; one thread tops out near 4 GB/s)."""
    if nbytes >= PARALLEL_MIN and (os.cpu_count() or 1) > 1:
        half = (nbytes // 2) & ~4095
        errors: list[BaseException] = []

        def second():
            try:
                _copy(pid, local_addr + half, remote_addr + half, nbytes - half, write, deadline)
            except BaseException as e:
                errors.append(e)

        th = threading.Thread(target=second, name="monarch-shm-copy")
        th.start()
        try:
            _copy(pid, local_addr, remote_addr, half, write, deadline)
        finally:
            th.join()
        if errors:
            raise errors[0]
        return
    _copy(pid, local_addr, remote_addr, nbytes, write, deadline)


def _copy(pid: int, local_addr: int, remote_addr: int, nbytes: int, write: bool,
          deadline: float | None) -> None:
    fn = _libc.process_vm_writev if write else _libc.process_vm_readv
    local, remote = _IOVec(), _IOVec()
    done = 0
    while done < nbytes:
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"copied {done} of {nbytes} bytes before the timeout")
        n = min(CHUNK, nbytes - done)
        local.base, local.len = local_addr + done, n
        remote.base, remote.len = remote_addr + done, n
        got = fn(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if got < 0:
            err = ctypes.get_errno()
            if err == errno.ESRCH:
                raise OwnerGone(f"process {pid} is gone")
            if err == errno.EINTR:
                continue
            raise OSError(err, f"{'process_vm_writev' if write else 'process_vm_readv'}: {os.strerror(err)}")
        if got == 0:
            raise OSError(errno.EFAULT, "process_vm copy made no progress (memory unmapped?)")
        done += got


def allow_readers() -> None:
    """Let same-uid processes read our memory even under Yama ptrace_scope 1."""
    try:
        PR_SET_PTRACER, PR_SET_PTRACER_ANY = 0x59616D61, ctypes.c_ulong(-1).value
        _libc.prctl(PR_SET_PTRACER, ctypes.c_ulong(PR_SET_PTRACER_ANY), 0, 0, 0)
    except Exception:
        pass


_HOST_ID: str | None = None


def host_id() -> str:
    """Identifies a kernel *and* pid namespace: two processes with the same id can use
    process_vm_* on each other's pids (hostnames alone repeat across containers)."""
    global _HOST_ID
    if _HOST_ID is None:
        try:
            with open("/proc/sys/kernel/random/boot_id") as f:
                boot = f.read().strip()
        except OSError:
            boot = os.uname().nodename
        try:
            ns = os.stat("/proc/self/ns/pid").st_ino
        except OSError:
            ns = 0
        _HOST_ID = f"{boot}/{ns}"
    return _HOST_ID


def permitted() -> tuple[bool, str]:
    """Whether process_vm_* to a same-uid process should work here (from Yama's setting;
    a transfer that is refused anyway falls back to tcp and remembers it)."""
    if _REFUSED:
        return False, "process_vm_readv was refused here (ptrace permission); using tcp"
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            scope = int(f.read().strip() or 0)
    except (OSError, ValueError):
        scope = 0
    if scope >= 2 and os.geteuid() != 0:
        return False, f"kernel.yama.ptrace_scope is {scope}: set it to 1 or less to enable shm"
    if scope >= 3:
        return False, "kernel.yama.ptrace_scope is 3: process_vm_readv is disabled"
    return True, "process_vm_readv/process_vm_writev between processes of one host"


_REFUSED: list = []


def refused() -> None:
    """A transfer got EPERM: stop choosing shm in this process."""
    _REFUSED.append(True)
