"""The owner side: the registry of this process's registered memory.

Every registered region gets a *slot* in a small memfd (the slot file): 8 bytes holding the
registration's generation. Readers and writers of other processes open the slot file
through ``/proc/<owner pid>/fd/<n>``, check the generation and hold an OFD read lock on
the slot during a transfer; ``drop`` takes the write lock, zeroes the generation and only
then lets the memory go. So the data path needs no Python in the owner, a dropped buffer
fails cleanly ("was dropped"), and memory is never freed under a transfer. A memfd
vanishes with its process: nothing to sweep after a crash.
"""
from __future__ import annotations

import fcntl
import itertools
import os
import secrets
import struct
import threading
import time
from typing import Any, NamedTuple

MAX_SLOTS = 1 << 16
_FLOCK = "hhqqi4x"


class Entry:
    """One registered region. ``keep`` holds the object that owns the memory."""

    __slots__ = ("slot", "gen", "keep", "view", "addr", "nbytes", "dtype", "device", "token",
                 "readonly", "releases", "expires", "dropped")

    def __init__(self, slot, gen, keep, view, addr, nbytes, dtype, device, readonly):
        self.slot, self.gen, self.keep, self.view, self.addr = slot, gen, keep, view, addr
        self.nbytes, self.dtype, self.device, self.readonly = nbytes, dtype, device, readonly
        self.token = secrets.token_bytes(16)
        self.releases: int | None = None   # wire pins: remote releases still expected
        self.expires: float | None = None  # wire pins: dropped after this (monotonic)
        self.dropped = False


class OwnerInfo(NamedTuple):
    """Who owns a buffer and how to reach its memory; travels inside every handle."""

    key: str          # proc key ('' for a controller or script)
    rank: int | None
    host: str
    host_id: str      # shm.host_id(): same value = process_vm_* works between the two
    pid: int
    slot_fd: int      # the slot file's fd number in the owner
    slot_ino: int     # its inode: proves /proc/<pid>/fd/<n> is still that file
    tcp: str          # "host:port" of the owner's data server


def lock(fd: int, slot: int, kind: int, wait: bool = True) -> None:
    """OFD byte-range lock on one slot (kind: fcntl.F_RDLCK / F_WRLCK / F_UNLCK)."""
    cmd = fcntl.F_OFD_SETLKW if wait else fcntl.F_OFD_SETLK
    fcntl.fcntl(fd, cmd, struct.pack(_FLOCK, kind, os.SEEK_SET, slot * 8, 8, 0))


def read_gen(fd: int, slot: int) -> int:
    return int.from_bytes(os.pread(fd, 8, slot * 8), "little")


class Registry:
    """This process's registered memory (one per process, made on first registration)."""

    def __init__(self):
        from . import shm

        self.lock = threading.Lock()
        self.entries: dict[int, Entry] = {}
        self.free = list(range(MAX_SLOTS - 1, 0, -1))
        self.gens = itertools.count(1)
        self.fd = os.memfd_create("monarch-rdma-slots", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, MAX_SLOTS * 8)
        self.ino = os.fstat(self.fd).st_ino
        self.pid = os.getpid()
        shm.allow_readers()
        from . import tcp

        self.server = tcp.DataServer(self)
        self.info = self._owner_info()
        self._reaper: threading.Thread | None = None

    def _owner_info(self) -> OwnerInfo:
        import socket

        from . import shm

        key, rank, host = "", None, socket.gethostname()
        try:
            import monarch_kernel.node.proc as proc_mod

            w = proc_mod.WORKER
            if w is not None:
                key, rank, host = w.proc_key, w.rank, w.host
        except ImportError:
            pass
        return OwnerInfo(key, rank, host, shm.host_id(), self.pid, self.fd, self.ino, self.server.address)

    def add(self, keep, view, addr: int, nbytes: int, dtype: str, device: str, readonly: bool) -> Entry:
        with self.lock:
            if not self.free:
                raise RuntimeError(f"too many registered buffers in this process ({MAX_SLOTS - 1}); "
                                   "drop() the ones you no longer need")
            slot = self.free.pop()
            e = Entry(slot, next(self.gens), keep, view, addr, nbytes, dtype, device, readonly)
            os.pwrite(self.fd, e.gen.to_bytes(8, "little"), slot * 8)
            self.entries[slot] = e
        return e

    def drop(self, slot: int, gen: int) -> bool:
        """Unregister; waits for transfers in flight on this slot. False if already gone."""
        with self.lock:
            e = self.entries.get(slot)
            if e is None or e.gen != gen or e.dropped:
                return False
            e.dropped = True
        lock(self.fd, slot, fcntl.F_WRLCK)   # waits for readers/writers of this slot
        try:
            os.pwrite(self.fd, b"\0" * 8, slot * 8)
        finally:
            lock(self.fd, slot, fcntl.F_UNLCK)
        with self.lock:
            self.entries.pop(slot, None)
            self.free.append(slot)
        e.keep = e.view = None
        return True

    def get(self, slot: int, gen: int) -> Entry | None:
        e = self.entries.get(slot)
        return e if e is not None and e.gen == gen and not e.dropped else None

    # ------------------------------------------------------------- wire pins
    def pin(self, e: Entry, releases: int, ttl: float) -> None:
        e.releases, e.expires = releases, time.monotonic() + ttl
        if self._reaper is None:
            self._reaper = threading.Thread(target=self._reap, name="monarch-rdma-pins", daemon=True)
            self._reaper.start()

    def release(self, slot: int, gen: int) -> None:
        e = self.get(slot, gen)
        if e is None or e.releases is None:
            return
        with self.lock:
            e.releases -= 1
            last = e.releases <= 0
        if last:
            self.drop(slot, gen)

    def _reap(self):
        """Pins whose receivers never released them (message lost, receiver died)."""
        while True:
            time.sleep(5.0)
            now = time.monotonic()
            for e in [e for e in list(self.entries.values()) if e.expires is not None and e.expires < now]:
                self.drop(e.slot, e.gen)

    def listing(self) -> list[dict[str, Any]]:
        """What ``%mesh status`` shows: user buffers (not wire pins) of this process."""
        from .backends import get_rdma_backend

        default = get_rdma_backend().default
        return [{"size": e.nbytes, "dtype": e.dtype, "device": e.device,
                 "backend": "tcp" if e.device != "cpu" else default}
                for e in list(self.entries.values()) if e.releases is None and not e.dropped]


_registry: Registry | None = None
_registry_lock = threading.Lock()


def registry() -> Registry:
    global _registry
    r = _registry
    if r is not None and r.pid == os.getpid():
        return r
    with _registry_lock:
        if _registry is None or _registry.pid != os.getpid():
            _registry = Registry()
        return _registry


def existing_registry() -> Registry | None:
    r = _registry
    return r if r is not None and r.pid == os.getpid() else None


def query_extra(worker) -> dict:
    """monarch_kernel.node.proc.QUERY_EXTRAS hook: the buffers this proc has registered."""
    r = existing_registry()
    return {"buffers": r.listing() if r is not None else []}


def _install_query_hook() -> None:
    try:
        import monarch_kernel.node.proc as proc_mod
    except ImportError:
        return
    if query_extra not in proc_mod.QUERY_EXTRAS:
        proc_mod.QUERY_EXTRAS.append(query_extra)


_install_query_hook()
