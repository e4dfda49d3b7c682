"""The fan link: a raw local socket between a host agent and each of its procs, for fanned
traffic (issue 11: a call to 256 procs of one host).

What travels on it: the calls, cells, spawns and broadcasts the agent forwards to a proc
(node/fanout.py ``_drain_fan``), and that proc's replies to them and the output written
while they run, back to the agent's gather (``FanRelay``). Everything else keeps its zmq
socket: point-to-point calls their one hop to the proc's work inbox, the proc's requests
to its agent the ROUTER.

Why not zmq here. On a fanned call each proc paid ~140 us on its main thread and ~40 us on
libzmq's I/O thread (a 2-core VM, 256 procs): three wake-ups per call (the I/O thread
reads the call and wakes the main thread; the main thread's reply wakes the I/O thread,
which writes it) plus a MAC check of the call and a signature of the reply. Here the main
thread blocks in the kernel on the socket itself, reads the call with one system call and
writes its reply with one; nothing is signed per message.

Why that is still not an open door. It is an ``AF_UNIX`` ``SOCK_SEQPACKET`` socket
(connected, ordered, reliable, message boundaries kept) that the agent listens on in this
user's 0700 ipc directory (core/transport.py ``ipc_dir``). A connection counts only after
both ends proved they hold the mesh key, once per connection:
  * the proc's first record is a ``hello`` signed with the mesh key for this listener (a
    replayed or forged one is dropped by wire.Keyring), naming a proc key this agent
    forked and has no link for yet, and the pid the kernel reports for the peer
    (``SO_PEERCRED``: it cannot be forged) must be that proc's and the uid ours;
  * the agent's ``ack`` is signed for that proc key, and the proc checks the listener's
    uid the same way, so nothing else can pose as its agent.
Anything else (no hello, a bad one, a second one, an unknown kind) closes the connection
before a byte of it is unpickled. After that the socket is point to point between two
processes the kernel names: no third process can write into it (one of the same uid could
ptrace either end anyway), so per-message MACs would buy nothing. Other users cannot reach
the directory at all. Messages over zmq stay signed as before.

Records. A small message is one record: a kind byte and its bytes. A larger one, or one
with out-of-band buffers (tensors), is a head record (the kind in upper case, the number
of frames and their lengths, the first bytes) followed by records of raw data read straight
into the message's buffer; buffers come out as writable memoryviews of one bytearray.
Each record is at most RECORD_MAX bytes (a record must fit the sender's socket buffer).

Who blocks. The agent never does: its sockets are non-blocking and what a proc's socket
does not take now waits in that connection's queue (written when epoll says it drains), as
zmq's queue did. A proc writes blocking (a lock keeps one message's records together
between threads): an agent that does not read holds its procs back instead of letting them
queue without bound. A proc's reads happen on its main thread only (its work loop, and the
nested wait of an endpoint that calls its own proc, core/inbox.py); a message whose records
are still coming keeps its place across an interrupt.

Death: a proc killed with SIGKILL leaves what it wrote in the socket; when the zygote
reports its exit the agent reads it all before it flushes its batches and reports the
death (FanRelay.forget_proc), so a member's reply sent before it died is never lost.
"""
from __future__ import annotations

import logging
import os
import pickle
import select
import socket
import struct
import threading
import time
from collections import deque

from monarch_kernel.core import wire
from monarch_kernel.core.fanout import FAN_PREFIX

log = logging.getLogger("monarch_kernel.fanlink")

RECORD_MAX = 32 * 1024     # bytes in one record
SNDBUF = 1 << 20           # each end's send buffer (the kernel caps it at net.core.wmem_max)
POLL_SLICE_S = 0.05        # FanLinks.poll reads this long at most before the agent's loop goes round
HELLO_TIMEOUT_S = 30.0     # a proc waits this long for its agent's ack, then goes without a link
_META = struct.Struct("<QBH")   # a reply's or output's route: call id, ok, len(destination)
_META_SIZE = _META.size
_COUNT = struct.Struct("<I")
_CRED = struct.Struct("3i")     # SO_PEERCRED: pid, uid, gid
_EPOLLIN, _EPOLLOUT = select.EPOLLIN, select.EPOLLOUT
# record kinds (lower case: the whole message in one record; upper case: a head record)
CALL, HELLO, ACK, REPLY, OUTPUT = 0x63, 0x68, 0x6B, 0x72, 0x6F   # c h k r o
_REPLY1 = bytes((REPLY,))
_NO_RUN = bytes(RECORD_MAX + 1)   # longer than any record: no run of replies yet (AgentLinks.poll)
_MULTI = 0x20   # lower -> upper case
_unpack_meta, _pack_meta = _META.unpack_from, _META.pack
_loads = pickle.loads


