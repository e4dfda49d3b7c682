"""The floor of a call to all N processes on this machine: the shared bare pyzmq baseline.

    PYTHONPATH=../shared/bench .venv/bin/python bench/floor_bcast.py [--n 256] [--calls 200]

Starts N workers of ``baseline_zmq.py`` (the reference workload's bare pyzmq +
cloudpickle actor protocol: one ROUTER, a DEALER per worker, no signing, no threads of
its own) and times its ``call_all("noop")`` the way ``bench/scale_profile.py`` times
ours: p50, and the CPU per call of the controller and of the workers (every thread, from
/proc/PID/task/*/schedstat), so the two can be read side by side in one run.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import baseline_zmq  # the shared baseline (../shared/bench), imported, not copied
from scale_profile import diff, snapshot  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    print(json.dumps({"what": "load_average", "value": os.getloadavg(), "cores": os.cpu_count()}), flush=True)
    t0 = time.perf_counter()
    m = baseline_zmq.Mesh(a.n, "ipc")
    try:
        m.call_all("noop")
        print(json.dumps({"what": "start_s", "value": round(time.perf_counter() - t0, 3), "n": a.n}), flush=True)
        r = {"controller": [os.getpid()], "procs": [p.pid for p in m.procs]}
        for _ in range(20):
            m.call_all("noop")
        time.sleep(0.5)
        s0 = snapshot(r)
        time.sleep(2)
        print(json.dumps({"what": "idle_per_s", "n": a.n, **diff(s0, snapshot(r), 2)}), flush=True)
        for rnd in range(a.rounds):
            lat = []
            s0, c0, w0 = snapshot(r), time.process_time(), time.perf_counter()
            for _ in range(a.calls):
                t = time.perf_counter()
                m.call_all("noop")
                lat.append(time.perf_counter() - t)
            wall = time.perf_counter() - w0
            c1 = time.process_time()
            d = diff(s0, snapshot(r), a.calls)
            lat.sort()
            print(json.dumps({"what": "per_call", "mode": "bare-zmq", "round": rnd, "n": a.n,
                              "p50_ms": round(lat[len(lat) // 2] * 1e3, 2), "mean_ms": round(wall / a.calls * 1e3, 2),
                              "controller_process_time_ms": round((c1 - c0) / a.calls * 1e3, 3),
                              "floor_ms_on_cores": round(d["total_cpu_us"] / 1e3 / os.cpu_count(), 2),
                              "load": round(os.getloadavg()[0], 1), **d}), flush=True)
    finally:
        m.stop()


if __name__ == "__main__":
    main()
