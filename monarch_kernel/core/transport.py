"""Messages out: signing, packing and the per-thread sender sockets; where peers are.

Any thread may send. zmq sockets are not thread-safe, so each thread has its own PUSH
socket per destination (``Transport.sender``), and messages from one sender thread to
one destination arrive in order. Same-host peers are reached over ipc (5-30 us quicker a
round trip than tcp here): socket files in a directory only this user can enter
(``ipc_dir``), so another user of the host cannot connect at all; tcp links use CURVE
(curve.py). Large frames go over tcp in pieces (curve.chunked): tcp endpoints cap a frame
before any authentication (curve.MAX_FRAME).
"""
from __future__ import annotations

import atexit
import errno
import os
import pickle
import socket
import stat
import threading
import uuid
from typing import Callable, NamedTuple

import zmq

from .. import config
from . import curve, wire

_SEND = zmq.backend.Socket.send   # the C send, without pyzmq's Python wrapper (~1 us a message)
_dumps = pickle.dumps
_SNDMORE = int(zmq.SNDMORE)
_DEST_IDS = wire.DEST_IDS

# Same-host peers talk over ipc; 0 forces tcp (to measure the tcp path, e.g. with CURVE, on one host).
SAME_HOST_IPC = config.SAME_HOST_IPC.get()
# A proc copies the frames it sends up to this size (the largest a tcp frame is, curve.py),
# its sockets' ``copy_threshold``. pyzmq sends a frame over its own 64 KB without a copy,
# and the first such send starts its zero-copy garbage collector in that process: a thread
# with a zmq context of its own, 3 threads and 7 descriptors more a proc (768 threads on a
# host of 256 procs that each once sent a big telemetry pull or a 100 KB reply). A copy of at
# most 4 MiB costs well under a millisecond; large tensors go through shared memory anyway.
# The controller keeps zero-copy sends (its arguments can be large, and it is one process).
PROC_COPY_THRESHOLD = curve.MAX_FRAME + 1


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

    def __init__(self, ctx: zmq.Context, keyring: wire.Keyring, host: str, run_in_io: Callable,
                 copy_threshold: int | None = None):
        self.ctx = ctx
        self.keyring = keyring
        self.host_id = host
        self.ipc_alias: dict[str, str] = {}       # tcp address -> ipc address, for same-host peers
        # A same-host runtime inbox by its CURVE key (one per process): reached the same way
        # when it hands out another tcp address later (Runtime.listen_on), so our replies do
        # not depend on the network it listens on then.
        self.local_by_key: dict[str, str] = {}
        self.curve_servers: dict[str, str] = {}   # tcp address -> its CURVE public key (curve.py)
        self._run_in_io = run_in_io
        self._tls = threading.local()
        self._all_senders: list[zmq.Socket] = []
        self._retired: dict[str, int] = {}   # address of a forgotten proc -> generation (forget)
        self._retired_gen = 0
        self.copy_threshold = copy_threshold   # a proc's: PROC_COPY_THRESHOLD (None: pyzmq's)

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
        target = self.ipc_alias.get(addr) or self._same_host(addr)
        s = socks.get(target)
        if s is None:
            s = self.ctx.socket(zmq.PUSH)
            if self.copy_threshold:
                s.copy_threshold = self.copy_threshold
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
            _SEND(self.sender(addr), frames[0])   # small header: a copy beats a zero-copy Frame
        else:
            if (self.ipc_alias.get(addr) or self._same_host(addr))[:4] == "tcp:":
                frames = curve.chunked(frames)
            self.sender(addr).send_multipart(frames, copy=False)

    def send(self, addr: str, key: bytes, msg) -> None:
        self.send_frames(addr, self.pack(key, msg))

    def send_plain(self, addr: str, key: bytes, msg: tuple) -> None:
        """Send a message of plain values only (``wire.plain``: nothing needs our picklers),
        pickled in one C call, signed for ``addr`` and sent in one pass (the hot path of
        call_one and of a proc's reply)."""
        header = _dumps(msg, 5)
        if len(header) < wire.SMALL_COPY:
            dest = _DEST_IDS.get(addr) or wire.dest_id(addr)
            _SEND(self.sender(addr), self.keyring.sign_one(key, header, dest))
        else:
            self.send_frames(addr, self.keyring.seal(key, [header]))

    def send_plain_routed(self, addr: str, route: bytes, key: bytes, msg: tuple) -> bool:
        """``send_plain`` after a routing frame (a fanned reply to its agent's gather
        inbox); False, and nothing sent, when the message is not small."""
        header = _dumps(msg, 5)
        if len(header) >= wire.SMALL_COPY:
            return False
        sock = self.sender(addr)
        _SEND(sock, route, _SNDMORE)
        _SEND(sock, self.keyring.sign_one(key, header, _DEST_IDS.get(addr) or wire.dest_id(addr)))
        return True

    # ----------------------------------------------------------------- the address book
    def _same_host(self, addr: str) -> str:
        """``addr``, or how we reach it on this host when it is another address of a runtime
        inbox we know here (same CURVE key)."""
        key = addr.partition("?curve=")[2]
        local = self.local_by_key.get(key) if key else None
        if local is None or local == addr:
            return addr
        self.ipc_alias[addr] = local
        return local

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
            key = addr.partition("?curve=")[2]
            if key and hid == self.host_id and key not in self.local_by_key:
                # the first address we learn is the one it started with (loopback, or ipc)
                self.local_by_key[key] = ipc if ipc and SAME_HOST_IPC else addr
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


