"""Wire format: authenticated, pickle-5 messages with out-of-band buffers.

A message on a socket is the frames ``[key_id + signature + header, *buffers]``:
  * ``header`` is a cloudpickle (protocol 5) of the message tuple; large buffers
    (tensors, numpy arrays, bytes-like) travel as separate frames, zero-copy;
  * ``signature`` is a keyed BLAKE2b MAC over the header and the buffer lengths, with the
    mesh key named by ``key_id``. A message whose signature does not verify is dropped and
    logged before anything is unpickled.
CPU tensors are sent as raw bytes plus dtype and shape; the receiver rebuilds them on
the received frame's memory, without a copy, and writable.
"""
from __future__ import annotations

import ctypes
import hashlib
import hmac
import io
import linecache
import logging
import os
import pickle
import struct
import sys
import threading
import time
import types

import cloudpickle
import zmq

from .. import config
from . import curve as _curve
from . import extensions as _extensions

_RCVMORE = int(zmq.RCVMORE)

log = logging.getLogger("monarch_kernel.wire")

try:  # cloudpickle's own test of "would this be pickled by value" (private, but stable)
    from cloudpickle.cloudpickle import _should_pickle_by_reference as _by_reference
except ImportError:  # pragma: no cover
    def _by_reference(obj, name=None):
        return getattr(obj, "__module__", "__main__") != "__main__"

SMALL_COPY = 64 * 1024  # below this, received buffers are copied (cheaper than pinning a frame)


class SourceMarker:
    """Put last in a message tuple: it pickles as the source lines of every function that
    was pickled by value before it (cells, ``__main__``), so the worker's tracebacks and
    debugger ``list`` show the real lines. It loads as None."""


SOURCES = SourceMarker()


def _install_sources(sources):
    for filename, lines in sources.items():
        if filename not in linecache.cache or linecache.cache[filename][1] is not None:
            linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)


def _rebuild_tensor(buf, dtype_name: str, shape, requires_grad: bool):
    import torch

    dtype = getattr(torch, dtype_name)
    mv = memoryview(buf).cast("B")
    if mv.nbytes == 0:
        t = torch.empty(shape, dtype=dtype)
    else:
        if mv.readonly:
            mv = writable_view(mv, owner=buf)
        t = torch.frombuffer(mv, dtype=dtype).reshape(shape)
    if requires_grad:
        t.requires_grad_(True)
    return t


def writable_view(mv: memoryview, owner) -> memoryview:
    """A writable view of a received frame's memory (ours alone after recv over tcp/ipc).

    Small buffers are copied; large ones are mapped in place with the frame kept alive
    by the view, so a received 64 MiB tensor costs no copy and can be modified in place.
    """
    if mv.nbytes < SMALL_COPY:
        return memoryview(bytearray(mv))
    import numpy as np

    addr = np.frombuffer(mv, dtype=np.uint8).ctypes.data
    arr = (ctypes.c_ubyte * mv.nbytes).from_address(addr)
    arr._owner = (owner, mv)  # keeps the zmq frame (and its memory) alive
    return memoryview(arr).cast("B")


def _none():
    return None


class _ByValue(Exception):
    """Raised by the fast pickler when something must be pickled by value."""


def _reduce_tensor(obj, torch):
    data = obj.detach().contiguous()
    flat = data.reshape(-1).view(torch.uint8) if data.numel() else torch.empty(0, dtype=torch.uint8)
    buf = pickle.PickleBuffer(flat.numpy())
    dtype = str(obj.dtype).removeprefix("torch.")
    return _rebuild_tensor, (buf, dtype, tuple(obj.shape), bool(obj.requires_grad))


def _rebuild_cuda_tensor(cpu, index: int, requires_grad: bool):
    """A CUDA tensor sent as host bytes lands on the receiver's ``cuda:index``; where the
    receiver has no such device (a notebook on a CPU-only login node) it stays on the CPU,
    where torch's own unpickling would raise."""
    import torch

    if torch.cuda.is_available() and index < torch.cuda.device_count():
        cpu = cpu.to(f"cuda:{index}")
    if requires_grad:
        cpu.requires_grad_(True)
    return cpu


