"""CurveZMQ on every tcp link; the MAC path alone on ipc (a directory only this user enters).

Every message is MAC'd with the mesh key (wire.py) on every link. Every tcp endpoint, on
loopback too, is in addition a CURVE server: the link is encrypted, and a peer that does
not know the server's public key fails the handshake before it can send a single message
(and is dropped after HANDSHAKE_IVL if it idles). Before that handshake, zmq still reads
whole frames: a tcp endpoint that faces strangers caps them at MAX_FRAME (``bind``), and
senders cut larger frames in pieces (``chunked``). Who knows which key:
  * host agents: a keypair derived from the mesh key (``agent_keys``), so a controller or
    proc holding the key can reach them with nothing else;
  * controllers and procs: one random keypair per process; its public half travels with
    the address itself (``tcp://host:port?curve=HEX``, see ``with_key``), so whoever learns
    where to reply (a call's reply_to, a ProcRef, a contact) learns the key with it, inside
    MAC'd messages.
The server keys are not published anywhere else: a peer outside the mesh has none.
``MONARCH_KERNEL_CURVE``: ``auto`` (default: every tcp endpoint; ``always`` is the same),
``remote`` (only endpoints not on loopback: the MAC alone on loopback, as before), ``never``.
"""
from __future__ import annotations

import hashlib
import os

import zmq
from zmq.utils import z85

MODE = os.environ.get("MONARCH_KERNEL_CURVE", "auto").lower()
_LOOPBACK = ("127.", "localhost", "::1", "[::1]")
# The largest frame a tcp endpoint of a proc or controller reads (before any handshake or
# MAC: zmq allocates a frame as its size arrives). Senders cut larger ones (``chunked``).
MAX_FRAME = 4 << 20


def _host(addr_or_host: str) -> str:
    h = addr_or_host.split("://", 1)[-1]
    if ":" in h and not h.startswith("["):
        h = h.rsplit(":", 1)[0]
    return h.strip("[]")


def wanted(addr_or_host: str) -> bool:
    """Is a tcp endpoint on this address (bind host, or a peer's address) a CURVE one?"""
    if MODE == "never" or addr_or_host.startswith(("ipc://", "inproc://")):
        return False
    if MODE != "remote":
        return True
    return not _host(addr_or_host).startswith(_LOOPBACK)


def agent_keys(mesh_key: bytes) -> tuple[bytes, bytes]:
    """(public, secret), Z85: the CURVE keypair of every host agent of the mesh."""
    raw = hashlib.blake2b(mesh_key, digest_size=32, person=b"mk-curve-agent").digest()
    secret = z85.encode(raw)
    return zmq.curve_public(secret), secret


_PROCESS_KEYS: dict[int, tuple[bytes, bytes]] = {}


def process_keys() -> tuple[bytes, bytes]:
    """(public, secret) of this process (a forked child makes its own)."""
    keys = _PROCESS_KEYS.get(os.getpid())
    if keys is None:
        keys = _PROCESS_KEYS[os.getpid()] = zmq.curve_keypair()
    return keys


def bind(sock: zmq.Socket, endpoint: str, secret: bytes | None, max_frame: int = 0) -> str:
    """Bind ``endpoint``; a CURVE server endpoint when ``secret`` is given, whose frames are
    capped at ``max_frame`` bytes when given (later binds of the same socket, e.g. its ipc
    endpoint, are plain and uncapped again: zmq takes the options at bind time)."""
    if secret is None and not max_frame:
        sock.bind(endpoint)
    else:
        if secret is not None:
            sock.curve_secretkey = secret
            sock.curve_server = True
        if max_frame:
            before = sock.getsockopt(zmq.MAXMSGSIZE)
            sock.setsockopt(zmq.MAXMSGSIZE, max_frame + 4096)   # + CURVE's box and command header
        try:
            sock.bind(endpoint)
        finally:
            sock.curve_server = False
            if max_frame:
                sock.setsockopt(zmq.MAXMSGSIZE, before)
    return sock.getsockopt(zmq.LAST_ENDPOINT).decode()


def with_key(endpoint: str, public: bytes | str) -> str:
    """``endpoint`` with its server's public key attached (nothing when there is none)."""
    if not public:
        return endpoint
    raw = z85.decode(public.encode() if isinstance(public, str) else public)
    return f"{endpoint}?curve={raw.hex()}"


