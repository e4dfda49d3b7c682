"""Where a call to all N procs spends its CPU, per process role (issue 11 at 256 ranks).

    .venv/bin/python bench/scale_profile.py [--n 256] [--calls 200] [--modes fan,dir]

Spawns N procs on this host (one agent), then for each mode (``fan``: through the agent;
``dir``: one send a proc, ``MONARCH_KERNEL_FANOUT_MIN=0``), alternating, makes ``--calls``
calls to all and prints JSON lines: per call, the CPU time (ns, from every thread's
``/proc/PID/task/TID/schedstat``) and the context switches (voluntary + involuntary) of the
controller, the agent, the zygote and the procs (summed, and per proc), plus the same per
second while idle. On a machine with C cores a call to all cannot take less than the
total CPU per call / C: that, not wall time, is the figure a shared machine keeps.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

from _home import private_dir

private_dir("MONARCH_KERNEL_HOME", "mk-bench-prof-")
# Five sessions share this machine's 2 cores (load 20-120): an agent can be silent for
# seconds while 256 procs start or stop; these figures are not about host loss.
os.environ.setdefault("MONARCH_KERNEL_HOST_TIMEOUT_S", "30")

import psutil  # noqa: E402

from monarch_kernel.actor import Actor, endpoint, this_host  # noqa: E402


class Noop(Actor):
    @endpoint
    def noop(self):
        return None


def tasks_cpu(pid: int) -> tuple[int, int]:
    """(CPU ns, context switches) of all threads of ``pid``."""
    ns = cs = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0, 0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                ns += int(f.read().split()[0])
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                for line in f:
                    if line.startswith(("voluntary_ctxt", "nonvoluntary_ctxt")):
                        cs += int(line.split()[1])
        except OSError:
            pass
    return ns, cs


def threads_cpu(pid: int) -> dict[str, int]:
    """CPU ns of each thread of ``pid`` by name (the controller: MainThread, monarch-io,
    ZMQbg/IO/0; Python's names for this process's own threads, else the kernel's)."""
    out: dict[str, int] = {}
    names = {t.native_id: t.name for t in threading.enumerate()} if pid == os.getpid() else {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = names.get(int(tid)) or f.read().strip()
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                out[name] = out.get(name, 0) + int(f.read().split()[0])
        except OSError:
            pass
    return out


def roles(agents: list[int] | None = None) -> dict[str, list[int]]:
    """This controller, its agents (or only ``agents``), their zygotes and those zygotes' procs."""
    me = psutil.Process()
    out: dict[str, list[int]] = {"controller": [me.pid], "agent": [], "zygote": [], "procs": []}
    for c in me.children(recursive=True):
        try:
            cmd = " ".join(c.cmdline())
        except psutil.Error:
            continue
        if ("node.agent" in cmd or "workers.agent" in cmd) and (agents is None or c.pid in agents):
            out["agent"].append(c.pid)
        elif "node.zygote" in cmd and c.ppid() in out["agent"]:
            out["zygote"].append(c.pid)
    for z in out["zygote"]:
        out["procs"].extend(p.pid for p in psutil.Process(z).children())
    return out


def snapshot(r: dict) -> dict:
    """Every role's (CPU ns, context switches); the controller is read first, so what the
    rest of the reading costs it (``_cost``, thread CPU) falls between this snapshot and
    the next one and is taken off there (``diff``)."""
    out = {"controller": [tasks_cpu(p) for p in r["controller"]]}
    t0 = time.thread_time_ns()
    out.update({role: [tasks_cpu(p) for p in pids] for role, pids in r.items() if role != "controller"})
    out["_cost"] = time.thread_time_ns() - t0
    return out


def diff(a: dict, b: dict, per: float) -> dict:
    out = {}
    for role in r_roles(a):
        cpu = [(y[0] - x[0]) / per for x, y in zip(a[role], b[role])]
        if role == "controller":   # snapshot a's reading of the others is not the controller's work
            cpu[0] -= a["_cost"] / per
        cs = [(y[1] - x[1]) / per for x, y in zip(a[role], b[role])]
        out[role] = {"cpu_us": round(sum(cpu) / 1e3, 1), "ctx_switches": round(sum(cs), 2)}
        if role == "procs" and cpu:
            out[role]["cpu_us_per_proc_p50"] = round(statistics.median(cpu) / 1e3, 2)
            out[role]["ctx_switches_per_proc_p50"] = round(statistics.median(cs), 2)
    out["total_cpu_us"] = round(sum(v["cpu_us"] for v in out.values()), 1)
    return out


def r_roles(snap: dict) -> list[str]:
    return [k for k in snap if not k.startswith("_")]


def emit(**kw) -> None:
    print(json.dumps(kw), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--modes", default="fan,dir")
    ap.add_argument("--idle-s", type=float, default=2.0)
    a = ap.parse_args()
    emit(what="load_average", value=os.getloadavg(), cores=os.cpu_count())
    host = this_host()
    try:
        t0 = time.perf_counter()
        procs = host.spawn_procs(per_host={"gpus": a.n}, name="prof")
        actors = procs.spawn("noop", Noop)
        actors.noop.call().get(600)
        emit(what="spawn_s", value=round(time.perf_counter() - t0, 3), n=a.n)
        r = roles()
        emit(what="processes", **{k: len(v) for k, v in r.items()})
        for _ in range(20):
            actors.noop.call().get()
        time.sleep(0.5)
        s0 = snapshot(r)
        time.sleep(a.idle_s)
        emit(what="idle_per_s", n=a.n, **diff(s0, snapshot(r), a.idle_s))
        fan_min = os.environ.get("MONARCH_KERNEL_FANOUT_MIN") or "4"
        for rnd in range(a.rounds):
            for mode in a.modes.split(","):
                os.environ["MONARCH_KERNEL_FANOUT_MIN"] = fan_min if mode == "fan" else "0"
                for _ in range(5):
                    actors.noop.call().get()
                lat = []
                s0 = snapshot(r)
                t0 = threads_cpu(os.getpid())   # (after the snapshot: its reading is not the controller's work)
                c0, w0 = time.process_time(), time.perf_counter()
                for _ in range(a.calls):
                    t = time.perf_counter()
                    actors.noop.call().get()
                    lat.append(time.perf_counter() - t)
                wall = time.perf_counter() - w0
                c1 = time.process_time()
                t1 = threads_cpu(os.getpid())
                by_thread = {k: round((v - t0.get(k, 0)) / a.calls / 1e3, 1) for k, v in t1.items()
                             if v - t0.get(k, 0) > 0}
                d = diff(s0, snapshot(r), a.calls)
                lat.sort()
                emit(what="per_call", mode=mode, round=rnd, n=a.n, p50_ms=round(lat[len(lat) // 2] * 1e3, 2),
                     mean_ms=round(wall / a.calls * 1e3, 2),
                     controller_process_time_ms=round((c1 - c0) / a.calls * 1e3, 3),
                     floor_ms_on_cores=round(d["total_cpu_us"] / 1e3 / os.cpu_count(), 2),
                     load=round(os.getloadavg()[0], 1), controller_threads_us=by_thread, **d)
        procs.stop()
    finally:
        host.shutdown()


if __name__ == "__main__":
    sys.exit(main())