def _reduce_cuda_tensor(obj, torch):
    """Torch pickles a CUDA tensor's storage through torch.save, at ~0.1 GB/s (measured on an
    H100). One copy into pinned host memory instead, then the CPU path (same-host handles
    for large tensors, zero-copy frames otherwise): ~30x that."""
    data = obj.detach()
    nbytes = data.numel() * data.element_size()
    host = torch.empty(data.shape, dtype=data.dtype, pin_memory=nbytes >= SMALL_COPY)
    host.copy_(data)
    return _rebuild_cuda_tensor, (host, data.device.index or 0, bool(obj.requires_grad))


def _tensor_reduction(obj, t):
    torch = sys.modules.get("torch")
    if torch is not None and (t is torch.Tensor or t is torch.nn.Parameter):
        device = obj.device.type
        if device in ("cpu", "cuda") and obj.layout == torch.strided and not obj.is_quantized:
            n = _LOCAL.receivers
            if n and LARGE_TENSOR_HOOK is not None and obj.numel() * obj.element_size() >= LARGE_TENSOR_BYTES:
                r = LARGE_TENSOR_HOOK(obj.detach().contiguous(), n)   # same host: a handle, not bytes
                if r is not None:
                    return r
            return _reduce_tensor(obj, torch) if device == "cpu" else _reduce_cuda_tensor(obj, torch)
    return None


class _LocalReceivers(threading.local):
    receivers = 0   # >0 while dumps() packs a message for that many same-host receivers


_LOCAL = _LocalReceivers()
LARGE_TENSOR_BYTES = config.SHM_TENSOR_BYTES.get()


SHM_TENSORS = config.SHM_TENSORS.get()
# (tensor, receivers) -> a pickle reduction, or None for the socket path. Set by the rdma
# feature through extensions.register_large_tensor_hook (kept None with MONARCH_KERNEL_SHM_TENSORS=0).
LARGE_TENSOR_HOOK = _extensions.large_tensor_hook() if SHM_TENSORS else None


class _FastPickler(pickle.Pickler):
    """The C pickler, for messages of plain data, tensors and importable classes (the hot
    path: a call's header pickles in under a microsecond). Anything that must travel by
    value (a function or class from ``__main__`` or a notebook cell) raises _ByValue and
    the message is pickled again by cloudpickle."""

    def reducer_override(self, obj):
        t = type(obj)
        if t is SourceMarker:
            return (_none, ())
        r = _tensor_reduction(obj, t)
        if r is not None:
            return r
        if (t is types.FunctionType or isinstance(obj, type)) and obj not in _OURS and not _by_reference(obj):
            raise _ByValue
        return NotImplemented


_DYNAMIC_CODE = "<dynamic-code>"   # what cloudpickle >= 3.1.3 names a shipped function's file


class _Pickler(cloudpickle.Pickler):
    def __init__(self, file, buffers):
        super().__init__(file, protocol=5, buffer_callback=None if buffers is None else buffers.append)
        self.source_files: set[str] | None = None

    def reducer_override(self, obj):
        t = type(obj)
        if t is SourceMarker:
            return self._reduce_sources()
        r = _tensor_reduction(obj, t)
        if r is not None:
            return r
        if t is types.FunctionType and not _by_reference(obj):
            if self.source_files is None:
                self.source_files = set()
            self.source_files.add(obj.__code__.co_filename)
        elif t is types.CodeType:
            return self._code_with_its_file(obj)
        return super().reducer_override(obj)

    def _code_with_its_file(self, code):
        """cloudpickle's reduction of a code object, keeping its file name: since 3.1.3 it
        ships every function's code as ``<dynamic-code>`` (for payloads that do not depend on
        where a function was defined), which took the file and lines out of a remote
        traceback of a ``__main__`` or notebook function, and the source lines shipped with
        it (``_reduce_sources``) under its file name no longer matched."""
        rebuild, args = self.dispatch_table[types.CodeType](code)
        return rebuild, tuple(code.co_filename if type(a) is str and a == _DYNAMIC_CODE else a for a in args)

    def _reduce_sources(self):
        if not self.source_files:
            return (_none, ())
        sources = {}
        for fn in self.source_files:
            lines = linecache.getlines(fn)
            if lines:
                sources[fn] = lines
        return _install_sources, (sources,)


