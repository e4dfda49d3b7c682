"""The GPU paths, on a machine with an NVIDIA GPU. Prints JSON lines (``JSON {...}``).

  python bench/bench_gpu.py [--big]

  * a 64 MiB tensor through a plain call, as argument (the actor sums it) and as result,
    CUDA beside CPU in the same run;
  * RDMABuffer over a proc's CUDA memory: read_into a CPU and a CUDA tensor, write_from a
    CUDA tensor (64 MiB, and 1 GiB with --big), beside the same on a CPU buffer;
  * an NCCL all_reduce of 1 GiB on one rank per visible GPU, on the mesh and under torchrun
    in the same run (one GPU gives a one-rank group: that measures the mesh's overhead on a
    collective, not NCCL's bandwidth);
  * pipelined elementwise ops on a distributed tensor on CUDA (ops/s);
  * one NVML telemetry sample of the host's procs (ms).
Without CUDA it says so and exits 0.
"""
from __future__ import annotations

import argparse
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
from _common import common  # noqa: E402

from monarch_kernel.actor import Actor, endpoint, this_host  # noqa: E402
from monarch_kernel.rdma import RDMABuffer, cuda_ipc  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])
MB = 1 << 20
NCCL_BYTES = 1 << 30
NCCL_SCRIPT = r"""
import json, os, statistics, time, torch, torch.distributed as dist
if not dist.is_initialized():
    dist.init_process_group("nccl")
torch.cuda.set_device(0 if os.environ.get("CUDA_VISIBLE_DEVICES") else int(os.environ.get("LOCAL_RANK", 0)))
x = torch.ones(NBYTES // 4, device="cuda")
for _ in range(3):
    dist.all_reduce(x)
torch.cuda.synchronize()
out = []
for _ in range(10):
    dist.barrier(); torch.cuda.synchronize()
    t0 = time.perf_counter(); dist.all_reduce(x); torch.cuda.synchronize()
    out.append(time.perf_counter() - t0)
RESULT = statistics.median(out)
"""


