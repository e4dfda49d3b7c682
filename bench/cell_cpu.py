"""Where a trivial ``%%on_mesh`` cell's time and CPU go, on N ranks, for one or more trees.

    .venv/bin/python bench/cell_cpu.py --n 256 [--trees .,/tmp/base] [--rounds 3] [--cells 20]
                                        [--profile kernel|proc] [--code 'x = 1']

One real kernel per tree (jupyter_client; the tree first on PYTHONPATH, so the kernel, its
agent and its procs run that tree's code), each connected to its own mesh of N procs on
this host; then rounds of ``--cells`` cells, the trees taking turns cell by cell, so the
load of a shared machine falls on all alike. JSON lines per tree and round: the kernel-side p50 (the
kernel's reply header date minus its ``started``, as bench_scale.py reads it) and the CPU
per cell, from ``/proc/*/task/*/schedstat`` (ns): the kernel process (``kernel_main``: its
main thread, where IPython and the cell's output run), the agent, and the N procs together
(``procs``; ``proc_us``: per proc). The load average goes with each line.

Caveat of the interleaving: what a kernel does between its own cells (after a reply, before
the next request) lands during the other kernel's cell, so a change that moves work to
after the reply looks better here than in a run of cells on one kernel; check such a change
with bench/cell_phases.py (one kernel, the cell's phases).

``--profile kernel``: cProfile (CPU time of the thread) on the kernel's main thread over the
timed cells of the last round (turned on and off by plain cells; not left on); ``--profile
proc``: the same on rank 0's main thread. Prints the top functions (tottime, then cumulative)
to stderr; ``MONARCH_BENCH_PROFILE_OUT=FILE`` also saves the stats there (pstats).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from kernel_harness import KernelHarness, home_processes  # noqa: E402


def cpu_ns(pid: int) -> dict[int, int]:
    """Run time (ns) of each thread of ``pid``."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for t in tids:
        try:
            with open(f"/proc/{pid}/task/{t}/schedstat") as f:
                out[int(t)] = int(f.read().split()[0])
        except OSError:
            pass
    return out


def ppid_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