_OURS = frozenset((_none, _rebuild_tensor, _rebuild_cuda_tensor, _install_sources))


def dumps(obj, local_receivers: int = 0) -> list:
    """Pickle ``obj``; returns ``[header, *buffers]`` (buffers as zero-copy memoryviews).
    ``local_receivers`` > 0: every receiver is on this host, so large tensors may travel
    as handles the receivers pull from our memory (LARGE_TENSOR_HOOK)."""
    fast = obj
    if type(obj) is tuple and obj and obj[-1] is SOURCES:
        fast = obj[:-1] + (None,)   # it loads as None; only what is pickled by value needs sources
    n = local_receivers if LARGE_TENSOR_HOOK is not None else 0
    cached = _CACHED
    if not n and not cached.busy:
        # The hot path (a call, a reply): this thread's pickler, reused (its memo cleared).
        cached.busy = True
        p = cached.pickler
        try:
            if p is None:
                p = cached.pickler = _ReusedPickler()
            p.dump(fast)
            out = [p.file.getvalue()]
            if p.buffers:
                out += [b.raw() for b in p.buffers]
            if len(out[0]) > SMALL_COPY:
                cached.pickler = None   # do not keep a large file's memory for the next message
            return out
        except Exception:
            pass   # by value (cloudpickle) below
        finally:
            p.reset()
            cached.busy = False
    buffers: list = []
    f = io.BytesIO()
    if n:
        _LOCAL.receivers = n
    try:
        try:
            _FastPickler(f, protocol=5, buffer_callback=buffers.append).dump(fast)
        except Exception:
            buffers = []
            f = io.BytesIO()
            _Pickler(f, buffers).dump(obj)
    finally:
        if n:
            _LOCAL.receivers = 0
    if not buffers:
        return [f.getvalue()]
    return [f.getvalue()] + [b.raw() for b in buffers]


class _ReusedPickler(_FastPickler):
    """One per thread (dumps): creating a pickler and its file costs more than a small
    message's whole pickling."""

    def __init__(self):
        self.file = io.BytesIO()
        self.buffers: list = []
        super().__init__(self.file, protocol=5, buffer_callback=self.buffers.append)

    def reset(self):
        self.clear_memo()
        self.file.seek(0)
        self.file.truncate()
        self.buffers.clear()


class _CachedPickler(threading.local):
    pickler: _ReusedPickler | None = None
    busy = False   # dumps called again while pickling (a reducer that sends): use a fresh one


_CACHED = _CachedPickler()


PLAIN_TYPES = frozenset((type(None), bool, int, float, complex, str, bytes))


def plain(args: tuple, kwargs: dict) -> bool:
    """Are a call's arguments all plain values (None, numbers, str, bytes)? Then the call
    pickles with ``pickle.dumps`` as it would with our picklers (no tensor, nothing by
    value), in one C call."""
    for a in args:
        if type(a) not in PLAIN_TYPES:
            return False
    if kwargs:
        for a in kwargs.values():
            if type(a) not in PLAIN_TYPES:
                return False
    return True


def dumps_inband(obj) -> bytes:
    """One self-contained bytes object (kept and re-sent later, e.g. an actor's spawn)."""
    f = io.BytesIO()
    _Pickler(f, None).dump(obj)
    return f.getvalue()


_NEXT_BUFFER = pickle.NEXT_BUFFER


