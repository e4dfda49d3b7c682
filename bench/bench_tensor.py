"""torch.distributed and distributed tensors on the mesh, against torchrun in the same run.
Prints JSON lines (``JSON {...}``).

  python bench/bench_tensor.py [--rounds 2]

  * gloo all_reduce of 64 MiB on 4 ranks, and the DDP step of notebooks/ddp.ipynb's model:
    bench/spmd_workload.py timed on the ranks, once in procs of the mesh (after
    ``init_process_group``) and once under ``torchrun --nproc-per-node 4``; rounds
    alternate, medians of rounds, and the mesh/torchrun ratios;
  * remote op dispatch: pipelined elementwise ops/s on a 4-rank handle (10,000 ``h = h + 1``
    until the result is back), and the round trip of one fetched scalar (``s.item()``).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time

import cloudpickle
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import spmd_workload  # noqa: E402
from _common import common  # noqa: E402

from monarch_kernel.actor import Actor, endpoint, this_host  # noqa: E402
from monarch_kernel.tensor import Shard  # noqa: E402

cloudpickle.register_pickle_by_value(spmd_workload)
cloudpickle.register_pickle_by_value(sys.modules[__name__])


class Workload(Actor):
    @endpoint
    def run(self) -> dict:
        return spmd_workload.run_all()


def torchrun_round() -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1"}
    cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone", "--nproc-per-node", "4",
           os.path.join(HERE, "spmd_workload.py")]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)   # torchrun and its workers
            proc.wait()
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"torchrun failed:\n{stdout[-2000:]}\n{stderr[-3000:]}")


def dispatch(procs) -> None:
    h = procs.distribute(torch.ones(64, 64), placements=[Shard(0)])
    for _ in range(1000):   # warm: the meta cache, the ranks' fast path
        h = h + 1
    h.full_tensor()
    n = 10_000
    t0 = time.perf_counter()
    for _ in range(n):
        h = h + 1
    issued = time.perf_counter() - t0
    h.full_tensor()
    done = time.perf_counter() - t0
    common.emit("tensor_pipelined_ops_per_s", round(n / done), "ops/s", ops=n, ranks=4,
                issue_only_ops_per_s=round(n / issued))
    s = h.sum()
    s.item()
    samples = []
    for _ in range(200):
        t0 = time.perf_counter()
        s.item()
        samples.append(time.perf_counter() - t0)
    common.emit_latency("tensor_scalar_fetch", samples, ranks=4)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()
    procs = this_host().spawn_procs(per_host={"gpus": 4}, name="bench-tensor")
    try:
        procs.init_process_group()
        wl = procs.spawn("workload", Workload)
        mesh_runs, torchrun_runs = [], []
        for _ in range(a.rounds):
            torchrun_runs.append(torchrun_round())
            mesh_runs.append(wl.run.call().get(300).values()[0])
        for key, metric in (("allreduce_s", "gloo_allreduce_64MiB"), ("ddp_step_s", "ddp_step")):
            ours = statistics.median(r[key] for r in mesh_runs)
            theirs = statistics.median(r[key] for r in torchrun_runs)
            extra = {}
            if key == "allreduce_s":
                busbw = spmd_workload.ALLREDUCE_BYTES / ours * 2 * 3 / 4 / 1e9
                extra = {"bus_GBps": round(busbw, 3)}
            common.emit(f"{metric}_mesh_ms", round(ours * 1e3, 3), "ms", ranks=4, rounds=a.rounds, **extra)
            common.emit(f"{metric}_torchrun_ms", round(theirs * 1e3, 3), "ms", ranks=4, rounds=a.rounds)
            common.emit(f"{metric}_mesh_over_torchrun", round(ours / theirs, 3), "ratio", ranks=4,
                        per_round=[round(m[key] / t[key], 3) for m, t in zip(mesh_runs, torchrun_runs)])
        dispatch(procs)
    finally:
        procs.stop()


if __name__ == "__main__":
    main()
