"""The CPU it takes to spawn N procs on this host, by process role (wall time is noise on a
shared 2-core machine; CPU time is what a quiet one would wait for).

    .venv/bin/python bench/spawn_cpu.py [--n 256]

From ``this_host()`` to the first call to all answered: the controller's CPU (process
time), and for the agent, the zygote and every proc, its whole life's CPU (they were all
born in that window), read from /proc/PID/task/*/schedstat. JSON lines.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

os.environ.setdefault("MONARCH_KERNEL_HOME", tempfile.mkdtemp(prefix="mk-bench-spawn-"))
os.environ.setdefault("MONARCH_KERNEL_HOST_TIMEOUT_S", "30")   # shared machine: see scale_profile.py

import psutil  # noqa: E402

from monarch_kernel.actor import Actor, endpoint, this_host  # noqa: E402


class Noop(Actor):
    @endpoint
    def noop(self):
        return None


def cpu_ms(pid: int) -> float:
    ns = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                ns += int(f.read().split()[0])
        except OSError:
            pass
    return ns / 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=256)
    a = ap.parse_args()
    os.environ.setdefault("MONARCH_KERNEL_MAX_PROCS", str(max(64, a.n)))
    os.environ.setdefault("MONARCH_KERNEL_PROC_MEM_MB", "40")
    load0 = os.getloadavg()[0]
    c0, t0 = time.process_time(), time.perf_counter()
    host = this_host()
    try:
        procs = host.spawn_procs(per_host={"gpus": a.n}, name="spawncpu")
        actors = procs.spawn("noop", Noop)
        actors.noop.call().get(600)
        wall, ctl = time.perf_counter() - t0, (time.process_time() - c0) * 1e3
        out = {"controller": ctl, "agent": 0.0, "zygote": 0.0, "procs": 0.0}
        kids = psutil.Process().children(recursive=True)
        for c in kids:
            cmd = " ".join(c.cmdline())
            role = "agent" if "agent" in cmd else "zygote" if c.ppid() != os.getpid() and \
                psutil.Process(c.ppid()).ppid() == os.getpid() else "procs"
            out[role] += cpu_ms(c.pid)
        print(json.dumps({"what": "spawn_cpu_ms", "n": a.n, "wall_s": round(wall, 2),
                          **{k: round(v, 1) for k, v in out.items()}, "total": round(sum(out.values()), 1),
                          "load_at_start": round(load0, 1), "load_at_end": round(os.getloadavg()[0], 1)}), flush=True)
        procs.stop()
    finally:
        host.shutdown()


if __name__ == "__main__":
    main()