def recv_message(sock, flags: int = 0) -> list:
    """One message off a socket: the first frame as bytes (cheaper than a zmq.Frame for the
    small header), the rest as zero-copy Frames (tensor payloads).

    Asking zmq for RCVMORE costs more than a small message's whole MAC check, so it is asked
    only when more frames may follow: a header travelling alone (just the prefix), or one that
    names an out-of-band buffer (pickle's NEXT_BUFFER byte; a stray 0x97 in the data only
    costs the question). Every multi-frame message of ours is one of these (dumps)."""
    first = sock.recv(flags)
    if len(first) != _PREFIX and first.find(_NEXT_BUFFER, _PREFIX) < 0:
        return [first]
    if not sock.getsockopt(_RCVMORE):
        return [first]
    frames = [first]
    while True:
        frames.append(sock.recv(copy=False))
        if not sock.getsockopt(_RCVMORE):
            return frames if first[:8] != _curve.CHUNKED else _curve.joined(frames)   # large frames over tcp


def loads(header, buffers=()):
    return pickle.loads(header, buffers=buffers)


MAC_SIZE = 16
STAMP_SIZE = 8 + 8 + 8 + 8   # sender id, sequence number, send time (ms), destination: inside the MAC
_PREFIX = 8 + MAC_SIZE + STAMP_SIZE   # key id + MAC + stamp, in front of the header
assert _curve.CHUNK_HEAD == _PREFIX and pickle.NEXT_BUFFER == b"\x97"   # curve.chunked's first frame
_STAMP = struct.Struct("<8sQQ8s")
REPLAY_WINDOW = 1024     # a sender's messages to one socket may arrive this far out of order
MAX_AGE_S = config.MAX_MESSAGE_AGE_S.get()   # clock skew + queueing
_WINDOW_MASK = (1 << REPLAY_WINDOW) - 1
_LEN8 = struct.Struct("<Q").pack
_time = time.time


def _lengths(header, buffers) -> bytes:
    """The frame boundaries, inside the MAC: the header's length and each buffer's."""
    if not buffers:
        return _LEN8(len(header))
    return b"".join([_LEN8(len(header)), *(_LEN8(len(b)) for b in buffers)])


DEST_IDS: dict[str, bytes] = {}


def dest_id(addr: str) -> bytes:
    """The 8-byte name of a receiving socket, as its senders address it: a tcp endpoint by its
    port (a peer may reach it by any of the host's names, or bind on every interface), an
    ipc endpoint by its (unique) name; a ``?curve=`` key is not part of it."""
    d = DEST_IDS.get(addr)
    if d is None:
        base = addr.split("?", 1)[0]
        if base.startswith("tcp://"):
            base = "tcp:" + base.rsplit(":", 1)[-1]
        d = hashlib.blake2b(base.encode(), digest_size=8, person=b"mk-dest").digest()
        if len(DEST_IDS) > 65536:
            DEST_IDS.clear()
        DEST_IDS[addr] = d
    return d


def dest_of_identity(ident: bytes) -> bytes:
    """The destination name of a DEALER peer of a ROUTER (an agent's reply goes to it)."""
    return hashlib.blake2b(bytes(ident), digest_size=8, person=b"mk-ident").digest()


def new_identity() -> bytes:
    """A ROUTING_ID for a DEALER (never starting with a zero byte, which zmq reserves)."""
    return b"mk" + os.urandom(8)


class _SenderStamp(threading.local):
    """Each sending thread is a sender of its own: a random id and a counter per destination
    (a forked child starts a new sender, see _new_sender_after_fork)."""

    epoch = -1
    sender = b""
    seqs: dict = {}


_SENDER = _SenderStamp()
_FORK_EPOCH = [0]


def _new_sender_after_fork():
    _FORK_EPOCH[0] += 1


os.register_at_fork(after_in_child=_new_sender_after_fork)


def _stamp(dest: bytes) -> bytes:
    st = _SENDER
    seqs = st.seqs
    if st.epoch != _FORK_EPOCH[0] or len(seqs) > 65536:
        st.epoch, st.sender, seqs = _FORK_EPOCH[0], os.urandom(8), {}
        st.seqs = seqs
    seq = seqs.get(dest, 0) + 1
    seqs[dest] = seq
    return _STAMP.pack(st.sender, seq, int(time.time() * 1000), dest)


