"""CurveZMQ on tcp links that leave the host; the MAC path alone on ipc and loopback.

Every message is MAC'd with the mesh key (wire.py) on every link. A tcp endpoint bound on
an address other than loopback is, in addition, a CURVE server: the link is encrypted, and
a peer that does not know the server's public key fails the handshake before it can send
a single message. Who knows which key:
  * host agents: a keypair derived from the mesh key (``agent_keys``), so a controller or
    proc holding the key can reach them with nothing else;
  * controllers and procs: one random keypair per process; its public half travels with
    the address itself (``tcp://host:port?curve=HEX``, see ``with_key``), so whoever learns
    where to reply (a call's reply_to, a ProcRef, a contact) learns the key with it, inside
    MAC'd messages. Loopback addresses carry no key and look as before.
``MONARCH_KERNEL_CURVE``: ``auto`` (default: CURVE when the bind address is not loopback),
``always`` (loopback too: tests and the benchmark), ``never``.
"""
from __future__ import annotations

import hashlib
import os

import zmq
from zmq.utils import z85

MODE = os.environ.get("MONARCH_KERNEL_CURVE", "auto").lower()
_LOOPBACK = ("127.", "localhost", "::1", "[::1]")


def _host(addr_or_host: str) -> str:
    h = addr_or_host.split("://", 1)[-1]
    if ":" in h and not h.startswith("["):
        h = h.rsplit(":", 1)[0]
    return h.strip("[]")


def wanted(addr_or_host: str) -> bool:
    """Is a tcp endpoint on this address (bind host, or a peer's address) a CURVE one?"""
    if MODE == "never" or addr_or_host.startswith(("ipc://", "inproc://")):
        return False
    if MODE == "always":
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


def bind(sock: zmq.Socket, endpoint: str, secret: bytes | None) -> str:
    """Bind ``endpoint``; a CURVE server endpoint when ``secret`` is given (later binds of
    the same socket are plain again: zmq takes the options at bind time)."""
    if secret is None:
        sock.bind(endpoint)
    else:
        sock.curve_secretkey = secret
        sock.curve_server = True
        try:
            sock.bind(endpoint)
        finally:
            sock.curve_server = False
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
    appear later are not bound.) Returns the first endpoint bound."""
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
