"""The reference workload (../shared/bench/WORKLOAD.md) against monarch_kernel's actor API.

  python bench/bench_core.py --mode cold --n 4 [--torch]
  python bench/bench_core.py --mode steady --n 4

Prints one JSON line per figure, in the shared record format, so the lines can be read
beside ../shared/bench/baseline_zmq.py's from the same run (bench/compare.py does that).
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import common  # noqa: E402

emit = common.emit
t_imp = time.perf_counter()
from monarch_kernel.actor import Actor, endpoint, this_host  # noqa: E402

IMPORT_S = time.perf_counter() - t_imp


class Bench(Actor):
    def __init__(self):
        self.big = None

    @endpoint
    def noop(self):
        return None

    @endpoint
    def warm_torch(self):
        import torch as _t

        return str(_t.__version__)

    @endpoint
    def tsum(self, t):
        return float(t.sum())

    @endpoint
    def make_big(self, numel):
        import torch

        self.big = torch.ones(numel, dtype=torch.float32)

    @endpoint
    def get_big(self):
        return self.big


def cold(n: int, with_torch: bool) -> None:
    t0 = time.perf_counter()
    host = this_host()
    t_agent = time.perf_counter() - t0
    procs = host.spawn_procs(per_host={"gpus": n})
    t_procs = time.perf_counter() - t0
    actors = procs.spawn("bench", Bench)
    (actors.warm_torch if with_torch else actors.noop).call().get()
    dt = time.perf_counter() - t0
    emit(common.cold_metric(with_torch), round(dt, 4), "s", n=n, import_s=round(IMPORT_S, 3),
         agent_up_s=round(t_agent, 3), procs_up_s=round(t_procs, 3))
    common.cold_footprint(n, with_torch)
    t1 = time.perf_counter()
    more = host.spawn_procs(per_host={"gpus": n}, name="second")
    more.spawn("bench2", Bench).noop.call().get()
    emit("second_spawn_procs_s", round(time.perf_counter() - t1, 4), "s", n=n)
    t1 = time.perf_counter()
    host.shutdown()
    emit("shutdown_s", round(time.perf_counter() - t1, 4), "s", n=n)


def steady(n: int) -> None:
    import torch

    host = this_host()
    procs = host.spawn_procs(per_host={"gpus": n})
    actors = procs.spawn("bench", Bench)
    one = actors.slice(gpus=0)
    try:
        actors.noop.call().get()
        common.emit_footprint(n)
        for _ in range(common.LAT_WARMUP):
            one.noop.call_one().get()
        samples = []
        for _ in range(common.LAT_ITERS):
            t0 = time.perf_counter()
            one.noop.call_one().get()
            samples.append(time.perf_counter() - t0)
        common.emit_latency("rt_one", samples, n=n)

        for _ in range(common.BCAST_WARMUP):
            actors.noop.call().get()
        samples = []
        t_all = time.perf_counter()
        for _ in range(common.BCAST_ITERS):
            t0 = time.perf_counter()
            actors.noop.call().get()
            samples.append(time.perf_counter() - t0)
        t_all = time.perf_counter() - t_all
        common.emit_latency("bcast", samples, n=n)
        emit("bcast_ops_per_s", round(common.BCAST_ITERS / t_all, 1), "ops/s", n=n)
        emit("bcast_actor_calls_per_s", round(n * common.BCAST_ITERS / t_all, 1), "calls/s", n=n)

        ep = one.noop

        def pipe(k):
            futs = [ep.call_one() for _ in range(k)]
            for f in futs:
                f.get()

        pipe(common.PIPE_WARMUP)
        dt = common.timed(lambda: pipe(common.PIPE_CALLS))
        emit("pipelined_calls_per_s", round(common.PIPE_CALLS / dt, 1), "calls/s", n=n,
             calls=common.PIPE_CALLS)

        t = torch.ones(common.PAYLOAD_NUMEL, dtype=torch.float32)
        for _ in range(common.PAYLOAD_WARMUP):
            one.tsum.call_one(t).get()
        samples = []
        for _ in range(common.PAYLOAD_ITERS):
            t0 = time.perf_counter()
            s = one.tsum.call_one(t).get()
            samples.append(time.perf_counter() - t0)
        assert s == float(common.PAYLOAD_NUMEL), s
        common.emit_payload("send64MiB", samples, n=n)

        one.make_big.call_one(common.PAYLOAD_NUMEL).get()
        for _ in range(common.PAYLOAD_WARMUP):
            one.get_big.call_one().get()
        samples = []
        for _ in range(common.PAYLOAD_ITERS):
            t0 = time.perf_counter()
            r = one.get_big.call_one().get()
            samples.append(time.perf_counter() - t0)
        assert r.numel() == common.PAYLOAD_NUMEL
        common.emit_payload("recv64MiB", samples, n=n)
    finally:
        host.shutdown()


def main():
    a = common.parse_args()
    if a.mode == "cold":
        cold(a.n, a.torch)
    else:
        steady(a.n)
    report_leftovers()


def report_leftovers(grace_s: float = 5.0) -> None:
    """Our own descendants still alive after shutdown (the shared reap_leftovers also counts,
    and kills, every process of this venv, which would hit unrelated work on the machine)."""
    left = common.own_descendants()
    emit("procs_alive_right_after_shutdown", len(left), "count", pids=left)
    deadline = time.time() + grace_s
    while left and time.time() < deadline:
        time.sleep(0.1)
        left = common.own_descendants()
    emit("procs_alive_after_grace", len(left), "count", pids=left)


if __name__ == "__main__":
    main()
