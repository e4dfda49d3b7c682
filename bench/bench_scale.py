"""How the runtime's costs grow with the number of procs on one host (issue 11's baseline).

    .venv/bin/python bench/bench_scale.py [--n 4,16,64] [--with-256] [--no-ipyparallel] [--no-kernel]

For each N (one host agent, N procs), JSON lines {"system", "metric", "value", "unit", "n", ...}:
  * spawn_procs_s: ``spawn_procs`` of N, an actor on each, and a first call to all answered;
    first the largest N on the agent just started (``"zygote": "cold"``: it waits for the
    zygote's torch import), stopped, then each N on the same agent (its zygote warm);
  * call_all_p50_us / p90: ``actors.noop.call().get()`` to all N;
  * controller_cpu_per_call_all_ms: CPU time of the controller process (all its threads)
    per call to all, over the same calls;
  * bcast_1KB_p50_us, bcast_1MB_p50_us: one call to all N carrying a 1 KB / 1 MB bytes
    argument;
  * output_line_per_rank_p50_us: a call to all in which each rank prints one line, until
    every line has reached the controller (the reply follows its rank's output);
  * on_mesh_trivial_cell_p50_ms: a ``%%on_mesh`` cell ``x = 1`` on N ranks through a real
    kernel (jupyter_client), kernel-side (from the kernel starting the request to its reply);
    on_mesh_trivial_cell_kernel_cpu_ms / _mesh_cpu_ms: CPU per such cell of the kernel
    process and of its mesh (agent, zygote, procs), which a shared machine disturbs less
    (bench/cell_cpu.py breaks both down and compares source trees);
  * floor_call_all_p50_us (``"system": "bare-python"``): the same call to all N with no
    framework at all, in the same run (bench/floor_raw.py: N forked Python processes on
    socketpairs, pickle in and out, each waiting as our procs do): the least a call to all
    N Python processes takes on this machine, to read our figure against (``--no-floor``);
  * ipyparallel_bcast_1KB_p50_us / _1MB / ipyparallel_call_all_p50_us /
    ipyparallel_start_s: the same broadcast with ipyparallel's DirectView
    (``apply_sync``) to N engines on this host, started and stopped by this script
    (``pip install -e .[bench]``).
256 procs only with ``--with-256`` (heavy on a small machine: GBs of memory). ``--hosts8``: also 256 procs as 8
hosts x 32, each host an agent in its own network namespace where root allows, else on a
loopback port of its own (``"how"``: netns or loopback; ``MK_SCALE_HOSTS`` picks;
tests/scale_hosts.py).
Each call-to-all figure is taken with fan-out through the agent (``"fanout": true``) and,
alternating in the same run, without it (``MONARCH_KERNEL_FANOUT_MIN=0``: one send per proc);
with 8 hosts also with the hosts in a tree (``"tree_width"`` 2 and 3:
MONARCH_KERNEL_FANOUT_TREE_WIDTH; 0: every host under the controller), plus the controller's
sends and fan-in batches per call to all (``controller_sends_per_call_all``, ``_batches_``).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from _home import private_dir

private_dir("MONARCH_KERNEL_HOME", "mk-bench-scale-")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from monarch_kernel.actor import Actor, endpoint, this_host  # noqa: E402

MACHINE = f"{platform.machine()} {os.cpu_count()} cores"


def emit(metric: str, value: float, unit: str, **extra) -> None:
    print(json.dumps({"system": extra.pop("system", "monarch-kernel"), "metric": metric,
                      "value": round(value, 4), "unit": unit, "machine": MACHINE, **extra}), flush=True)


def pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))]


def iters_for(n: int) -> int:
    return max(20, 2000 // n)


class ScaleBench(Actor):
    @endpoint
    def noop(self):
        return None

    @endpoint
    def take(self, payload: bytes) -> int:
        return len(payload)

    @endpoint
    def say(self, i: int) -> None:
        print(f"line {i}")


def timed_calls(fn, iters: int) -> list[float]:
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def cold_spawn(host, n: int) -> None:
    """The first spawn on an agent that has just started: its zygote is still importing torch
    (a script's first ``spawn_procs``; a notebook's kernel starts its agent ahead). Then
    stopped: the figures per N that follow are taken on the warm zygote."""
    t0 = time.perf_counter()
    procs = host.spawn_procs(per_host={"gpus": n}, name=f"cold{n}")
    procs.spawn("scale", ScaleBench).noop.call().get(600)
    emit("spawn_procs_s", time.perf_counter() - t0, "s", n=n, hosts=1, zygote="cold")
    procs.stop()


def actor_api(host, n: int, per_host: int | None = None, hosts: int = 1, how: str | None = None) -> None:
    from monarch_kernel.core.runtime import runtime

    per_host = per_host or n
    t0 = time.perf_counter()
    procs = host.spawn_procs(per_host={"gpus": per_host}, name=f"scale{n}")
    actors = procs.spawn("scale", ScaleBench)
    actors.noop.call().get(600)
    where = {"how": how} if how else {}
    emit("spawn_procs_s", time.perf_counter() - t0, "s", n=n, hosts=hosts, **where,
         **({"zygote": "warm"} if hosts == 1 else {}))
    iters = iters_for(n)
    saved = {k: os.environ.get(k) for k in ("MONARCH_KERNEL_FANOUT_MIN", "MONARCH_KERNEL_FANOUT_TREE_WIDTH")}
    fan_min = saved["MONARCH_KERNEL_FANOUT_MIN"] or "4"
    # (fan-out, tree width): several hosts also with the hosts in a tree of width 2 and 3.
    modes = [(True, 0), (False, 0)] if hosts == 1 else [(True, 0), (True, 2), (True, 3), (False, 0)]
    try:
        for _ in range(5):
            actors.noop.call().get()
        for rnd in range(2):   # alternate the modes (same run, same load)
            for fan, width in modes:
                os.environ["MONARCH_KERNEL_FANOUT_MIN"] = fan_min if fan else "0"
                os.environ["MONARCH_KERNEL_FANOUT_TREE_WIDTH"] = str(width)
                tag = {"n": n, "hosts": hosts, "fanout": fan, "round": rnd, **where}
                if hosts > 1:
                    tag["tree_width"] = width
                actors.noop.call().get()
                cpu0 = time.process_time()
                s = timed_calls(lambda: actors.noop.call().get(), iters)
                cpu = time.process_time() - cpu0
                emit("call_all_p50_us", pct(s, 0.5) * 1e6, "us", iters=iters, **tag)
                emit("call_all_p90_us", pct(s, 0.9) * 1e6, "us", iters=iters, **tag)
                emit("controller_cpu_per_call_all_ms", cpu / iters * 1e3, "ms", iters=iters, **tag)
                if rnd:
                    continue
                if hosts > 1:
                    sends, batches = _messages_per_call(runtime(), lambda: actors.noop.call().get(), 20)
                    emit("controller_sends_per_call_all", sends, "", iters=20, **tag)
                    emit("controller_batches_per_call_all", batches, "", iters=20, **tag)
                for size, name in ((1024, "1KB"), (1024 * 1024, "1MB")):
                    payload = os.urandom(size)
                    k = max(10, iters // (8 if size > 4096 else 1))
                    s = timed_calls(lambda p=payload: actors.take.call(p).get(), k)
                    emit(f"bcast_{name}_p50_us", pct(s, 0.5) * 1e6, "us", iters=k, **tag)
                rt = runtime()
                seen = []
                old, rt.output = rt.output, lambda rank, stream, text, seen=seen: seen.append(rank)
                try:
                    k = max(10, iters // 2)
                    s = timed_calls(lambda: actors.say.call(1).get(), k)
                finally:
                    rt.output = old
                assert len(seen) == n * k, (len(seen), n * k)
                emit("output_line_per_rank_p50_us", pct(s, 0.5) * 1e6, "us", iters=k, **tag)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        procs.stop()


def _messages_per_call(rt, call, iters: int) -> tuple[float, float]:
    """The controller's sends and received fan-in batches per call (counted apart from the
    timed calls: the counting costs CPU)."""
    sends, batches = [0], [0]
    real_send, real_batch = rt.send_frames, rt.handlers["rb"]

    def counting_send(addr, frames):
        sends[0] += 1
        return real_send(addr, frames)

    def counting_batch(msg):
        batches[0] += 1
        return real_batch(msg)

    rt.send_frames, rt.handlers["rb"] = counting_send, counting_batch
    try:
        for _ in range(iters):
            call()
    finally:
        rt.send_frames, rt.handlers["rb"] = real_send, real_batch
    return sends[0] / iters, batches[0] / iters


def eight_hosts() -> None:
    """256 procs as 8 hosts x 32: one network namespace each where root allows, else one
    loopback port each."""
    import scale_hosts

    from monarch_kernel.core.bootstrap import attach_to_workers

    with scale_hosts.AgentHosts(8) as hosts:
        hm = attach_to_workers(hosts.addrs, key=hosts.key, name="bench-hosts8")
        try:
            actor_api(hm, 256, per_host=32, hosts=8, how=hosts.mode)
        finally:
            hm.shutdown()


def kernel_cells(ns: list[int], cells: int = 20) -> None:
    from kernel_harness import KernelHarness

    k = KernelHarness(env={"MONARCH_KERNEL_HOME": os.environ["MONARCH_KERNEL_HOME"]})
    names = []
    try:
        for n in ns:
            name = f"bench-scale-{n}"
            names.append(name)
            k.ok(f"%mesh connect {name} --procs {n}", timeout=600)
            for _ in range(3):
                k.ok("%%on_mesh\nx = 1")
            kernel, mesh = _cpu_ns(k)
            s = [k.ok("%%on_mesh\nx = 1").kernel_seconds for _ in range(cells)]
            kernel2, mesh2 = _cpu_ns(k)
            emit("on_mesh_trivial_cell_p50_ms", statistics.median(s) * 1e3, "ms", n=n, cells=cells)
            emit("on_mesh_trivial_cell_kernel_cpu_ms", (kernel2 - kernel) / cells / 1e6, "ms", n=n, cells=cells,
                 note="CPU of the kernel process, every thread, per cell")
            emit("on_mesh_trivial_cell_mesh_cpu_ms", (mesh2 - mesh) / cells / 1e6, "ms", n=n, cells=cells,
                 note="CPU of the agent, zygote and procs together, per cell")
            k.ok(f"%mesh stop {name}", timeout=120)
            names.remove(name)
    finally:
        k.close(stop_meshes=tuple(names))


def _cpu_ns(k) -> tuple[int, int]:
    """Run time (ns, /proc/PID/task/*/schedstat) of the kernel process and of the other
    processes under its MONARCH_KERNEL_HOME (its agent, zygote and procs)."""
    from kernel_harness import home_processes

    def of(pid: int) -> int:
        total = 0
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            return 0
        for t in tids:
            try:
                with open(f"/proc/{pid}/task/{t}/schedstat") as f:
                    total += int(f.read().split()[0])
            except OSError:
                pass
        return total

    kernel = k.km.provisioner.process.pid
    return of(kernel), sum(of(p) for p in home_processes(k.env["MONARCH_KERNEL_HOME"]) if p != kernel)


def ipyparallel_bcast(n: int) -> None:
    import ipyparallel as ipp

    private_dir("IPYTHONDIR", "mk-bench-ipython-")
    t0 = time.perf_counter()
    # engine_timeout: ipyparallel gives up on its engines after 60 s by default (121 of 128
    # had registered by then here); wait as long as for ours, so the figure is how long it takes.
    cluster = ipp.Cluster(n=n, log_level=40, engine_timeout=600)
    try:
        rc = cluster.start_and_connect_sync(activate=False)
        rc.wait_for_engines(n, timeout=600)
        emit("ipyparallel_start_s", time.perf_counter() - t0, "s", n=n, system="ipyparallel")
        dv = rc[:]
        iters = iters_for(n)
        dv.apply_sync(len, b"")
        s = timed_calls(lambda: dv.apply_sync(int), max(10, iters // 4))
        emit("ipyparallel_call_all_p50_us", pct(s, 0.5) * 1e6, "us", n=n, system="ipyparallel")
        for size, name in ((1024, "1KB"), (1024 * 1024, "1MB")):
            payload = os.urandom(size)
            k = max(10, iters // (8 if size > 4096 else 4))
            s = timed_calls(lambda p=payload: dv.apply_sync(len, p), k)
            emit(f"ipyparallel_bcast_{name}_p50_us", pct(s, 0.5) * 1e6, "us", n=n, iters=k, system="ipyparallel")
        rc.close()
    finally:
        cluster.stop_cluster_sync()


def floor(n: int) -> None:
    """bench/floor_raw.py's call to all n bare Python processes, in this run."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import floor_raw
    r = floor_raw.run(n, max(100, iters_for(n)), "poll")
    emit("floor_call_all_p50_us", r["p50_ms"] * 1e3, "us", n=n, system="bare-python",
         child_cpu_us_per_child=r["child_cpu_us_per_child"], parent_cpu_ms=r["parent_cpu_ms"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", default="4,16,64", help="proc counts, comma-separated")
    ap.add_argument("--with-256", action="store_true", help="also N=256 (minutes, GBs of memory)")
    ap.add_argument("--no-ipyparallel", action="store_true")
    ap.add_argument("--ipp-n", default="", help="engine counts for ipyparallel (default: the same as --n)")
    ap.add_argument("--no-kernel", action="store_true")
    ap.add_argument("--hosts8", action="store_true", help="also 256 procs as 8 hosts x 32 (netns, or loopback)")
    ap.add_argument("--no-floor", action="store_true", help="skip the bare-Python floor (bench/floor_raw.py)")
    a = ap.parse_args()
    ns = [int(x) for x in a.n.split(",") if x]
    if a.with_256 and 256 not in ns:
        ns.append(256)
    emit("load_average_1m_at_start", os.getloadavg()[0], "", note="shared machine: figures are noisy")
    host = this_host()
    try:
        cold_spawn(host, max(ns))
        for n in ns:
            actor_api(host, n)
    finally:
        host.shutdown()
    if not a.no_floor:
        for n in ns:
            floor(n)
    if a.hosts8:
        eight_hosts()
    if not a.no_kernel:
        try:
            kernel_cells(ns)
        except Exception as e:   # said, not dropped: the ipyparallel figures still follow
            emit("kernel_cells_failed", 1, "", error=f"{type(e).__name__}: {e}"[:300])
    if not a.no_ipyparallel:
        for n in [int(x) for x in a.ipp_n.split(",") if x] or ns:
            try:
                ipyparallel_bcast(n)
            except Exception as e:   # a figure we could not take is said so, not dropped silently
                emit("ipyparallel_failed", 1, "", n=n, error=f"{type(e).__name__}: {e}"[:300], system="ipyparallel")
    emit("load_average_1m_at_end", os.getloadavg()[0], "")


if __name__ == "__main__":
    main()
