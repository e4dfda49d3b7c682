"""A peer without the mesh key, speaking raw ZMTP 3 to a tcp endpoint (tests/test_core_strangers.py).

It greets with the mechanism the endpoint asks for. NULL: it completes the handshake
(READY, as a PUSH socket) and is then a connected zmq peer. CURVE: it cannot (no key), so
it sends its frame as the first handshake command, which zmq reads whole before it can
refuse it. Usage:
  stranger.py HOST PORT frame MIB   a frame of MIB MiB, all but its last byte; prints
                                    "held" (or "dropped after N MiB") and waits for stdin
  stranger.py HOST PORT idle N      N connections that greet and then idle; prints
                                    "connected" and waits for stdin
  stranger.py HOST PORT parts N     one message of N parts of 60,000 bytes, never finished
                                    (zmq caps a frame, not a message); prints "held" or
                                    "dropped after N parts" and waits for stdin
"""
from __future__ import annotations

import socket
import struct
import sys


def greet(host: str, port: int) -> tuple[socket.socket, str]:
    s = socket.create_connection((host, port))
    s.sendall(b"\xff" + b"\0" * 8 + b"\x7f\x03")       # signature, major version
    theirs = b""
    while len(theirs) < 64:   # zmq sends the rest of its greeting once it saw our version
        got = s.recv(64 - len(theirs))
        if not got:
            raise SystemExit("closed during the greeting")
        theirs += got
    mechanism = theirs[12:32].rstrip(b"\0").decode()
    s.sendall(b"\0" + mechanism.encode().ljust(20, b"\0") + b"\0" + b"\0" * 31)
    if mechanism == "NULL":
        body = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 4) + b"PUSH"
        s.sendall(bytes([0x04, len(body)]) + body)   # short command
    return s, mechanism


def main() -> None:
    host, port, what, n = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    if what == "idle":
        socks = [greet(host, port)[0] for _ in range(n)]
        print("connected", flush=True)
        sys.stdin.read()
        for s in socks:
            s.close()
        return
    s, mechanism = greet(host, port)
    if what == "parts":
        body = b"x" * 60_000
        head = bytes([0x07 if mechanism != "NULL" else 0x03]) + struct.pack(">Q", len(body))   # long + MORE
        sent = 0
        try:
            while sent < n:
                s.sendall(head + body)
                sent += 1
            print("held", flush=True)
        except OSError:
            print(f"dropped after {sent} parts", flush=True)
        sys.stdin.read()
        s.close()
        return
    size = n << 20
    flags = 0x06 if mechanism != "NULL" else 0x02   # long command (a handshake) / long message
    chunk = b"x" * (1 << 20)
    sent = 0
    try:
        s.sendall(bytes([flags]) + struct.pack(">Q", size))
        while sent < size - 1:
            k = min(len(chunk), size - 1 - sent)
            s.sendall(chunk[:k])
            sent += k
        print("held", flush=True)
    except OSError:
        print(f"dropped after {sent >> 20} MiB", flush=True)
    sys.stdin.read()
    s.close()


if __name__ == "__main__":
    main()
