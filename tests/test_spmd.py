"""torch.distributed on the mesh through a real Monarch kernel: `%mesh connect --dist`
gives every rank torchrun's environment and a gloo group; DDP runs in %%on_mesh cells;
a rank killed in a collective fails the cell on every rank (no hang) and respawn forms a
new group; distributed tensor handles work from the notebook."""
from __future__ import annotations

import time

import pytest
from kernel_harness import kernel_with_mesh

MESH = "kt-spmd"


@pytest.fixture(scope="module")
def k():
    with kernel_with_mesh(MESH, "--procs 4 --dist", timeout=180) as h:
        r = h.connect_reply
        assert "torch.distributed: gloo process group over 4 ranks" in r.stdout, r.stdout
        yield h


def test_connect_dist_gives_every_rank_torchruns_env_and_a_gloo_group(k):
    r = k.ok("%%on_mesh\nimport os, torch.distributed as dist\n"
             "(dist.get_rank(), dist.get_world_size(), dist.get_backend(), os.environ['RANK'], "
             "os.environ['LOCAL_RANK'], os.environ['LOCAL_WORLD_SIZE'], os.environ['GROUP_RANK'], "
             "os.environ['MASTER_ADDR'])")
    for rank in range(4):
        assert f"rank {rank}: ({rank}, 4, 'gloo', '{rank}', '{rank}', '4', '0', '127.0.0.1')" in r.result


DDP = """%%on_mesh
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)                       # same initial weights everywhere (DDP checks)
model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
g = torch.Generator().manual_seed(100 + rank)   # each rank its own data
xs, ys = torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)
losses = []
for step in range(5):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(xs), ys)
    loss.backward()                        # gradients all-reduced across the 4 ranks
    opt.step()
    losses.append(round(loss.item(), 6))
weights = [round(float(p.sum()), 5) for p in model.parameters()]
weights
"""


def test_ddp_in_cells_keeps_every_ranks_weights_identical(k):
    r = k.ok(DDP, timeout=120)
    lines = [line.split(": ", 1)[1] for line in r.result.splitlines()[1:]]
    assert len(lines) == 4 and len(set(lines)) == 1, r.result   # synchronised by the all-reduce
    losses = k.ok("%%on_mesh\nlosses").result
    per_rank = [eval(line.split(": ", 1)[1]) for line in losses.splitlines()[1:]]
    assert all(run[-1] < run[0] for run in per_rank), losses       # each rank's loss falls


def test_fsdp2_in_a_cell_shards_the_parameters_over_the_group(k):
    r = k.ok("%%on_mesh\nimport torch\nfrom torch.distributed.fsdp import fully_shard\ntorch.manual_seed(0)\n"
             "net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))\n"
             "fully_shard(net)\nw = next(net.parameters())\nloss = net(torch.ones(2, 8)).sum()\nloss.backward()\n"
             "(type(w).__name__, tuple(w.to_local().shape), round(loss.item(), 4))", timeout=120)
    values = [line.split(": ", 1)[1] for line in r.result.splitlines()[1:]]
    assert len(set(values)) == 1 and values[0].startswith("('DTensor', (4, 8),"), r.result


def test_a_rank_killed_in_all_reduce_fails_the_cell_on_every_rank_and_respawn_forms_a_new_group(k):
    t0 = time.monotonic()
    r = k.run("%%on_mesh\nimport os, torch, torch.distributed as dist\nx = torch.ones(1 << 16)\n"
              "for i in range(10 ** 6):\n    if rank == 3 and i == 20:\n        os.kill(os.getpid(), 9)\n"
              "    dist.all_reduce(x)\n", timeout=90)
    took = time.monotonic() - t0
    assert r.status == "error" and took < 30, (r.status, took)
    text = r.error["evalue"] + "\n".join(r.error["traceback"])
    assert "rank 3" in text
    # The survivors are not left in a collective: the next cell runs at once and they are idle.
    busy = k.ok("%%on_mesh --ranks 0:3\nimport torch.distributed as dist\ndist.get_rank()", timeout=30)
    assert "rank 2: 2" in busy.result
    r = k.ok("mesh.respawn()", timeout=120)
    assert "ranks [3] were respawned" in r.stdout and "new process group" in r.stdout
    assert "Collectives in flight when they died failed" in r.stdout
    r = k.ok("%%on_mesh\nimport torch, torch.distributed as dist\ny = torch.ones(2)\ndist.all_reduce(y)\n"
             "y.tolist()", timeout=60)
    assert r.result.count("[4.0, 4.0]") == 4


def test_distributed_tensor_handles_from_the_notebook(k):
    k.ok("import torch\nfrom monarch_kernel.tensor import Shard, fetch_shard, inspect\n"
         "x = torch.arange(16.).reshape(8, 2)\ndt = mesh.distribute(x, placements=[Shard(0)])", timeout=60)
    assert k.value("torch.equal((dt @ dt.T).full_tensor(), x @ x.T)") is True
    r = k.ok("dt")
    html = r.data()[0]["data"]["text/html"]
    assert "placements <code>[Shard(0)]</code>" in html and "<b>rank 3</b>" in html and "[6:8, :]" in html
    r = k.ok("%mesh pull dt")
    assert "rank 1: tensor([[4., 5.]," in r.result
