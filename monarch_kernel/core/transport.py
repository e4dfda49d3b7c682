"""Messages out: signing, packing and the per-thread sender sockets; where peers are.

Any thread may send. zmq sockets are not thread-safe, so each thread has its own PUSH
socket per destination (``Transport.sender``), and messages from one sender thread to
one destination arrive in order. Same-host peers are reached over ipc (an abstract
socket: no file to leak, 5-30 us quicker a round trip than tcp here); tcp links that
leave the host use CURVE when the peer published a key (curve.py).
"""
from __future__ import annotations

import os
import threading
import uuid
from typing import Callable, NamedTuple

import zmq

from .. import config
from . import curve, wire

# Same-host peers talk over ipc; 0 forces tcp (to measure the tcp path, e.g. with CURVE, on one host).
SAME_HOST_IPC = config.SAME_HOST_IPC.get()


class ProcRef(NamedTuple):
    """Where one proc lives. ``key`` is unique across meshes and respawns."""

    key: str
    rank: int
    host: str
    pid: int
    work: str   # the proc's work inbox (its main thread: calls, spawns, cells)
    ctrl: str   # the proc's runtime inbox (its I/O thread: replies, interrupts, notices)
    agent: str  # address of the host agent that owns it
    work_ipc: str = ""   # the same inboxes over ipc, for senders on the same host
    ctrl_ipc: str = ""
    host_id: str = ""    # which host (machine and network namespace) these ipc names live on
    curve: str = ""      # the proc's CURVE public key when its tcp inboxes leave the host (curve.py)


class Transport:
    """Sender sockets, per thread and destination, and the address book behind them:
    ipc aliases of same-host peers and CURVE keys of remote ones."""

    def __init__(self, ctx: zmq.Context, keyring: wire.Keyring, host: str, run_in_io: Callable):
        self.ctx = ctx
        self.keyring = keyring
        self.host_id = host
        self.ipc_alias: dict[str, str] = {}       # tcp address -> ipc address, for same-host peers
        self.curve_servers: dict[str, str] = {}   # tcp address -> its CURVE public key (curve.py)
        self._run_in_io = run_in_io
        self._tls = threading.local()
        self._all_senders: list[zmq.Socket] = []
        self._retired: dict[str, int] = {}   # address of a forgotten proc -> generation (forget)
        self._retired_gen = 0

    # ----------------------------------------------------------------- sending (any thread)
    def sender(self, addr: str) -> zmq.Socket:
        tls = self._tls
        socks = getattr(tls, "socks", None)
        if socks is None:
            socks = tls.socks = {}
            tls.retired_seen = self._retired_gen
        elif tls.retired_seen != self._retired_gen:
            self._close_retired(tls)
        # Keyed by where we really connect: a tcp port can be reused by a new proc on this
        # host with a new ipc name, and a socket cached by the tcp address would still send
        # to the old one.
        target = self.ipc_alias.get(addr, addr)
        s = socks.get(target)
        if s is None:
            s = self.ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.SNDHWM, 0)
            s.setsockopt(zmq.LINGER, 2000)
            curve.connect(s, target, self.curve_servers.get(target))   # CURVE only on tcp that leaves the host
            socks[target] = s
            self._all_senders.append(s)
        return s

    def pack(self, key: bytes, msg, dests=()) -> wire.Sealed:
        """Pickle ``msg`` and MAC its body; ``send_frames`` stamps it for each destination.
        ``dests``: the addresses it will be sent to; when all are on this host, large tensors
        may travel as same-host handles (wire.LARGE_TENSOR_HOOK)."""
        local = len(dests) if dests and wire.LARGE_TENSOR_HOOK is not None and all(map(is_local, dests)) else 0
        return self.keyring.seal(key, wire.dumps(msg, local))

    def pack_to(self, addr: str, key: bytes, msg) -> list:
        """The frames of ``msg`` for the one socket at ``addr`` (an agent link's requests)."""
        return self.keyring.sign(key, wire.dumps(msg), wire.dest_id(addr))

    def send_frames(self, addr: str, frames: list) -> None:
        if type(frames) is wire.Sealed:   # bound to this destination (no replay to another socket)
            frames = self.keyring.stamp(frames, wire.dest_id(addr))
        if len(frames) == 1:
            self.sender(addr).send(frames[0])   # small header: a copy beats a zero-copy Frame
        else:
            self.sender(addr).send_multipart(frames, copy=False)

    def send(self, addr: str, key: bytes, msg) -> None:
        self.send_frames(addr, self.pack(key, msg))

    # ----------------------------------------------------------------- the address book
    def learn_proc(self, r: ProcRef) -> None:
        """A proc we may send to: its ipc names (same host) and CURVE key (remote)."""
        for a in (r.work, r.ctrl, r.work_ipc, r.ctrl_ipc):   # a reused port is live again
            self._retired.pop(a, None)
        if r.host_id and r.host_id == self.host_id and r.work_ipc and SAME_HOST_IPC:
            self.ipc_alias[r.work] = r.work_ipc
            self.ipc_alias[r.ctrl] = r.ctrl_ipc
        if getattr(r, "curve", ""):
            self.curve_servers[r.work] = self.curve_servers[r.ctrl] = r.curve

    def learn_contact(self, contact):
        """A peer's ``contact`` ([tcp, ipc, host id, curve key], or a bare address) -> its tcp
        address, remembering the ipc alias when the peer shares our host."""
        if isinstance(contact, (list, tuple)):
            addr, ipc, hid = contact[:3]
            if ipc and hid == self.host_id and SAME_HOST_IPC:
                self.ipc_alias[addr] = ipc
            if len(contact) > 3 and contact[3]:
                self.curve_servers[addr] = contact[3]
            return addr
        return contact

    def forget(self, refs) -> None:
        """Procs that were stopped or replaced: every thread closes its sockets to them (on
        its next send; sockets are not thread-safe), so a spawn/stop cycle leaks no fd."""
        retired = self._retired
        self._retired_gen += 1
        gen = self._retired_gen
        for r in refs:
            for a in (r.work, r.ctrl, r.work_ipc, r.ctrl_ipc):
                if a:
                    retired[a] = gen
            self.ipc_alias.pop(r.work, None)
            self.ipc_alias.pop(r.ctrl, None)
        while len(retired) > 4096:   # oldest first: every thread has long seen them
            del retired[next(iter(retired))]
        self._run_in_io(lambda: self._close_retired(self._tls) if hasattr(self._tls, "socks") else None)

    def _close_retired(self, tls) -> None:
        seen, retired, socks = tls.retired_seen, self._retired, tls.socks
        tls.retired_seen = self._retired_gen
        for target in [t for t in socks if retired.get(t, 0) > seen]:
            s = socks.pop(target)
            try:
                self._all_senders.remove(s)
            except ValueError:
                pass
            s.close(0)