class _ReplayGuard:
    """Per receiving socket: the destination names it answers to, and the messages already
    seen from each sender (its highest sequence number and a bitmap of the REPLAY_WINDOW
    before it). A message for another destination, seen before, older than the window, or
    sent more than MAX_AGE_S ago is a replay.

    No lock: a socket is read by one thread at a time (zmq sockets are not thread-safe; the
    runtime's inbox changes hands under its own lock), so its guard is too."""

    __slots__ = ("senders", "dests", "opened")

    def __init__(self, dests=()):
        self.senders: dict[bytes, list] = {}   # sender id + dest -> [highest seq, bitmap, last seen]
        self.dests: set[bytes] = set(dests)
        self.opened = 0

    def check(self, sender: bytes, seq: int, sent_ms: int, dest: bytes) -> str:
        if dest not in self.dests:
            return "addressed to another socket (a frame captured on its way elsewhere)"
        now = _time()
        if abs(now - sent_ms / 1000) > MAX_AGE_S:
            return f"sent {now - sent_ms / 1000:.0f} s ago (limit {MAX_AGE_S:.0f} s; are the clocks in sync?)"
        stream = sender + dest   # a sender numbers each destination name of this socket apart
        w = self.senders.get(stream)
        if w is None:
            self.senders[stream] = [seq, 1, now]
            self.opened += 1
            if self.opened % 4096 == 0:
                self._prune(now)
            return ""
        hi = w[0]
        w[2] = now
        if seq > hi:   # the usual case: in order
            shift = seq - hi
            w[0] = seq
            if shift == 1 and w[1] is _WINDOW_MASK:   # the next one, all of the window seen: no bits move
                return ""
            bits = ((w[1] << shift) | 1) & _WINDOW_MASK if shift < REPLAY_WINDOW else 1
            w[1] = _WINDOW_MASK if bits == _WINDOW_MASK else bits   # (the one object: `is` above)
            return ""
        back = hi - seq
        if back >= REPLAY_WINDOW:
            return f"older than the last {REPLAY_WINDOW} messages of its sender"
        bits = w[1]
        if bits >> back & 1:
            return "already received (a replay)"
        w[1] = bits | (1 << back)
        return ""

    def _prune(self, now: float) -> None:
        """Senders silent for longer than MAX_AGE_S: anything they sent is now too old anyway."""
        for k in [k for k, w in self.senders.items() if now - w[2] > MAX_AGE_S]:
            del self.senders[k]


def key_id(key: bytes) -> bytes:
    return hashlib.sha256(b"monarch-kernel-key-id" + key).digest()[:8]


class Sealed(list):
    """``[header, *buffers]`` with their MAC computed up to the stamp (``body``: a keyed
    BLAKE2b state). ``Keyring.stamp`` finishes it for one destination, so a message sent to
    many procs hashes its body once and pays a copy and 32 bytes more per destination."""

    __slots__ = ("kid", "body")


class Keyring:
    """The mesh keys this process trusts, by id. Signing uses the key of the destination's
    mesh; verifying accepts any trusted key (keys only arrive inside verified messages).

    A message on the wire: ``[key id (8) + MAC (16) + stamp (32) + header, *buffers]``, the
    stamp being (sender, sequence number, send time, destination). The MAC is a keyed
    BLAKE2b over header, frame lengths and stamp: a frame replayed to the same socket, or
    to another one (another proc of the same mesh), is dropped. A header of SMALL_COPY bytes
    or more travels as a frame of its own after the prefix, so a broadcast does not copy it
    once per destination."""

    def __init__(self):
        self._keys: dict[bytes, bytes] = {}
        self._ids: dict[bytes, bytes] = {}
        self._base: dict[bytes, object] = {}   # key id -> keyed BLAKE2b state, copied per message
        self._guards: dict[str, _ReplayGuard] = {}   # receiving socket (``where``) -> its guard
        self.replays_dropped = 0

    def add(self, key: bytes) -> bytes:
        kid = self._ids.get(key)
        if kid is None:
            kid = key_id(key)
            self._base[kid] = hashlib.blake2b(key=key, digest_size=MAC_SIZE)
            self._keys[kid] = key
            self._ids[key] = kid
        return kid

    def any_key(self) -> bytes:
        """A key this process trusts (to sign a message to itself); KeyError if none."""
        return next(iter(self._keys.values()))

    def accept(self, where: str, *dests: bytes) -> None:
        """Messages read from ``where`` may be addressed to ``dests`` (its endpoints' dest_id);
        a socket that was never told accepts nothing."""
        guard = self._guards.get(where)
        if guard is None:
            guard = self._guards.setdefault(where, _ReplayGuard())
        guard.dests.update(dests)

    def seal(self, key: bytes, frames: list) -> Sealed:
        kid = self._ids.get(key) or self.add(key)
        out = Sealed(frames)
        out.kid = kid
        h = out.body = self._base[kid].copy()
        header = frames[0]
        h.update(header)
        h.update(_lengths(header, frames[1:]) if len(frames) > 1 else _LEN8(len(header)))
        return out

    @staticmethod
    def stamp(sealed: Sealed, dest: bytes) -> list:
        """The frames of ``sealed`` for the socket named ``dest`` (dest_id)."""
        s = _stamp(dest)
        h = sealed.body.copy()
        h.update(s)
        header = sealed[0]
        if len(header) >= SMALL_COPY:
            return [b"".join((sealed.kid, h.digest(), s)), *sealed]
        first = b"".join((sealed.kid, h.digest(), s, header))
        return [first, *sealed[1:]] if len(sealed) > 1 else [first]

    def sign_one(self, key: bytes, header: bytes, dest: bytes) -> bytes:
        """The single frame of a message with no buffers and a header under SMALL_COPY bytes,
        for the socket named ``dest``: what ``sign(key, [header], dest)[0]`` is, in one pass
        (the hot path of every call and reply)."""
        kid = self._ids.get(key) or self.add(key)
        st = _SENDER   # _stamp(dest), inline
        seqs = st.seqs
        if st.epoch != _FORK_EPOCH[0] or len(seqs) > 65536:
            s = _stamp(dest)
        else:
            seq = seqs[dest] = seqs.get(dest, 0) + 1
            s = _STAMP.pack(st.sender, seq, int(_time() * 1000), dest)
        h = self._base[kid].copy()
        h.update(header)
        h.update(_LEN8(len(header)))
        h.update(s)
        return b"".join((kid, h.digest(), s, header))

    def sign(self, key: bytes, frames: list, dest: bytes) -> list:
        """``frames`` = [header, *buffers] -> the frames to send to the socket named ``dest``."""
        return self.stamp(self.seal(key, frames), dest)

    def open(self, frames, where: str = "socket"):
        """Verify and unpickle received frames (zmq.Frame or bytes). Returns the message, or
        None after logging when it is malformed, not signed with a trusted key, or a replay."""
        if len(frames) == 1:   # the usual message: one small frame (a call, a reply)
            first = frames[0]
            n = len(first)
            if type(first) is bytes and _PREFIX < n < SMALL_COPY:
                base = self._base.get(first[:8])
                if base is not None:
                    header = first[_PREFIX:]
                    h = base.copy()
                    h.update(header)
                    h.update(_LEN8(n - _PREFIX))
                    stamp = first[24:_PREFIX]
                    h.update(stamp)
                    if not hmac.compare_digest(h.digest(), first[8:24]):
                        log.warning("dropped an unauthenticated message on %s (bad signature)", where)
                        return None
                    return self._accept(where, stamp, header, ())
        first = frames[0] if frames else b""
        if type(first) is not bytes:
            first = first.buffer if hasattr(first, "buffer") else memoryview(first)
        n = len(first)
        if n < _PREFIX or (n == _PREFIX and len(frames) < 2):
            log.warning("dropped a malformed message on %s (%d frame(s), %d bytes)", where, len(frames), n)
            return None
        kid = bytes(first[:8])
        base = self._base.get(kid)
        if n == _PREFIX:   # a large header, in a frame of its own
            header, rest = frames[1], frames[2:]
            header = header.buffer if hasattr(header, "buffer") else header
        else:
            header, rest = (first[_PREFIX:] if n < SMALL_COPY or type(first) is not bytes
                            else memoryview(first)[_PREFIX:]), frames[1:]
        bufs = [f.buffer if hasattr(f, "buffer") else f for f in rest] if rest else []
        if base is None:
            log.warning("dropped an unauthenticated message on %s (unknown key)", where)
            return None
        h = base.copy()
        h.update(header)
        h.update(_lengths(header, bufs) if bufs else _LEN8(len(header)))
        stamp = first[8 + MAC_SIZE:_PREFIX]
        h.update(stamp)
        if not hmac.compare_digest(h.digest(), bytes(first[8:8 + MAC_SIZE])):
            log.warning("dropped an unauthenticated message on %s (bad signature)", where)
            return None
        return self._accept(where, stamp, header, bufs)

    def _accept(self, where: str, stamp, header, bufs):
        """A message whose MAC verified: drop it if it is a replay, else unpickle it."""
        guard = self._guards.get(where)
        if guard is None:
            guard = self._guards.setdefault(where, _ReplayGuard())
        why = guard.check(*_STAMP.unpack(stamp))
        if why:
            self.replays_dropped += 1
            log.warning("dropped a replayed message on %s: %s", where, why)
            return None
        try:
            return pickle.loads(header, buffers=bufs)
        except Exception as e:  # a verified message that fails to load: report, don't crash
            return unloadable(e, header, bufs, where)