def connect(sock: zmq.Socket, endpoint: str, server_public: bytes | str | None = None) -> None:
    """Connect ``endpoint``, as a CURVE client of ``server_public`` or of the key the
    address carries (``with_key``)."""
    endpoint, _, attached = endpoint.partition("?curve=")
    if attached:
        server_public = z85.encode(bytes.fromhex(attached))
    if server_public:
        pub, sec = process_keys()
        sock.curve_serverkey = server_public.encode() if isinstance(server_public, str) else server_public
        sock.curve_publickey = pub
        sock.curve_secretkey = sec
    sock.connect(endpoint)


def bind_every_interface(sock: zmq.Socket, port: int | str, secret: bytes | None) -> str:
    """Bind on every IPv4 address of this host at one port, each endpoint in the mode a peer
    dialling that address expects (``wanted``): loopback plain (MAC only), the others CURVE
    when ``secret`` is given. A wildcard bind (0.0.0.0) would be CURVE on loopback too, and a
    peer on this host reaching it through 127.0.0.1 would fail the handshake. (Addresses that
    appear later are not bound.) Returns the first endpoint bound. When every tcp endpoint is
    CURVE (the default), this is one wildcard bind."""
    if MODE != "remote":
        return bind(sock, f"tcp://0.0.0.0:{port}", secret if wanted("0.0.0.0") else None)
    import socket

    import psutil

    hosts = sorted({a.address for addrs in psutil.net_if_addrs().values() for a in addrs
                    if a.family == socket.AF_INET} | {"127.0.0.1"}, key=lambda h: not h.startswith("127."))
    for attempt in range(5):
        first = ""
        bound = []
        try:
            for host in hosts:
                ep = bind(sock, f"tcp://{host}:{port if first == '' else first.rsplit(':', 1)[1]}",
                          secret if wanted(host) else None)
                bound.append(ep)
                first = first or ep
            return first
        except zmq.ZMQError:
            for ep in bound:
                sock.unbind(ep)
            if str(port) not in ("0", "*") or attempt == 4:
                raise
    raise AssertionError("unreachable")


# --------------------------------------------------------------------- large frames over tcp
CHUNKED = b"\xffMKchunk"   # first frame of a message whose large frames travel in pieces
# The counts start at wire's _PREFIX (asserted there), after pickle's NEXT_BUFFER byte: a
# first frame like that is one wire.recv_message reads more frames after (its fast path).
CHUNK_HEAD = 56
_CHUNK_FIRST = CHUNKED + bytes(CHUNK_HEAD - len(CHUNKED)) + b"\x97"


def chunked(frames: list) -> list:
    """``frames`` for a tcp link: any frame over MAX_FRAME is sent as pieces of that
    size, after a first frame that says how many pieces each original frame has (the
    receiver joins them, wire.recv_message). Frames that fit are sent as they are."""
    limit = MAX_FRAME
    if all((f.nbytes if type(f) is memoryview else len(f)) <= limit for f in frames):
        return frames
    counts, out = [], []
    for f in frames:
        mv = memoryview(f).cast("B")
        n = max(1, -(-mv.nbytes // limit))
        counts.append(n)
        out += [mv[i * limit:(i + 1) * limit] for i in range(n)]
    return [_CHUNK_FIRST + b"".join(c.to_bytes(4, "little") for c in counts), *out]


def joined(frames: list) -> list:
    """The frames as sent, from what ``chunked`` made of them (unchanged otherwise)."""
    first = frames[0]
    first = first.buffer if hasattr(first, "buffer") else first   # a zmq.Frame
    if len(first) < 8 or bytes(first[:8]) != CHUNKED:
        return frames
    head = bytes(first)
    counts = [int.from_bytes(head[i:i + 4], "little") for i in range(len(_CHUNK_FIRST), len(head) - 3, 4)]
    if not counts or 0 in counts or sum(counts) != len(frames) - 1:
        return frames[1:] or [b""]   # malformed: the MAC check drops it
    out, i = [], 1
    for n in counts:
        parts = [f.buffer if hasattr(f, "buffer") else f for f in frames[i:i + n]]
        i += n
        if n == 1:
            out.append(parts[0])
            continue
        import numpy as np  # its copy is 4-5x quicker here than bytearray's (no zero-fill)

        buf, at = np.empty(sum(p.nbytes if type(p) is memoryview else len(p) for p in parts), np.uint8), 0
        for p in parts:
            k = p.nbytes if type(p) is memoryview else len(p)
            buf[at:at + k] = np.frombuffer(p, np.uint8)
            at += k
        out.append(memoryview(buf))   # writable: a tensor is rebuilt on it without another copy
    if out and type(out[0]) is not bytes:
        out[0] = bytes(out[0])
    return out