def _listener_dest(path: str) -> bytes:
    return wire.dest_id("fanlink:" + path)


def _proc_dest(proc_key: str) -> bytes:
    return wire.dest_id("fanlink-proc:" + proc_key)


# -------------------------------------------------------------------- records
def records(kind: int, frames: list) -> list:
    """The records of a message of ``frames`` (bytes-like): bytes for a record sent whole,
    a list of buffers for one sent with sendmsg (gathered without a copy)."""
    if len(frames) == 1:
        f = frames[0]
        if len(f) < RECORD_MAX:
            return [bytes((kind,)) + f if type(f) is bytes else b"".join((bytes((kind,)), f))]
    views = [memoryview(f).cast("B") for f in frames]
    head = b"".join((bytes((kind - _MULTI,)), _COUNT.pack(len(views)),
                     struct.pack(f"<{len(views)}Q", *(len(v) for v in views))))
    if len(head) > RECORD_MAX // 2:
        raise ValueError(f"a message of {len(views)} buffers is too many for one fan link message")
    out, cur, room = [], [head], RECORD_MAX - len(head)
    for v in views:
        off, n = 0, len(v)
        while off < n:
            if not room:
                out.append(cur)
                cur, room = [], RECORD_MAX
            take = min(room, n - off)
            cur.append(v[off:off + take])
            off += take
            room -= take
    out.append(cur)
    return out


class _Parts:
    """A message whose records are still arriving: its buffer and where the next one lands."""
    __slots__ = ("kind", "buf", "lens", "filled")

    def __init__(self, kind: int, lens: list, first):
        self.kind, self.lens = kind, lens
        self.buf = bytearray(sum(lens))
        self.buf[:len(first)] = first
        self.filled = len(first)

    def rest(self) -> memoryview:
        return memoryview(self.buf)[self.filled:]

    def done(self) -> bool:
        return self.filled >= len(self.buf)

    def frames(self) -> list:
        mv, out, at = memoryview(self.buf), [], 0
        for n in self.lens:
            out.append(mv[at:at + n])
            at += n
        return out


def _head(view: memoryview, n: int) -> _Parts:
    """A head record (``view[:n]``): the frames' lengths and the first of their bytes."""
    count = _COUNT.unpack_from(view, 1)[0]
    start = 5 + 8 * count
    lens = list(struct.unpack_from(f"<{count}Q", view, 5))
    return _Parts(view[0] + _MULTI, lens, view[start:n])


def load(frames: list):
    """A forwarded message (its pickled header and buffers) as the work inbox's opener gives
    it: the tuple, or a wire.LoadFailure the proc answers (a class it cannot import)."""
    try:
        return _loads(frames[0], buffers=frames[1:])
    except Exception as e:   # (what the work inbox's opener makes of it too: the proc answers)
        return wire.unloadable(e, frames[0], frames[1:], "the fan link")


def _peer(sock: socket.socket) -> tuple[int, int]:
    pid, uid, _ = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    return pid, uid