# --------------------------------------------------------------------- where things are
_HOST_ID: str | None = None
_PID_SPACE: str | None = None


def _boot_and_ns(ns: str) -> str:
    """This machine (boot id) and its namespace ``ns`` of this process; "" where unknown."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f"{f.read().strip()}:{os.stat(f'/proc/self/ns/{ns}').st_ino}"
    except OSError:
        return ""


def host_id() -> str:
    """This machine (boot id) and network namespace: where an abstract ipc name resolves."""
    global _HOST_ID
    if _HOST_ID is None:
        _HOST_ID = _boot_and_ns("net")
    return _HOST_ID


def pid_space() -> str:
    """This machine (boot id) and pid namespace: where a pid names the same process."""
    global _PID_SPACE
    if _PID_SPACE is None:
        _PID_SPACE = _boot_and_ns("pid")
    return _PID_SPACE


def ipc_name(what: str) -> str:
    return f"ipc://@monarch-kernel-{os.getpid()}-{what}-{uuid.uuid4().hex[:8]}"


_LOCAL_ADDRS: dict[str, bool] = {}


def is_local(addr: str) -> bool:
    """Is a zmq address on this host (loopback, ipc, or one of this host's own addresses)?"""
    r = _LOCAL_ADDRS.get(addr)
    if r is None:
        host = addr.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
        if addr.startswith(("ipc://", "inproc://")) or host.startswith("127.") or host in ("localhost", "::1"):
            r = True
        else:
            try:
                import psutil

                r = any(a.address == host for addrs in psutil.net_if_addrs().values() for a in addrs)
            except Exception:
                r = False
        _LOCAL_ADDRS[addr] = r
    return r


def pid_alive(pid: int) -> bool:
    """Does ``pid`` (of this pid namespace) run, and is it not a zombie?"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
