"""Monarch's API paths next to the plain call, in one run (JSON lines, shared record format).

  python bench/bench_monarch_api.py [--n 2] [--iters 300]

* spawn: time for ``spawn()`` to return (Monarch's: at once) and to ``initialized``, with an
  ``__init__`` that sleeps 0.2 s, so the difference is what a caller no longer waits for.
* round trips on one member, same mesh, interleaved: ``call_one`` (the baseline), an
  ``explicit_response_port`` endpoint answering through its Port, and a value sent by the
  actor to a controller-side ``Channel`` (``send(..., port=)`` then ``recv()``).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import common  # noqa: E402

from monarch_kernel.actor import Actor, Channel, Port, endpoint, send, this_host  # noqa: E402

emit = common.emit


class Echo(Actor):
    def __init__(self, init_s: float = 0.0):
        time.sleep(init_s)

    @endpoint
    def echo(self, x):
        return x

    @endpoint(explicit_response_port=True)
    def echo_port(self, port: Port, x) -> None:
        port.send(x)


def _median_ms(samples) -> float:
    return round(common.pct(samples, 50) * 1000, 3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2)
    ap.add_argument("--iters", type=int, default=300)
    a = ap.parse_args()
    procs = this_host().spawn_procs(per_host={"gpus": a.n})
    try:
        t0 = time.perf_counter()
        slow = procs.spawn("slow", Echo, 0.2)
        returned = time.perf_counter() - t0
        slow.initialized.get(60)
        ready = time.perf_counter() - t0
        emit("spawn_returns_s", round(returned, 4), "s", n=a.n, init_s=0.2)
        emit("spawn_initialized_s", round(ready, 4), "s", n=a.n, init_s=0.2)

        one = procs.spawn("echo", Echo).slice(gpus=0)
        port, recv = Channel.open()
        for _ in range(30):
            one.echo.call_one(1).get()
            one.echo_port.call_one(1).get()
        call, explicit, channel = [], [], []
        for _ in range(a.iters):   # interleaved: the three see the same machine load
            t = time.perf_counter()
            one.echo.call_one(1).get()
            call.append(time.perf_counter() - t)
            t = time.perf_counter()
            one.echo_port.call_one(1).get()
            explicit.append(time.perf_counter() - t)
            t = time.perf_counter()
            send(one.echo, (1,), {}, port=port)
            recv.recv().get()
            channel.append(time.perf_counter() - t)
        base = _median_ms(call)
        emit("rt_call_one_p50_ms", base, "ms", n=a.n, iters=a.iters)
        for name, s in (("rt_explicit_port_p50_ms", explicit), ("rt_send_to_channel_p50_ms", channel)):
            emit(name, _median_ms(s), "ms", n=a.n, iters=a.iters, ratio_to_call_one=round(_median_ms(s) / base, 2))
    finally:
        procs.stop()


if __name__ == "__main__":
    main()