# -------------------------------------------------------------------- the proc's end
class ProcLink:
    """A proc's end (node/proc.py). ``read`` on the main thread only; ``send_*`` from any."""

    def __init__(self, path: str, keyring: wire.Keyring, key: bytes, proc_key: str):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SNDBUF)
            s.settimeout(HELLO_TIMEOUT_S)
            s.connect(path)
            if _peer(s)[1] != os.geteuid():
                raise ConnectionError(f"the fan link at {path} is not this user's")
            hello = keyring.sign(key, [pickle.dumps(("hello", proc_key, os.getpid()))], _listener_dest(path))
            s.send(bytes((HELLO,)) + hello[0])
            ack = s.recv(RECORD_MAX)
            keyring.accept("fan link ack", _proc_dest(proc_key))
            ok = ack[:1] == bytes((ACK,)) and keyring.open([ack[1:]], "fan link ack") == ("ack", proc_key)
            if not ok:
                raise ConnectionError(f"the agent did not acknowledge the fan link at {path}")
            s.settimeout(None)
        except BaseException:
            s.close()
            raise
        self.sock = s
        self.fd = s.fileno()
        self.lock = threading.Lock()
        self.parts: _Parts | None = None
        self.scratch = memoryview(bytearray(RECORD_MAX))   # a record comes in here (``read``)
        self._dests: dict[str, bytes] = {}   # a sink's address or a fanned reply_to -> the address, encoded
        self.received = self.sent = 0   # messages, each way (tests: the fanned path is this one)

    def read(self):
        """Read one record (the socket is readable): the message it completes (its tuple, or
        a LoadFailure), or None while a message's records are still coming. EOFError when the
        agent is gone."""
        parts = self.parts
        if parts is not None:
            n = self.sock.recv_into(parts.rest())
            if not n:
                raise EOFError("the agent closed the fan link")
            parts.filled += n
            if not parts.done():
                return None
            self.parts = None
            self.received += 1
            return load(parts.frames())
        return self.opened(self.sock.recv_into(self.scratch))

    def opened(self, n: int):
        """``read``'s second half: the record of ``n`` bytes just received into ``scratch``
        (the proc's fast path receives it itself and comes here for anything but a call it loaded)."""
        if not n:
            raise EOFError("the agent closed the fan link")
        view = self.scratch
        self.received += 1
        if view[0] == CALL:
            try:
                return _loads(view[1:n])   # copies what it keeps: the scratch is reused
            except Exception:
                return load([bytes(view[1:n])])
        if view[0] == CALL - _MULTI:
            parts = _head(view, n)
            if parts.done():
                return load(parts.frames())
            self.received -= 1   # counted when its last record comes
            self.parts = parts
            return None
        log.warning("dropped a record of unknown kind %r on the fan link", view[0])
        return None

    def _route(self, dest: str, call_id: int, ok: bool) -> bytes:
        d = self._dests.get(dest) or self._dest(dest)
        return _pack_meta(call_id, ok, len(d)) + d

    def _dest(self, dest: str, cut: int = 0) -> bytes:
        """``dest[cut:]`` encoded, kept by ``dest`` (a sink's address, or a fanned reply_to
        whose FAN_PREFIX is cut: no slice and no encode a call)."""
        if len(self._dests) > 64:
            self._dests.clear()
        d = self._dests[dest] = dest[cut:].encode()
        return d

    def send_reply(self, reply_to: str, call_id: int, ok: bool, vheader, vbufs=()) -> None:
        """A fanned call's reply: its value pickled apart (the agent never unpickles it).
        ``reply_to``: the call's, FAN_PREFIX and the gather's address."""
        d = self._dests.get(reply_to) or self._dest(reply_to, len(FAN_PREFIX))
        if not vbufs and len(d) + len(vheader) < RECORD_MAX - 16:   # the usual reply: one record
            rec = b"".join((b"r", _pack_meta(call_id, ok, len(d)), d, vheader))
            with self.lock:
                self.sock.send(rec)
                self.sent += 1
            return
        self._send(records(REPLY, [_pack_meta(call_id, ok, len(d)) + d, vheader, *vbufs]))

    def send_output(self, dest: str, call_id: int, msg: tuple) -> None:
        """Output written while a fanned call runs (messages.Output as a literal)."""
        body = pickle.dumps(msg, 5)
        meta = self._route(dest, call_id, True)
        if len(meta) + len(body) < RECORD_MAX - 1:
            self._send1(b"".join((b"o", meta, body)))
        else:
            self._send(records(OUTPUT, [meta, body]))

    def _send1(self, rec: bytes) -> None:
        with self.lock:
            self.sock.send(rec)
            self.sent += 1

    def _send(self, recs: list) -> None:
        """Several records, kept together: an interrupt between two of them would leave the
        agent reading the next message as the rest of this one, so it waits for the last."""
        interrupted = None
        with self.lock:
            for rec in recs:
                while True:
                    try:
                        self.sock.sendmsg(rec) if type(rec) is list else self.sock.send(rec)
                        break
                    except KeyboardInterrupt as e:
                        interrupted = e
            self.sent += 1
        if interrupted is not None:
            raise interrupted

    def close(self) -> None:
        self.sock.close()


