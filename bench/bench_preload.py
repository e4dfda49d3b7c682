"""A first cell that imports a module on N ranks, with and without it preloaded in the zygote.

    .venv/bin/python bench/bench_preload.py [--n 64] [--module matplotlib.pyplot] [--rounds 2]

Each round, alternating: N procs spawned on a fresh private host as they come (``plain``),
then on a host that preloaded ``--module`` first (``HostMesh.preload``, as `%mesh connect
--preload` and MONARCH_KERNEL_PRELOAD do); then one call to all that imports the module, as
a notebook's first cell would. Prints JSON lines: the preload's seconds, the first import's
wall time to all N and the procs' CPU for it, and the memory each proc holds of its own (USS)
after it: imported in the zygote, the module's pages are shared by every proc.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import time

from _home import private_dir

private_dir("MONARCH_KERNEL_HOME", "mk-bench-preload-")
os.environ.setdefault("MONARCH_KERNEL_HOST_TIMEOUT_S", "30")   # shared machine: see scale_profile.py

import psutil  # noqa: E402

from monarch_kernel.actor import Actor, endpoint, this_host  # noqa: E402


class Importer(Actor):
    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def load(self, module: str) -> bool:
        already = module in sys.modules
        importlib.import_module(module)
        return already


def cpu_s(pids: list[int]) -> float:
    total = 0.0
    for p in pids:
        try:
            t = psutil.Process(p).cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def one(n: int, module: str, preload: bool) -> dict:
    host = this_host()
    try:
        took = None
        if preload:
            t0 = time.perf_counter()
            host.preload(module)
            took = round(time.perf_counter() - t0, 3)
        procs = host.spawn_procs(per_host={"gpus": n})
        actors = procs.spawn("imp", Importer)
        pids = list(actors.pid.call().get(600).values())
        c0, t0 = cpu_s(pids), time.perf_counter()
        already = actors.load.call(module).get(600).values()
        wall, cpu = time.perf_counter() - t0, cpu_s(pids) - c0
        uss = [psutil.Process(p).memory_full_info().uss / 2**20 for p in pids]
        return {"what": "first_import", "mode": "preload" if preload else "plain", "n": n, "module": module,
                "preload_s": took, "loaded_before": sum(already), "wall_s": round(wall, 3),
                "procs_cpu_s": round(cpu, 2), "uss_mib_p50": round(statistics.median(uss), 1),
                "load": round(os.getloadavg()[0], 1)}
    finally:
        host.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--module", default="matplotlib.pyplot")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    print(json.dumps({"what": "machine", "cores": os.cpu_count(), "load": os.getloadavg()}), flush=True)
    for _ in range(a.rounds):
        for preload in (False, True):
            print(json.dumps(one(a.n, a.module, preload)), flush=True)


if __name__ == "__main__":
    main()
