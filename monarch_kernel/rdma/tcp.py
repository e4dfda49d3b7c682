"""The tcp backend: a data socket per owner process, apart from the control plane.

The owner runs a small server (an accept thread, then one thread per connection) that
streams registered memory straight from and into the buffer with ``sendall`` and
``recv_into``: no staging copy, and it works while the owner's main thread runs user
code (socket calls release the GIL). Transfers are chunked (CHUNK bytes per call) so a
timeout is honoured and a dead peer is noticed mid-transfer. Clients keep idle
connections per owner for reuse.

Frames: request ``!4sBIQQQ16s`` = magic, op (1 read, 2 write), slot, generation, offset,
length, token (the buffer's capability, only ever sent inside authenticated control
messages); answer one status byte (0 ok, else a u32 length and a UTF-8 message), then
the data; a write ends with one more status byte once the owner has all of it.
"""
from __future__ import annotations

import fcntl
import hmac
import json
import logging
import os
import socket
import struct
import threading
import time

from . import owner as owner_mod

log = logging.getLogger(__name__)

CHUNK = 8 << 20
_REQ = struct.Struct("!4sBIQQQ16s")
_MAGIC = b"MKRD"
READ, WRITE, DROP, QP, RELEASE = 1, 2, 3, 4, 5
_SOCKBUF = 4 << 20


def _tune(s: socket.socket) -> None:
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            s.setsockopt(socket.SOL_SOCKET, opt, _SOCKBUF)
        except OSError:
            pass


class RemoteError(Exception):
    """The owner refused the transfer (dropped buffer, bad range); its message says why."""


class DataServer:
    """Serves this process's registered memory over tcp (started with the registry)."""

    def __init__(self, registry):
        self.registry = registry
        bind = "127.0.0.1"
        try:
            from monarch_kernel.core.runtime import runtime

            bind = runtime().bind_host
        except Exception:
            pass
        try:
            self.sock = self._listen(bind)
        except OSError as e:
            # The runtime's address can vanish under it (a job's interface torn down after
            # kill()); loopback still serves this host's peers.
            log.warning("rdma: cannot serve on %s (%s); serving on 127.0.0.1", bind, e)
            self.sock = self._listen("127.0.0.1")
        self.sock.listen(64)
        host, port = self.sock.getsockname()[:2]
        self.address = f"{host}:{port}"
        threading.Thread(target=self._accept, name="monarch-rdma-tcp", daemon=True).start()

    @staticmethod
    def _listen(bind: str) -> socket.socket:
        sock = socket.socket(socket.AF_INET6 if ":" in bind else socket.AF_INET)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((bind, 0))
        except OSError:
            sock.close()
            raise
        return sock

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            _tune(conn)
            threading.Thread(target=self._serve, args=(conn,), name="monarch-rdma-conn", daemon=True).start()

    def _serve(self, conn: socket.socket):
        reg = self.registry
        fd = os.open(f"/proc/self/fd/{reg.fd}", os.O_RDONLY)   # our own lock owner (OFD)
        try:
            while True:
                head = _recv_exact(conn, _REQ.size)
                if head is None:
                    return
                magic, op, slot, gen, off, n, token = _REQ.unpack(head)
                if magic != _MAGIC:
                    return
                if op == QP:     # ibverbs: trade queue-pair info (n bytes of JSON follow)
                    from . import ibverbs

                    mine = json.dumps(ibverbs.accept(json.loads(_recv_exact(conn, n) or b"{}"))).encode()
                    conn.sendall(b"\0" + len(mine).to_bytes(4, "big") + mine)
                    continue
                if op in (DROP, RELEASE):   # no lock held here: drop() takes its own
                    e = reg.get(slot, gen)
                    if e is not None and hmac.compare_digest(token, e.token):
                        (reg.drop if op == DROP else reg.release)(slot, gen)
                    conn.sendall(b"\0")
                    continue
                owner_mod.lock(fd, slot, fcntl.F_RDLCK)
                try:
                    e = reg.get(slot, gen)
                    why = _check(e, token, op, off, n)
                    if why:
                        msg = why.encode()
                        conn.sendall(b"\1" + len(msg).to_bytes(4, "big") + msg)
                        continue
                    mv = _host_view(e)
                    conn.sendall(b"\0")
                    if op == READ:
                        for i in range(off, off + n, CHUNK):
                            conn.sendall(mv[i:min(i + CHUNK, off + n)])
                    else:
                        if not _recv_into(conn, mv[off:off + n]):
                            return
                        _commit(e, mv)
                        conn.sendall(b"\0")
                finally:
                    owner_mod.lock(fd, slot, fcntl.F_UNLCK)
        except OSError:
            return
        finally:
            os.close(fd)
            conn.close()


def _check(e, token, op, off, n) -> str:
    if e is None:
        return "the buffer was dropped by its owner"
    if not hmac.compare_digest(token, e.token):
        return "bad buffer token"
    if off + n > e.nbytes:
        return f"range {off}+{n} is outside the buffer's {e.nbytes} bytes"
    if op == WRITE and e.readonly:
        return "the buffer is read-only (registered from a read-only memoryview)"
    return ""


def _host_view(e) -> memoryview:
    """Bytes of the registered memory; a CUDA buffer is staged through host memory."""
    if e.device.startswith("cuda"):
        import torch

        return memoryview(e.keep.detach().reshape(-1).cpu().view(torch.uint8).numpy())
    return e.view


def _commit(e, mv) -> None:
    if e.device.startswith("cuda"):
        import torch

        e.keep.view(-1).view(torch.uint8).copy_(torch.frombuffer(mv, dtype=torch.uint8))


def _recv_exact(conn, n: int) -> bytes | None:
    buf = bytearray(n)
    return bytes(buf) if _recv_into(conn, memoryview(buf)) else None


def _recv_into(conn, mv: memoryview) -> bool:
    done, n = 0, mv.nbytes
    while done < n:
        got = conn.recv_into(mv[done:done + CHUNK])
        if got == 0:
            return False
        done += got
    return True


# ------------------------------------------------------------------------- client side
_pool: dict[str, list[socket.socket]] = {}
_pool_lock = threading.Lock()


def _connect(address: str, timeout: float | None) -> socket.socket:
    with _pool_lock:
        idle = _pool.get(address)
        if idle:
            return idle.pop()
    host, port = address.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=timeout)
    _tune(s)
    return s


def _give_back(address: str, s: socket.socket) -> None:
    with _pool_lock:
        _pool.setdefault(address, []).append(s)


def drop(info: owner_mod.OwnerInfo, slot: int, gen: int, token: bytes, timeout: float,
         op: int = DROP) -> None:
    s = _connect(info.tcp, timeout)
    ok = False
    try:
        s.settimeout(timeout)
        s.sendall(_REQ.pack(_MAGIC, op, slot, gen, 0, 0, token))
        _status(s)
        ok = True
    finally:
        if ok:
            s.settimeout(None)
            _give_back(info.tcp, s)
        else:
            s.close()


def release(info: owner_mod.OwnerInfo, slot: int, gen: int, token: bytes) -> None:
    """A receiver of a same-host tensor is done with the sender's pin."""
    drop(info, slot, gen, token, 10.0, RELEASE)


def exchange_qp(info: owner_mod.OwnerInfo, mine: dict) -> dict:
    """Reader side of the ibverbs queue-pair exchange, on the owner's data socket."""
    payload = json.dumps(mine).encode()
    s = _connect(info.tcp, 10.0)
    try:
        s.settimeout(10.0)
        s.sendall(_REQ.pack(_MAGIC, QP, 0, 0, 0, len(payload), b"\0" * 16) + payload)
        _status(s)
        n = int.from_bytes(_recv_exact(s, 4) or b"\0\0\0\0", "big")
        return json.loads(_recv_exact(s, n) or b"{}")
    finally:
        s.close()


def transfer(info: owner_mod.OwnerInfo, slot: int, gen: int, token: bytes, local: memoryview,
             write: bool, deadline: float | None) -> None:
    """Read the whole buffer into ``local`` (or write ``local`` into it). Raises
    RemoteError, TimeoutError, or ConnectionError when the owner goes away."""
    n = local.nbytes
    s = _connect(info.tcp, _left(deadline))
    ok = False
    try:
        s.sendall(_REQ.pack(_MAGIC, WRITE if write else READ, slot, gen, 0, n, token))
        s.settimeout(_left(deadline))
        _status(s)
        if write:
            for i in range(0, n, CHUNK):
                s.settimeout(_left(deadline))
                s.sendall(local[i:i + CHUNK])
            s.settimeout(_left(deadline))
            _status(s)
        else:
            done = 0
            while done < n:
                s.settimeout(_left(deadline))
                got = s.recv_into(local[done:done + CHUNK])
                if got == 0:
                    raise ConnectionError("the owner closed the data connection")
                done += got
        ok = True
    except socket.timeout:
        raise TimeoutError("the tcp transfer did not finish in time") from None
    finally:
        if ok:
            s.settimeout(None)
            _give_back(info.tcp, s)
        else:
            s.close()


def _status(s) -> None:
    b = s.recv(1)
    if not b:
        raise ConnectionError("the owner closed the data connection")
    if b != b"\0":
        n = int.from_bytes(_recv_exact(s, 4) or b"\0\0\0\0", "big")
        raise RemoteError((_recv_exact(s, n) or b"").decode(errors="replace"))


def _left(deadline: float | None) -> float | None:
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the transfer did not finish in time")
    return left