# -------------------------------------------------------------------- the agent's end
class _Conn:
    __slots__ = ("sock", "recv", "fd", "key", "pid", "out", "parts", "want_out")

    def __init__(self, sock: socket.socket, pid: int):
        self.sock, self.recv, self.fd, self.pid = sock, sock.recv, sock.fileno(), pid
        self.key: str | None = None   # the proc's key, once its hello checked out
        self.out: deque = deque()     # records its socket did not take yet
        self.parts: _Parts | None = None
        self.want_out = False


class AgentLinks:
    """The agent's end: a listener, one connection per proc, and one epoll set over them
    (``fileno``: the agent's poll loop watches it). Callbacks, on the agent's loop thread:
    ``on_replies(dest, call_id, ok, keys, vheaders, vbufs=())`` (replies alike but for their
    value: several procs' plain ones, or one proc's with its buffers),
    ``on_output(dest, call_id, msg)``;
    ``accept_proc(key, pid)``: True when ``key`` is a proc of ours with pid ``pid``."""

    def __init__(self, keyring: wire.Keyring, key: bytes, path: str, accept_proc, on_replies, on_output):
        self.keyring, self.key, self.path = keyring, key, path
        self.accept_proc, self.on_replies, self.on_output = accept_proc, on_replies, on_output
        keyring.accept("fan link", _listener_dest(path))
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_NONBLOCK
                                      | socket.SOCK_CLOEXEC)
        self.listener.bind(path)
        self.listener.listen(4096)
        self.ep = select.epoll()
        self.ep.register(self.listener.fileno(), _EPOLLIN)
        self.conns: dict[int, _Conn] = {}     # fd -> connection
        self.by_key: dict[str, _Conn] = {}    # proc key -> its (checked) connection
        self._dests: dict[bytes, str] = {}
        self.uid = os.geteuid()
        self.changes = 0   # moves when a proc's checked connection comes or goes (FanRelay's routes)

    def fileno(self) -> int:
        return self.ep.fileno()

    # ------------------------------------------------------------ sending (never blocks)
    def send(self, c: _Conn, recs: list) -> None:
        if c.out:
            c.out.extend(recs)
            return
        sock = c.sock
        for i, rec in enumerate(recs):
            try:
                sock.send(rec) if type(rec) is bytes else sock.sendmsg(rec)
            except BlockingIOError:
                c.out.extend(recs[i:])
                self._want_out(c, True)
                return
            except OSError as e:   # the proc is gone: its death comes from the zygote
                log.info("fan link to proc %s: %s", c.key, e)
                return

    def send_each(self, conns: list, recs: list) -> None:
        """``send`` the same message to each of ``conns``; one record (a usual call) in a
        tight loop."""
        if len(recs) != 1 or type(recs[0]) is not bytes:
            for c in conns:
                self.send(c, recs)
            return
        rec = recs[0]
        for c in conns:
            if c.out:
                c.out.append(rec)
                continue
            try:
                c.sock.send(rec)
            except BlockingIOError:
                c.out.append(rec)
                self._want_out(c, True)
            except OSError as e:   # the proc is gone: its death comes from the zygote
                log.info("fan link to proc %s: %s", c.key, e)

    def _want_out(self, c: _Conn, on: bool) -> None:
        if c.want_out != on:
            c.want_out = on
            self.ep.modify(c.fd, _EPOLLIN | _EPOLLOUT if on else _EPOLLIN)

    def _drain_out(self, c: _Conn) -> None:
        out, sock = c.out, c.sock
        while out:
            rec = out[0]
            try:
                sock.send(rec) if type(rec) is bytes else sock.sendmsg(rec)
            except BlockingIOError:
                return
            except OSError:
                out.clear()
                break
            out.popleft()
        self._want_out(c, False)

    # ------------------------------------------------------------ reading
    def poll(self) -> None:
        """The epoll set is readable: accept, read one record from each ready connection, and
        again until none is ready (level-triggered: a connection with more is ready again).

        A call to all gives one plain reply from every proc, alike up to the value: the same
        kind, call id, ok and destination. That prefix is compared as bytes, and a run of
        replies that share it goes to ``on_replies`` as two lists (keys, value headers), so a
        reply costs the agent its ``recv`` and a few C-level steps, not a parse and a call
        chain each (256 procs on 2 cores: the agent read ~11 us a reply). Any other record
        hands the run over first, so what a proc wrote keeps its order.

        Procs that never stop writing (a flood of output) are read for POLL_SLICE_S, then the
        agent's loop goes round (its controller's heartbeats, its flush timers); the epoll set
        is still readable. (Under 256 ranks flooding on 2 cores an agent's loop took up to 1.35 s
        a round.)"""
        lfd, conns, ep, epollin = self.listener.fileno(), self.conns, self.ep, _EPOLLIN
        prefix, plen, route, keys, heads = _NO_RUN, 0, None, [], []
        until = time.monotonic() + POLL_SLICE_S
        while True:
            events = ep.poll(0)
            if not events or time.monotonic() > until:
                break
            for fd, ev in events:
                c = conns.get(fd)
                if c is None:
                    if fd == lfd:
                        self._accept()
                    continue
                if ev != epollin or c.parts is not None or c.key is None:
                    if keys:
                        self.on_replies(*route, keys, heads)
                        keys, heads = [], []
                    if ev & _EPOLLOUT:
                        self._drain_out(c)
                    if ev & ~_EPOLLOUT:
                        self._read(c)
                    continue
                try:
                    rec = c.recv(RECORD_MAX)
                except BlockingIOError:
                    continue
                except OSError:
                    rec = b""
                if rec.startswith(prefix):   # the run's prefix: one more alike reply
                    keys.append(c.key)
                    heads.append(rec[plen:])
                    continue
                if keys:
                    self.on_replies(*route, keys, heads)
                    keys, heads = [], []
                if rec[:1] == _REPLY1 and len(rec) > _META_SIZE:   # a plain reply: it starts a run
                    call_id, ok, dn = _unpack_meta(rec, 1)
                    plen = 1 + _META_SIZE + dn
                    prefix = rec[:plen]
                    route = (self._dest(rec[1 + _META_SIZE:plen]), call_id, bool(ok))
                    keys.append(c.key)
                    heads.append(rec[plen:])
                else:
                    self._record(c, rec)
        if keys:
            self.on_replies(*route, keys, heads)

    def _accept(self) -> None:
        while True:
            try:
                s, _ = self.listener.accept()
            except BlockingIOError:
                return
            except OSError as e:   # out of fds, say: the proc will go without a link
                log.warning("fan link: accept failed: %s", e)
                return
            s.setblocking(False)
            try:
                pid, uid = _peer(s)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SNDBUF)
            except OSError:
                s.close()
                continue
            if uid != self.uid:
                log.warning("fan link: refused a connection from uid %d (pid %d)", uid, pid)
                s.close()
                continue
            c = _Conn(s, pid)
            self.conns[c.fd] = c
            self.ep.register(c.fd, _EPOLLIN)

    def _read(self, c: _Conn) -> None:
        """Read one record of ``c`` (it is readable) and take it."""
        parts, rec, n = c.parts, b"", 0
        try:
            if parts is None:
                rec = c.sock.recv(RECORD_MAX)
            else:
                n = c.sock.recv_into(parts.rest())
        except BlockingIOError:
            return
        except OSError:
            pass   # its end: closed below
        if parts is None:
            self._record(c, rec)
            return
        if not n:
            self.close(c)
            return
        parts.filled += n
        if parts.done():
            c.parts = None
            self._take_frames(c, parts.kind, parts.frames())

    def _record(self, c: _Conn, rec: bytes) -> None:
        """Take one whole record ``rec`` of ``c`` (b"": its end)."""
        if not rec:
            self.close(c)
            return
        kind = rec[0]
        if c.key is None:
            self._hello(c, rec)
            return
        if (kind == REPLY or kind == OUTPUT) and len(rec) <= _META_SIZE:
            log.warning("fan link: proc %s sent a record too short for its route: closed", c.key)
            self.close(c)
            return
        if kind == REPLY or kind == OUTPUT:
            call_id, ok, dn = _unpack_meta(rec, 1)
            at = 1 + _META_SIZE + dn
            dest = self._dest(rec[1 + _META_SIZE:at])
            if kind == REPLY:
                self.on_replies(dest, call_id, bool(ok), [c.key], [rec[at:]])
            else:
                self.on_output(dest, call_id, _loads(rec[at:]))
            return
        if kind == REPLY - _MULTI or kind == OUTPUT - _MULTI:
            try:
                parts = _head(rec, len(rec))
            except struct.error:   # shorter than the lengths it announces
                log.warning("fan link: proc %s sent a truncated head record: closed", c.key)
                self.close(c)
                return
            if parts.done():
                self._take_frames(c, parts.kind, parts.frames())
            else:
                c.parts = parts
            return
        log.warning("fan link: proc %s sent a record of unknown kind %r: closed", c.key, kind)
        self.close(c)

    def _take_frames(self, c: _Conn, kind: int, frames: list) -> None:
        meta = frames[0]
        call_id, ok, dn = _unpack_meta(meta, 0)
        dest = self._dest(meta[_META_SIZE:_META_SIZE + dn])
        if kind == REPLY:
            self.on_replies(dest, call_id, bool(ok), [c.key], [bytes(frames[1])], frames[2:])
        elif kind == OUTPUT:
            self.on_output(dest, call_id, _loads(frames[1]))

    def _dest(self, raw) -> str:
        raw = bytes(raw)
        d = self._dests.get(raw)
        if d is None:
            if len(self._dests) > 1024:
                self._dests.clear()
            d = self._dests[raw] = raw.decode(errors="replace")
        return d

    def _hello(self, c: _Conn, rec: bytes) -> None:
        """The first record of a connection: a proc proves it holds the mesh key and is the
        process the kernel says it is; anything else closes the connection unread."""
        msg = None
        if rec[0] == HELLO and len(rec) > 1:
            msg = self.keyring.open([rec[1:]], "fan link")
        ok = (type(msg) is tuple and len(msg) == 3 and msg[0] == "hello" and type(msg[1]) is str
              and msg[2] == c.pid and msg[1] not in self.by_key and self.accept_proc(msg[1], c.pid))
        if not ok:
            log.warning("fan link: refused a connection from pid %d (no valid hello)", c.pid)
            self.close(c)
            return
        ack = self.keyring.sign(self.key, [pickle.dumps(("ack", msg[1]))], _proc_dest(msg[1]))
        try:
            c.sock.send(bytes((ACK,)) + ack[0])
        except OSError:   # it gave up waiting (HELLO_TIMEOUT_S): it went on without a link
            self.close(c)
            return
        c.key = msg[1]
        self.by_key[c.key] = c
        self.changes += 1

    # ------------------------------------------------------------ ending
    def drain(self, key: str) -> None:
        """A proc ended: read what it wrote before it did, then close its connection."""
        c = self.by_key.get(key)
        if c is None:
            return
        while c.fd in self.conns and self._readable(c):
            self._read(c)   # to its end of file (a dead proc writes nothing more)
        self.close(c)

    @staticmethod
    def _readable(c: _Conn) -> bool:
        try:
            return bool(select.select([c.fd], [], [], 0)[0])
        except (OSError, ValueError):
            return False

    def close(self, c: _Conn) -> None:
        if self.conns.pop(c.fd, None) is None:
            return
        if c.key is not None and self.by_key.get(c.key) is c:
            del self.by_key[c.key]
            self.changes += 1
        try:
            self.ep.unregister(c.fd)
        except (OSError, ValueError):
            pass
        c.out.clear()
        c.sock.close()

    def close_all(self) -> None:
        for c in list(self.conns.values()):
            self.close(c)
        self.ep.close()
        self.listener.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass
