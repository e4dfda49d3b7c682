"""CPU time per pipelined call, ours and the bare baseline, alternating in one run.

  python bench/cpu_per_call.py [--rounds 5] [--calls 10000] [--only ours|base]

Wall-clock throughput on a shared 2-core machine moves with everyone else's load; the CPU
each process spends on a call moves much less. For each round: 10,000 pipelined no-op
``call_one`` futures (issue all, then get all, as bench_core.py's "pipelined"), then the
baseline's (../shared/bench/baseline_zmq.py's Mesh, the same workload). Prints, per system,
the controller's CPU per call (all its threads, and per thread for ours), the proc's CPU
per call and calls/s; the medians at the end. Run with
PYTHONPATH=<repo>:<../shared/bench>.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import psutil


def _threads_cpu() -> dict[str, float]:
    """name -> CPU seconds of this process's threads (from /proc, one file per thread)."""
    import threading

    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                s = f.read()
        except OSError:
            continue
        name = names.get(int(tid)) or s[s.index("(") + 1:s.rindex(")")]
        fields = s[s.rindex(")") + 2:].split()
        cpu = (int(fields[11]) + int(fields[12])) / tick
        out[name] = out.get(name, 0.0) + cpu
    return out


def _proc_cpu(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def _measure(pipe, pids, calls: int) -> dict:
    pipe(1000)   # warm-up
    th0, p0 = _threads_cpu(), [_proc_cpu(p) for p in pids]
    c0 = time.process_time()
    t0 = time.perf_counter()
    pipe(calls)
    dt = time.perf_counter() - t0
    c1 = time.process_time()
    th1, p1 = _threads_cpu(), [_proc_cpu(p) for p in pids]
    per = {k: round((th1[k] - th0.get(k, 0.0)) / calls * 1e6, 1) for k in th1 if th1[k] - th0.get(k, 0.0) > 0}
    return {"calls_per_s": round(calls / dt), "ctl_us": round((c1 - c0) / calls * 1e6, 1),
            "proc_us": round(sum(b - a for a, b in zip(p0, p1)) / calls * 1e6, 1), "threads": per}


def ours(calls: int, rounds: int, out: list) -> None:
    from monarch_kernel.actor import Actor, endpoint, this_host

    class Bench(Actor):
        @endpoint
        def noop(self):
            return None

        @endpoint
        def where(self):
            import monarch_kernel

            return monarch_kernel.__file__

    host = this_host()
    procs = host.spawn_procs(per_host={"gpus": 4})
    actors = procs.spawn("bench", Bench)
    one = actors.slice(gpus=0)
    actors.noop.call().get()
    import monarch_kernel

    print("ours from", monarch_kernel.__file__, "proc from", one.where.call_one().get(), flush=True)
    ep = one.noop
    pid = ep._mesh._state.proc_state.procs[ep._mesh._view.ranks[0]].pid

    def pipe(k):
        futs = [ep.call_one() for _ in range(k)]
        for f in futs:
            f.get()

    try:
        for _ in range(rounds):
            out.append(_measure(pipe, [pid], calls))
            yield
    finally:
        host.shutdown()


def base(calls: int, rounds: int, out: list) -> None:
    import baseline_zmq

    m = baseline_zmq.Mesh(4, "ipc")
    m.call_all("noop")

    def pipe(k):
        for _ in range(k):
            m.send(0, "noop")
        for _ in range(k):
            m.recv_one()

    try:
        for _ in range(rounds):
            out.append(_measure(pipe, [m.procs[0].pid], calls))
            yield
    finally:
        m.stop()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=10_000)
    p.add_argument("--only", choices=["ours", "base"])
    a = p.parse_args()
    res: dict[str, list] = {"ours": [], "base": []}
    gens = []
    if a.only != "base":
        gens.append(("ours", ours(a.calls, a.rounds, res["ours"])))
    if a.only != "ours":
        gens.append(("base", base(a.calls, a.rounds, res["base"])))
    print("load", open("/proc/loadavg").read().split()[:3], flush=True)
    for _ in range(a.rounds):
        for name, g in gens:
            next(g)
            r = res[name][-1]
            print(name, r, flush=True)
    for _, g in gens:
        g.close()
    print("load", open("/proc/loadavg").read().split()[:3])
    for name, rs in res.items():
        if rs:
            print(f"MEDIAN {name}: calls/s {statistics.median(r['calls_per_s'] for r in rs):.0f}  "
                  f"controller {statistics.median(r['ctl_us'] for r in rs):.1f} us  "
                  f"proc {statistics.median(r['proc_us'] for r in rs):.1f} us a call")


if __name__ == "__main__":
    sys.exit(main())
