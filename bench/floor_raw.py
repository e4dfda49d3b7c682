"""The floor of a call to all N Python processes on this machine, with no framework at all.

    .venv/bin/python bench/floor_raw.py [--n 64,256] [--calls 200] [--modes recv,poll]

N forked Python processes, each on one end of an ``AF_UNIX SOCK_SEQPACKET`` socketpair to
this parent (the fan link's kind of socket, node/fanlink.py). A call to all: the parent
sends one pickled ("call", id, args) to each, each child unpickles it, runs a no-op and
sends its pickled reply, and the parent reads the N replies through one epoll. Modes, for
the child's wait: ``recv`` (a blocking recv on its socket: the least a Python process can
do) and ``poll`` (a poll(2) over its socket and a zmq PULL socket's ZMQ_FD, as our procs
wait on their fan link and work inbox). No signing, no ordering, no failure tracking, no
telemetry, no agent: what is left of a call to all 256 when all of that is gone, so our
figure can be read against it (issue 11: call to all 256 <= 10 ms on 2 cores).
Prints JSON lines: p50, the CPU per call of the children (per child, from
/proc/PID/schedstat) and of the parent.
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import select
import shutil
import socket
import statistics
import tempfile
import time


def _child(sock: socket.socket, mode: str, ipc: str) -> None:
    wait = None
    if mode == "poll":
        import zmq
        z = zmq.Context().socket(zmq.PULL)
        z.bind(ipc)
        p = select.poll()
        p.register(sock.fileno(), select.POLLIN)
        p.register(z.getsockopt(zmq.FD), select.POLLIN)
        wait = p.poll
    loads, dumps, recv, send = pickle.loads, pickle.dumps, sock.recv, sock.send
    while True:
        if wait is not None:
            wait()
        m = recv(65536)
        if not m:
            os._exit(0)
        _, cid, args = loads(m)
        send(dumps(("r", cid, None), 5))


def _cpu_us(pids: list[int]) -> float:
    t = 0
    for p in pids:
        with open(f"/proc/{p}/schedstat") as f:
            t += int(f.read().split()[0])
    return t / 1e3


def run(n: int, calls: int, mode: str) -> dict:
    tmp = tempfile.mkdtemp(prefix="mk-floor-")
    socks, pids = [], []
    try:
        for i in range(n):
            a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            pid = os.fork()
            if pid == 0:   # (the child never returns)
                try:
                    a.close()
                    for s in socks:
                        s.close()
                    _child(b, mode, f"ipc://{tmp}/{i}")
                finally:
                    os._exit(0)
            b.close()
            socks.append(a)
            pids.append(pid)
        ep = select.epoll()
        byfd = {s.fileno(): s for s in socks}
        for fd in byfd:
            ep.register(fd, select.EPOLLIN)

        def call_all(cid: int) -> None:
            msg = pickle.dumps(("call", cid, ()), 5)
            for s in socks:
                s.send(msg)
            got = 0
            while got < n:
                for fd, _ in ep.poll():
                    byfd[fd].recv(65536)
                    got += 1

        for i in range(20):
            call_all(i)
        lat = []
        c0, p0 = _cpu_us(pids), time.process_time()
        for i in range(calls):
            t = time.perf_counter()
            call_all(i)
            lat.append(time.perf_counter() - t)
        c1, p1 = _cpu_us(pids), time.process_time()
        return {"what": "floor_call_all", "mode": mode, "n": n, "p50_ms": round(statistics.median(lat) * 1e3, 2),
                "child_cpu_us_per_child": round((c1 - c0) / calls / n, 1),
                "parent_cpu_ms": round((p1 - p0) / calls * 1e3, 2), "load": round(os.getloadavg()[0], 1)}
    finally:
        for s in socks:
            s.close()
        for p in pids:
            os.waitpid(p, 0)
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", default="64,256")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--modes", default="recv,poll")
    a = ap.parse_args()
    print(json.dumps({"what": "machine", "cores": os.cpu_count(), "load": os.getloadavg()}), flush=True)
    for n in (int(x) for x in a.n.split(",")):
        for mode in a.modes.split(","):
            print(json.dumps(run(n, a.calls, mode)), flush=True)


if __name__ == "__main__":
    main()
