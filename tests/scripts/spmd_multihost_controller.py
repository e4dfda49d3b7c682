"""Controller for tests/test_spmd_multihost.py, run inside network namespace A: a process
group over procs on two hosts, checked by torchrun's env, an all_reduce and a DTensor
matmul. Prints one JSON line with what it saw."""
import json
import sys

import torch

from monarch_kernel.actor import Actor, attach_to_workers, endpoint
from monarch_kernel.tensor import Shard


class Probe(Actor):
    @endpoint
    def env(self) -> dict:
        import os

        import torch.distributed as dist

        keys = ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "WORLD_SIZE",
                "MASTER_ADDR", "GLOO_SOCKET_IFNAME")
        x = torch.ones(4) * (dist.get_rank() + 1)
        dist.all_reduce(x)
        return {**{k: os.environ.get(k) for k in keys}, "sum": x.tolist()}


def main():
    addrs, key = sys.argv[1].split(","), sys.argv[2]
    hosts = attach_to_workers(addrs, key)
    procs = hosts.spawn_procs(per_host={"gpus": 2})
    procs.init_process_group(timeout=30)
    envs = procs.spawn("probe", Probe).env.call().get(60).values()
    x = torch.arange(16.).reshape(4, 4)
    dt = procs.distribute(x, placements=[Shard(0), Shard(1)])
    same = torch.equal((dt @ dt.T).full_tensor(), x @ x.T)
    print(json.dumps({"envs": envs, "matmul_equal": same, "placements": [repr(p) for p in dt.placements]}),
          flush=True)
    hosts.shutdown()


if __name__ == "__main__":
    main()
