"""Kernel benchmarks, through jupyter_client against the installed ``monarch`` kernelspec.

    .venv/bin/python bench/bench_kernel.py [--cells 200]

Prints JSON lines {"system": "monarch-kernel", "metric", "value", "unit", ...}:
  * on_mesh_cell_4_ranks_p50/p90: a trivial ``%%on_mesh`` cell on 4 ranks, from sending
    execute_request to receiving execute_reply (target p50 <= 5 ms); a plain ``pass``
    cell in the same kernel for comparison;
  * connect_4_procs_prewarmed / _cold: ``%mesh connect --procs 4`` to ready, with the
    kernel's background agent warm (the notebook's default mesh), and for a mesh whose
    agent starts in the cell;
  * reattach_after_restart: the same connect cell after a kernel restart (target <= 1 s),
    and restart_to_reattached, from the restart request to the cell's reply.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from kernel_harness import KernelHarness  # noqa: E402


def emit(metric: str, value: float, unit: str, **extra) -> None:
    print(json.dumps({"system": "monarch-kernel", "metric": metric, "value": round(value, 4), "unit": unit,
                      "machine": f"{platform.machine()} {os.cpu_count()} cores", **extra}), flush=True)


def timed(k: KernelHarness, code: str, timeout: float = 120) -> float:
    t0 = time.perf_counter()
    r = k.run(code, timeout)
    dt = time.perf_counter() - t0
    if r.status != "ok":
        raise RuntimeError(f"{code!r} failed: {r.error or r.stderr}")
    return dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", type=int, default=200)
    a = ap.parse_args()
    k = KernelHarness(prewarm=True, env={"MONARCH_KERNEL_DEFAULT_MESH": "bench-default",
                                         "MONARCH_KERNEL_HOME": tempfile.mkdtemp(prefix="mk-bench-")})
    k.home = k.env["MONARCH_KERNEL_HOME"]
    try:
        time.sleep(5)   # a user opens the notebook, reads, then runs the connect cell
        emit("connect_4_procs_prewarmed", timed(k, "%mesh connect --procs 4"), "s")
        variants = {"on_mesh_cell_4_ranks": "%%on_mesh\nx = 1", "on_mesh_cell_4_ranks_with_value": "%%on_mesh\nrank",
                    "plain_cell": "pass"}
        for code in variants.values():
            for _ in range(10):
                timed(k, code)
        kernel = {m: [] for m in variants}
        trip = {m: [] for m in variants}
        for _ in range(a.cells):   # interleaved, so load from elsewhere hits all alike
            for m, code in variants.items():
                t0 = time.perf_counter()
                r = k.run(code)
                trip[m].append((time.perf_counter() - t0) * 1e3)
                kernel[m].append(r.kernel_seconds * 1e3)
        for m in variants:
            q = statistics.quantiles(kernel[m], n=10)
            extra = {"target": "<= 5 ms"} if m == "on_mesh_cell_4_ranks" else {}
            emit(f"{m}_kernel_side_p50", statistics.median(kernel[m]), "ms", n=a.cells, **extra)
            emit(f"{m}_kernel_side_p90", q[8], "ms", n=a.cells)
            emit(f"{m}_round_trip_p50", statistics.median(trip[m]), "ms", n=a.cells,
                 note="client send to reply received, through jupyter_client")

        t0 = time.perf_counter()
        k.restart()
        emit("reattach_after_restart", timed(k, "%mesh connect --procs 4"), "s", target="<= 1 s",
             note="the connect cell in the restarted kernel")
        emit("restart_to_reattached", time.perf_counter() - t0, "s",
             note="from the restart request (a new kernel process starts) to the connect cell's reply")
        timed(k, "%mesh stop")
        emit("connect_4_procs_cold", timed(k, "%mesh connect bench-cold --procs 4"), "s",
             note="the agent and its torch zygote start in the cell")
    finally:
        k.close(stop_meshes=("bench-cold", "bench-default"))


if __name__ == "__main__":
    main()
