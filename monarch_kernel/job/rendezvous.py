"""Where a job's agents report in: a signed PULL socket on the controller.

Each node (``job/node.py``) pushes one JSON report, its HMAC under the job's key beside
it; reports with a wrong signature or another job's token are dropped. Reports carry no
secret, only where an agent listens, so the key never crosses the network. The socket is a
CURVE server with the keypair both ends derive from the job's key (core/curve.py): a peer
without the key fails the handshake, so it cannot make the kernel buffer a multipart
message (zmq's frame cap is per frame) or hold a connection open.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import socket
import time

from monarch_kernel import config

log = logging.getLogger("monarch_kernel.job")


def route_ip(target: str) -> str:
    """The local address the kernel would use to reach ``target`` (no packet is sent)."""
    try:
        target = socket.gethostbyname(target)
    except OSError:
        pass
    if target.startswith("127."):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((target, 9))
        except OSError as e:
            raise OSError(f"no route from this machine to {target}: {e}; set MONARCH_KERNEL_BIND to the "
                          "local address the job's hosts can reach") from None
        return s.getsockname()[0]


def local_address_error(addr: str) -> OSError | None:
    """None if ``addr`` is one of this machine's addresses (something can listen on it)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((socket.gethostbyname(addr), 0))
    except OSError as e:
        return e
    return None


def controller_ip(towards: str) -> str:
    """The address the controller listens on for a job whose hosts sit at ``towards``:
    ``MONARCH_KERNEL_BIND`` if set (it must be one of this machine's), else the route's."""
    bind = config.BIND.get()
    if not bind:
        return route_ip(towards)
    e = local_address_error(bind)
    if e is not None:
        from .base import JobError

        try:   # (a launcher that knows no host address yet passes the variable's own value)
            hint = f"{route_ip(towards)} is the one that routes to the job's hosts ({towards}); " \
                if towards != bind else ""
        except OSError:
            hint = ""
        raise JobError(f"{config.BIND.env}={bind} is not an address of this machine ({e.strerror or e}): set it "
                       f"to this machine's address that the job's hosts can reach ({hint}`ip -brief addr` lists "
                       f"them), or unset it to have that one chosen automatically") from None
    return bind


def _sign(key: bytes, body: bytes) -> bytes:
    return hmac.new(key, body, hashlib.sha256).hexdigest().encode()


class Reporter:
    """The node end: connect to the controller's rendezvous now (zmq and the TCP handshake
    cost a little), send one signed report later."""

    def __init__(self, addr: str, key: bytes | None = None, timeout: float = 30.0):
        import zmq  # here, not at the top: a node starts its agent before paying for zmq

        from monarch_kernel.core import curve

        self.sock = zmq.Context.instance().socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, int(timeout * 1000))
        curve.connect(self.sock, addr, curve.agent_keys(key)[0] if key and curve.wanted(addr) else None)

    def send(self, key: bytes, report: dict) -> None:
        body = json.dumps(report).encode()
        self.sock.send_multipart([body, _sign(key, body)])
        self.sock.close()   # lingers until the report is out (or the timeout)


class Rendezvous:
    """The controller end: bind on ``host``, collect the reports of one job (``token``)."""

    def __init__(self, host: str, key: bytes, token: str):
        import zmq

        self.key, self.token = key, token
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, 65536)
        self.sock.setsockopt(zmq.HANDSHAKE_IVL, 5000)
        from monarch_kernel.core import curve

        secret = curve.agent_keys(key)[1] if curve.wanted(host) else None
        self.address = curve.bind(self.sock, f"tcp://{host}:*", secret)

    def poll(self, timeout: float) -> list[dict]:
        """Reports that arrived within ``timeout`` seconds (maybe none)."""
        out = []
        if not self.sock.poll(int(timeout * 1000)):
            return out
        while self.sock.poll(0):
            frames = self.sock.recv_multipart()
            if len(frames) != 2 or not hmac.compare_digest(_sign(self.key, frames[0]), frames[1]):
                log.warning("dropped an unsigned or badly signed report at %s", self.address)
                continue
            try:
                rep = json.loads(frames[0])
            except ValueError:
                continue
            if isinstance(rep, dict) and rep.get("token") == self.token:
                if isinstance(rep.get("t"), dict):
                    rep["t"]["reported"] = time.time()
                out.append(rep)
        return out

    def close(self) -> None:
        self.sock.close(0)
