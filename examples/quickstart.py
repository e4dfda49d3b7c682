"""Quickstart: a local mesh of 4 procs, an actor on it, calls, slicing and a failure."""
import os

import torch

from monarch_kernel.actor import Actor, ActorError, current_rank, endpoint, this_host


class Trainer(Actor):
    def __init__(self, lr: float):
        self.lr = lr
        self.w = torch.zeros(4)

    @endpoint
    def step(self, grad: torch.Tensor) -> float:
        self.w -= self.lr * grad * (current_rank().rank + 1)
        return float(self.w.sum())

    @endpoint
    def where(self) -> str:
        print(f"rank {current_rank().rank} lives in pid {os.getpid()}")
        return f"pid {os.getpid()}"

    @endpoint
    def fail(self):
        raise ValueError("this rank was asked to fail")


def main():
    procs = this_host().spawn_procs(per_host={"gpus": 4})
    print(procs)
    trainers = procs.spawn("trainers", Trainer, lr=0.1)
    print(trainers.where.call().get())
    print("step:", trainers.step.call(torch.ones(4)).get())
    print("first two:", trainers.slice(gpus=slice(0, 2)).step.call(torch.ones(4)).get())
    print("rank 3 alone:", trainers.slice(gpus=3).step.call_one(torch.ones(4)).get())
    try:
        trainers.slice(gpus=1).fail.call_one().get()
    except ActorError as e:
        print("caught, as expected:", e.message)
    print("still serving:", trainers.step.call(torch.zeros(4)).get())
    procs.stop()


if __name__ == "__main__":
    main()