class Tree:
    def __init__(self, spec: str, n: int, tag: str):
        path, *env = spec.split("|")   # PATH|VAR=VALUE|...: that tree's kernel with these too
        self.path = os.path.abspath(path)
        self.spec = spec
        self.tag = tag
        home = tempfile.mkdtemp(prefix="mk-cell-cpu-")
        pp = os.pathsep.join([self.path] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
        here = os.getcwd()
        os.chdir(self.path)   # `python -m` puts the working directory first on sys.path
        try:
            self.k = KernelHarness(env={"MONARCH_KERNEL_HOME": home, "PYTHONPATH": pp,
                                        **dict(e.split("=", 1) for e in env)})
        finally:
            os.chdir(here)
        self.home = home
        self.name = f"cell-cpu-{tag}"
        try:
            self._start(n)
        except BaseException:
            self.close()   # its mesh is persistent: it would outlive this script
            raise

    def _start(self, n: int) -> None:
        tag = self.tag
        self.k.ok(f"%mesh connect {self.name} --procs {n}", timeout=900)
        here = self.k.ok("import monarch_kernel; print(monarch_kernel.__file__)").stdout.strip()
        there = self.k.ok("%%on_mesh --ranks 0\nimport monarch_kernel; print(monarch_kernel.__file__)").stdout.strip()
        for f in (here, there):
            if self.path not in f:
                raise SystemExit(f"{tag}: runs {f}, not the code in {self.path}")
        self.kernel_pid = self.k.km.provisioner.process.pid
        import ast

        self.tnames = ast.literal_eval(self.k.ok(
            "import threading; print({t.native_id: t.name for t in threading.enumerate()})").stdout.strip())
        pids = home_processes(self.home)
        parent = {p: ppid_of(p) for p in pids}
        self.agents = [p for p in pids if parent[p] == self.kernel_pid]
        zyg = [p for p in pids if parent[p] in self.agents]
        self.procs = [p for p in pids if parent[p] in zyg]
        if len(self.procs) != n:
            raise SystemExit(f"{tag}: found {len(self.procs)} procs, not {n}")

    def sample(self) -> dict[str, int]:
        k = cpu_ns(self.kernel_pid)
        threads = {}
        for tid, ns in k.items():
            if tid == self.kernel_pid:
                continue
            name = self.tnames.get(tid)
            if name is None:
                try:
                    with open(f"/proc/{self.kernel_pid}/task/{tid}/comm") as f:
                        name = f.read().strip()
                except OSError:
                    name = "?"
            threads[f"k:{name}"] = threads.get(f"k:{name}", 0) + ns
        return {**threads, "kernel": sum(k.values()), "kernel_main": k.get(self.kernel_pid, 0),
                "agent": sum(sum(cpu_ns(p).values()) for p in self.agents),
                "procs": sum(sum(cpu_ns(p).values()) for p in self.procs),
                "procs_main": sum(cpu_ns(p).get(p, 0) for p in self.procs)}

    def close(self) -> None:
        self.k.close(stop_meshes=(self.name,))
        shutil.rmtree(self.home, ignore_errors=True)


PROFILE_ON = ("import cProfile as _cp, time as _t; _bench_prof = _cp.Profile(_t.thread_time); "
              "_bench_prof.enable()")   # CPU time of the thread: the machine is shared
PROFILE_OFF = ("_bench_prof.disable(); import pstats as _ps, io as _io, os as _os; _s = _io.StringIO(); "
               "_bench_prof.dump_stats(_os.environ.get('MONARCH_BENCH_PROFILE_OUT', '/dev/null')); "
               "_p = _ps.Stats(_bench_prof, stream=_s); _p.sort_stats('tottime').print_stats(35); "
               "_p.sort_stats('cumulative').print_stats(80); print(_s.getvalue())")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--trees", default=".", help="comma-separated source trees (first on PYTHONPATH), "
                    "each PATH or PATH|VAR=VALUE|... (environment of that tree's kernel)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cells", type=int, default=20)
    ap.add_argument("--code", default="x = 1")
    ap.add_argument("--options", default="", help="%%on_mesh options, e.g. --quiet-ranks 1:")
    ap.add_argument("--cell", default="", help="the whole cell instead (e.g. a plain call to compare)")
    ap.add_argument("--profile", choices=("", "kernel", "proc"), default="")
    a = ap.parse_args()
    cell = a.cell or f"%%on_mesh {a.options}".rstrip() + "\n" + a.code
    trees: list[Tree] = []
    try:
        for i, path in enumerate(a.trees.split(",")):
            trees.append(Tree(path, a.n, f"t{i}"))
        for t in trees:
            for _ in range(5):
                t.k.ok(cell)
        for rnd in range(a.rounds):
            prof = a.profile and rnd == a.rounds - 1
            if prof:
                for t in trees:
                    t.k.ok(PROFILE_ON if a.profile == "kernel" else "%%on_mesh --ranks 0\n" + PROFILE_ON)
            load = os.getloadavg()[0]
            samples: dict[str, list[float]] = {t.tag: [] for t in trees}
            c0 = {t.tag: t.sample() for t in trees}
            # cell by cell, each tree in turn: the same moments of load for all (the other
            # trees' idle meshes cost them a little CPU meanwhile, alike). The order turns
            # each cell: the tree going first was measured ~1-3 ms slower at 256 ranks, the
            # same tree either way (the other kernel's work after its reply lands on it).
            for i in range(a.cells):
                for t in trees[i % len(trees):] + trees[:i % len(trees)]:
                    samples[t.tag].append(t.k.ok(cell).kernel_seconds * 1e3)
            c1 = {t.tag: t.sample() for t in trees}
            for t in trees:
                if prof:
                    off = PROFILE_OFF if a.profile == "kernel" else "%%on_mesh --ranks 0\n" + PROFILE_OFF
                    print(f"==== {a.profile} profile, {t.path}, {a.cells} cells ====", file=sys.stderr)
                    print(t.k.ok(off).stdout, file=sys.stderr)
                s = samples[t.tag]
                per = {k: (v - c0[t.tag].get(k, 0)) / a.cells / 1e6 for k, v in c1[t.tag].items()}
                print(json.dumps({"tree": t.spec, "round": rnd, "n": a.n, "cells": a.cells,
                                  "p50_ms": round(statistics.median(s), 2), "min_ms": round(min(s), 2),
                                  **{f"{k}_cpu_ms": round(v, 2) for k, v in per.items()},
                                  "proc_us": round(per["procs"] / a.n * 1e3, 1),
                                  "load1": round(load, 1), "profiled": bool(prof)}), flush=True)
    finally:
        for t in trees:
            try:
                t.close()
            except BaseException as e:
                print(f"closing {t.path}: {e}", file=sys.stderr)


if __name__ == "__main__":
    main()
