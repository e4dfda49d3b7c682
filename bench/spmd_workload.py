"""The torch.distributed work timed by bench_tensor.py, identical under torchrun and on the
mesh: each function assumes the default process group is up and times itself on the rank.

    torchrun --nproc-per-node 4 bench/spmd_workload.py     # prints one JSON line (rank 0)
"""
from __future__ import annotations

import json
import statistics
import time

import torch
import torch.distributed as dist

ALLREDUCE_BYTES = 64 * 1024 * 1024
ALLREDUCE_WARMUP, ALLREDUCE_ITERS = 2, 10
DDP_WARMUP, DDP_STEPS = 20, 200


def allreduce_seconds() -> list[float]:
    """Per-op seconds of a 64 MiB float32 all_reduce (after a barrier, so all start together)."""
    x = torch.ones(ALLREDUCE_BYTES // 4)
    for _ in range(ALLREDUCE_WARMUP):
        dist.all_reduce(x)
    out = []
    for _ in range(ALLREDUCE_ITERS):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        out.append(time.perf_counter() - t0)
    return out


def ddp_step_seconds() -> list[float]:
    """Per-step seconds of the notebooks/ddp.ipynb model (forward, backward, all-reduce, SGD)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(dist.get_rank())
    xs = torch.randn(64, 8, generator=g)
    ys = xs @ torch.linspace(-1, 1, 8).unsqueeze(1)
    out = []
    for i in range(DDP_WARMUP + DDP_STEPS):
        t0 = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(xs), ys).backward()
        opt.step()
        if i >= DDP_WARMUP:
            out.append(time.perf_counter() - t0)
    return out


def run_all() -> dict:
    torch.set_num_threads(1)
    ar = allreduce_seconds()
    ddp = ddp_step_seconds()
    return {"allreduce_s": statistics.median(ar), "ddp_step_s": statistics.median(ddp)}


if __name__ == "__main__":
    dist.init_process_group("gloo")
    result = run_all()
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()