class Gpu(Actor):
    def __init__(self):
        self.kept: dict = {}

    @endpoint
    def total(self, t: torch.Tensor) -> float:
        return float(t.sum())

    @endpoint
    def make(self, nbytes: int, device: str) -> torch.Tensor:
        self.kept["out"] = torch.ones(nbytes // 4, device=device)
        if device == "cuda":
            torch.cuda.synchronize()
        return self.kept["out"]

    @endpoint
    def buffer(self, nbytes: int, device: str) -> RDMABuffer:
        self.kept[device] = torch.ones(nbytes // 4, device=device)
        return RDMABuffer(self.kept[device])

    @endpoint
    def nccl_all_reduce(self) -> float:
        ns = {"NBYTES": NCCL_BYTES}
        exec(NCCL_SCRIPT, ns)
        return ns["RESULT"]


def median_time(fn, reps: int = 5) -> float:
    fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def through_calls(a) -> None:
    one = a.slice(gpus=0)
    for device in ("cpu", "cuda"):
        t = torch.ones(64 * MB // 4, device=device)
        s = median_time(lambda t=t: one.total.call_one(t).get())
        common.emit(f"call_arg_64MiB_{device}_GBps", round(64 * MB / s / 1e9, 3), "GB/s", seconds=round(s, 4))
        s = median_time(lambda device=device: one.make.call_one(64 * MB, device).get())
        common.emit(f"call_result_64MiB_{device}_GBps", round(64 * MB / s / 1e9, 3), "GB/s", seconds=round(s, 4))


def rdma(a, big: bool) -> None:
    one = a.slice(gpus=0)
    for nbytes in (64 * MB, 1 << 30) if big else (64 * MB,):
        label = f"{nbytes // MB}MiB"
        for owner in ("cpu", "cuda"):
            buf = one.buffer.call_one(nbytes, owner).get()
            for dst_dev in ("cpu", "cuda"):
                dst = torch.empty(nbytes // 4, device=dst_dev)
                s = median_time(lambda buf=buf, dst=dst: buf.read_into(dst).get(), reps=3 if big else 5)
                common.emit(f"rdma_read_{label}_{owner}_owner_to_{dst_dev}_GBps", round(nbytes / s / 1e9, 3),
                            "GB/s", backend=buf.backend, ipc_copies_so_far=cuda_ipc.copies)
            src = torch.full((nbytes // 4,), 2.0, device="cuda")
            s = median_time(lambda buf=buf, src=src: buf.write_from(src).get(), reps=3 if big else 5)
            common.emit(f"rdma_write_{label}_cuda_to_{owner}_owner_GBps", round(nbytes / s / 1e9, 3), "GB/s",
                        backend=buf.backend)
            buf.drop()


def nccl_on_mesh(gpus: int) -> float:
    pm = this_host().spawn_procs(per_host={"gpus": gpus}, name="bench-nccl")
    try:
        pm.init_process_group(backend="nccl", timeout=120)
        return statistics.median(pm.spawn("g", Gpu).nccl_all_reduce.call().get(300).values())
    finally:
        pm.stop()


def nccl_under_torchrun(gpus: int) -> float:
    script = os.path.join(os.environ.get("TMPDIR", "/tmp"), "bench_gpu_nccl.py")
    with open(script, "w") as f:
        f.write(f"NBYTES = {NCCL_BYTES}\n" + NCCL_SCRIPT
                + "\nif dist.get_rank() == 0: print('RESULT', json.dumps(RESULT), flush=True)\n")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(gpus), script]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    for line in out.splitlines():
        if line.startswith("RESULT "):
            return float(line.split()[1])
    raise RuntimeError(f"torchrun failed:\n{out[-2000:]}\n{err[-3000:]}")


def dtensor_dispatch(gpus: int) -> None:
    from monarch_kernel.tensor import Shard
    pm = this_host().spawn_procs(per_host={"gpus": gpus}, name="bench-dtensor-cuda")
    try:
        h = pm.distribute(torch.ones(64 * gpus, 64), placements=[Shard(0)])
        assert h.device.type == "cuda", h.device
        for _ in range(500):
            h = h + 1
        h.full_tensor()
        n = 5000
        t0 = time.perf_counter()
        for _ in range(n):
            h = h + 1
        h.full_tensor()
        common.emit("dtensor_cuda_pipelined_ops_per_s", round(n / (time.perf_counter() - t0)), "ops/s", ranks=gpus)
    finally:
        pm.stop()


def nvml_sample(n: int) -> None:
    from monarch_kernel.telemetry.sampler import GpuProbe
    g = GpuProbe()
    if not g.available:
        common.emit("nvml_available", 0, "bool")
        return
    t0 = time.perf_counter()
    for _ in range(20):
        g.per_pid()
    common.emit("nvml_sample_ms", round((time.perf_counter() - t0) / 20 * 1e3, 3), "ms", procs_on_gpu=n)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--big", action="store_true", help="also 1 GiB RDMA transfers")
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device here: nothing to measure")
        return
    gpus = torch.cuda.device_count()
    common.emit("gpu", gpus, "count", name=torch.cuda.get_device_name(0), torch=torch.__version__)
    pm = this_host().spawn_procs(per_host={"gpus": 2}, name="bench-gpu")
    try:
        g = pm.spawn("g", Gpu)
        g.initialized.get()
        through_calls(g)
        rdma(g, a.big)
        nvml_sample(2)
    finally:
        pm.stop()
    ours, theirs = nccl_on_mesh(gpus), nccl_under_torchrun(gpus)
    common.emit("nccl_allreduce_1GiB_mesh_ms", round(ours * 1e3, 3), "ms", ranks=gpus)
    common.emit("nccl_allreduce_1GiB_torchrun_ms", round(theirs * 1e3, 3), "ms", ranks=gpus)
    common.emit("nccl_allreduce_mesh_over_torchrun", round(ours / theirs, 3), "ratio", ranks=gpus)
    dtensor_dispatch(gpus)


if __name__ == "__main__":
    main()