def unloadable(e: Exception, header, bufs, where: str):
    """What a verified message that failed to unpickle (``e``) stands for: a reply whose value
    cannot be loaded here fails its call (rather than leave it waiting); anything else is a
    LoadFailure its receiver can answer. Logged, naming ``where`` it came in."""
    log.error("dropped a message on %s that failed to unpickle: %r", where, e)
    partial = _lenient_loads(header, bufs)
    if type(partial) is tuple and len(partial) == 5 and partial[0] == "r":
        from .errors import ActorError

        return partial[:3] + (False, ActorError(
            f"the result could not be unpickled here: {e!r}. Return plain data, or make its "
            "module importable on this side", exc_type=type(e).__name__),)
    return LoadFailure(e, partial)


class LoadFailure:
    """A verified message that could not be unpickled here (e.g. a class this worker
    cannot import). ``partial`` is the message loaded with placeholders for the globals
    that could not be found (None when even that fails), so the receiver can answer the
    sender with this error instead of leaving it waiting."""

    def __init__(self, error: BaseException, partial=None):
        self.error = error
        self.partial = partial


class _Missing:
    """Stands in for a global that cannot be imported here (see _lenient_loads)."""

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        pass


class _LenientUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        try:
            return super().find_class(module, name)
        except Exception:
            return _Missing


class _StubMeta(type):
    def __call__(cls, *args, **kwargs):
        return cls   # calling a stub (a reconstructor) gives the stub type back

    def __getattr__(cls, name):
        return cls

    def __setitem__(cls, key, value):
        pass


class _Stub(metaclass=_StubMeta):
    """Stands in for every global, and for whatever calling or building one returns."""

    def __new__(cls, *args, **kwargs):
        return object.__new__(cls)

    def __getattr__(self, name):
        return _Stub

    def __setstate__(self, state):
        pass

    def __setitem__(self, key, value):
        pass


class _StubUnpickler(pickle.Unpickler):
    """Every global is a _Stub: no user code (a raising __setstate__ or __reduce__) runs."""

    def find_class(self, module, name):
        return _Stub


def _lenient_loads(header, buffers):
    """Load a message that failed to load, with _Missing for what cannot be imported (or,
    when user code raised while loading, for every class), just to learn who to answer.
    Only on the failure path; None if it fails anyway."""
    for unpickler in (_LenientUnpickler, _StubUnpickler):
        try:
            return unpickler(io.BytesIO(header), buffers=buffers).load()
        except Exception:
            continue
    return None