def _boot_and_ns(*nss: str) -> str:
    """This machine (boot id) and the namespaces ``nss`` of this process; "" where unknown."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return ":".join([f.read().strip(), *(str(os.stat(f"/proc/self/ns/{ns}").st_ino) for ns in nss)])
    except OSError:
        return ""


def host_id() -> str:
    """Where our ipc names resolve, and another process may use them: this machine (boot
    id), network and mount namespace, and user (the socket files are in a directory only
    this user may enter). Peers with another host id use tcp."""
    global _HOST_ID
    if _HOST_ID is None:
        b = _boot_and_ns("net", "mnt")
        _HOST_ID = f"{b}:{os.geteuid()}" if b else ""
    return _HOST_ID


def pid_space() -> str:
    """This machine (boot id) and pid namespace: where a pid names the same process."""
    global _PID_SPACE
    if _PID_SPACE is None:
        _PID_SPACE = _boot_and_ns("pid")
    return _PID_SPACE


# --------------------------------------------------------------------- ipc socket files
_IPC_DIR: list = []     # [directory] once made and checked
_BOUND: list = []       # (pid, path) of the socket files this process made (removed at exit)
_SUN_PATH_MAX = 107     # bytes in a unix socket path (Linux)


def ipc_dir() -> str:
    """The directory of this user's same-host sockets, made 0700 on first use:
    MONARCH_KERNEL_IPC_DIR, or /tmp/monarch-kernel-<uid>. One that is not ours, is a link,
    or that other users may enter is refused (another user could connect, or swap files).
    Socket files left by processes that died without closing them are removed here, once a
    process (procs excepted: their agent removes theirs when it reaps them)."""
    if _IPC_DIR:
        return _IPC_DIR[0]
    d = config.IPC_DIR.get() or f"/tmp/monarch-kernel-{os.geteuid()}"
    d = os.path.abspath(os.path.expanduser(str(d)))
    try:
        os.mkdir(d, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise PermissionError(
            f"{d} (for this user's ipc sockets) is not a directory owned by uid {os.geteuid()} with mode "
            f"0700 (it is uid {st.st_uid}, mode {stat.filemode(st.st_mode)}): another user could reach or "
            f"replace the sockets in it. Remove it, or set {config.IPC_DIR.env} to a directory of yours")
    if len(d) > _SUN_PATH_MAX - 40:
        raise ValueError(f"{config.IPC_DIR.env}={d} is too long for unix socket paths ({len(d)} bytes; "
                         f"at most {_SUN_PATH_MAX - 40}): choose a shorter directory")
    _IPC_DIR.append(d)
    if not config.AGENT_PID.get():
        sweep_ipc_dir()
    return d


def ipc_name(what: str) -> str:
    """A new ipc endpoint of this process, ``<pid>-<what>-<random>`` in ``ipc_dir``."""
    path = f"{ipc_dir()}/{os.getpid()}-{what}-{uuid.uuid4().hex[:6]}"
    if not _BOUND:
        atexit.register(_remove_own)
    _BOUND.append((os.getpid(), path))
    return "ipc://" + path


def _remove_own() -> None:
    pid = os.getpid()
    for owner, path in _BOUND:
        if owner == pid:
            _unlink(path)


def remove_ipc_files(pid: int) -> None:
    """The socket files of ``pid`` (a proc its agent reaped: it may have died without closing them)."""
    prefix = f"{pid}-"
    try:
        d = ipc_dir()
        names = [n for n in os.listdir(d) if n.startswith(prefix)]
    except (OSError, ValueError):
        return
    for n in names:
        _unlink(f"{d}/{n}")


def sweep_ipc_dir() -> int:
    """Remove socket files whose process is gone (its pid does not run here, and nothing
    listens on the file: a process of another pid namespace sharing the directory keeps its
    files). Returns how many were removed."""
    d = _IPC_DIR[0]
    removed = 0
    try:
        names = os.listdir(d)
    except OSError:
        return 0
    for n in names:
        pid = n.split("-", 1)[0]
        if not pid.isdigit() or pid_alive(int(pid)):
            continue
        path = f"{d}/{n}"
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            try:
                s.connect(path)
                continue   # someone listens there
            except OSError as e:
                if e.errno not in (errno.ECONNREFUSED, errno.ENOENT):
                    continue
        removed += _unlink(path)
    return removed


def _unlink(path: str) -> int:
    try:
        os.unlink(path)
        return 1
    except OSError:
        return 0


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


def gpu_count() -> int:
    """GPUs on this host, without initialising CUDA (procs call it in a forked child)."""
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0
