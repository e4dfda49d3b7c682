"""The CPU and the wall time it takes to spawn N procs on this host, by process role and by
phase (wall time is noise on a shared 2-core machine; CPU time is what a quiet one would
wait for).

    .venv/bin/python bench/spawn_cpu.py [--n 256] [--rounds 1]

The zygote is warmed first (a spawn of 1 proc, stopped), as in ``bench_scale.py``, where the
spawn of 256 follows those of smaller meshes. Then, per round, three phases: ``spawn_procs``
(forked and ready), the actor spawned on each, the first call to all answered. For each
phase: its wall time, and the CPU the controller (process time), the agent, the zygote and
the procs spent in it, read from /proc/PID/task/*/schedstat. JSON lines.
"""
from __future__ import annotations

import argparse
import json
import os
import time

from _home import private_dir

private_dir("MONARCH_KERNEL_HOME", "mk-bench-spawn-")
os.environ.setdefault("MONARCH_KERNEL_HOST_TIMEOUT_S", "30")   # shared machine: see scale_profile.py

import psutil  # noqa: E402

from monarch_kernel.actor import Actor, endpoint, this_host  # noqa: E402


class Noop(Actor):
    @endpoint
    def noop(self):
        return None


def cpu_ms(pid: int) -> float:
    ns = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                ns += int(f.read().split()[0])
        except OSError:
            pass
    return ns / 1e6


def minflt(pid: int) -> int:
    """Minor page faults of ``pid`` (all threads): after a fork, mostly copy-on-write copies."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[7])
    except OSError:
        return 0


def roles() -> dict[str, list[int]]:
    out: dict[str, list[int]] = {"agent": [], "zygote": [], "procs": []}
    me = os.getpid()
    for c in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(c.cmdline())
            parent = c.ppid()
        except psutil.Error:
            continue
        if "agent" in cmd:
            out["agent"].append(c.pid)
        elif parent != me and psutil.Process(parent).ppid() == me:
            out["zygote"].append(c.pid)
        else:
            out["procs"].append(c.pid)
    return out


def snapshot(pids: dict[str, list[int]]) -> dict[str, float]:
    out = {role: sum(cpu_ms(p) for p in ps) for role, ps in pids.items()}
    out["controller"] = time.process_time() * 1e3
    out["faults"] = sum(minflt(p) for p in pids["procs"])
    return out


def spawn_once(host, n: int, name: str) -> None:
    base = roles()   # agent and zygote; no procs yet
    before = snapshot(base)
    t0 = time.perf_counter()
    procs = host.spawn_procs(per_host={"gpus": n}, name=name)
    t1 = time.perf_counter()
    pids = roles()
    at1 = snapshot(pids)
    at1["procs_seen"] = len(pids["procs"])
    actors = procs.spawn("noop", Noop)
    t2 = time.perf_counter()
    at2 = snapshot(pids)
    actors.noop.call().get(600)
    t3 = time.perf_counter()
    at3 = snapshot(pids)
    at0 = dict(before, procs=0.0, faults=0)
    phases = {"spawn_procs": (t1 - t0, at0, at1), "actor": (t2 - t1, at1, at2), "first_call": (t3 - t2, at2, at3)}
    for phase, (wall, a, b) in phases.items():
        print(json.dumps({"what": "spawn_phase", "phase": phase, "n": n, "wall_s": round(wall, 3),
                          **{f"{k}_ms": round(b[k] - a[k], 1) for k in ("controller", "agent", "zygote", "procs")},
                          "proc_faults_each": round((b["faults"] - a["faults"]) / max(1, n)),
                          "load": round(os.getloadavg()[0], 1)}), flush=True)
    cpu = {k: at3[k] - at0[k] for k in ("controller", "agent", "zygote", "procs")}
    print(json.dumps({"what": "spawn_cpu_ms", "n": n, "wall_s": round(t3 - t0, 2),
                      **{k: round(v, 1) for k, v in cpu.items()}, "total": round(sum(cpu.values()), 1),
                      "proc_ms_each": round(cpu["procs"] / max(1, n), 2), "load": round(os.getloadavg()[0], 1)}),
          flush=True)
    procs.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=1)
    a = ap.parse_args()
    load0 = os.getloadavg()[0]
    c0, t0 = time.process_time(), time.perf_counter()
    host = this_host()
    try:
        warm = host.spawn_procs(per_host={"gpus": 1}, name="warm")   # the zygote has imported torch
        warm.stop()
        print(json.dumps({"what": "host_and_warm_zygote", "wall_s": round(time.perf_counter() - t0, 2),
                          "controller_ms": round((time.process_time() - c0) * 1e3, 1), "load_at_start": load0}),
              flush=True)
        time.sleep(0.5)   # the warm-up proc is reaped
        for r in range(a.rounds):
            spawn_once(host, a.n, f"spawncpu{r}")
            time.sleep(1.0)
    finally:
        host.shutdown()


if __name__ == "__main__":
    main()
