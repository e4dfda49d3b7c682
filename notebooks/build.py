"""Write the example notebooks and store their outputs by running them in the monarch kernel.

    .venv/bin/python notebooks/build.py            # all of them
    .venv/bin/python notebooks/build.py actors     # one

CI (tests/test_notebooks.py) re-runs them with nbval and compares against what this
stored; sanitize.cfg masks pids, times, host names and addresses only.
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent


def md(text):
    return new_markdown_cell(text.strip())


def code(text, *tags):
    """A code cell; nbval markers go in tags (a cell magic must stay on the first line)."""
    cell = new_code_cell(text.strip())
    if tags:
        cell.metadata["tags"] = list(tags)
    return cell


QUICKSTART = [
    md("""# Quickstart: a mesh from a notebook

`%mesh connect` starts a local mesh (one proc per GPU, else per core; here 4) or re-attaches
to it after a kernel restart. `%%on_mesh` runs a cell on every rank, in that rank's own
persistent namespace, where `rank`, `world_size` and `mesh` are predefined."""),
    code("%mesh connect quickstart --procs 4"),
    md("Output is labelled with its rank; the last expression comes back as a `ValueMesh`."),
    code("%%on_mesh\nimport torch\nx = torch.ones(2) * rank\nprint(f'x = {x.tolist()}')\nx.sum().item()"),
    md("State persists per rank. `--ranks` takes Monarch's rank grammar (`3`, `1,4,6`, `0:8:2`, `gpus=1:3`)."),
    code("%%on_mesh --ranks 1,3\nx.tolist()"),
    code("%on_mesh world_size"),
    md("`%mesh push` copies notebook variables to the ranks; `%mesh pull` brings one back."),
    code("lr = 0.5\n%mesh push lr"),
    code("%%on_mesh\nx = x - lr"),
    code("%mesh pull x --ranks 0:2"),
    md("`--out NAME` keeps the ValueMesh in the notebook."),
    code("%%on_mesh --out sums\nfloat(x.sum())"),
    code("sum(sums.values())"),
    md("`%mesh status` shows each proc: pid, state, CPU and memory."),
    code("%mesh status", "nbval-ignore-output"),   # CPU and memory vary from run to run
    code("%mesh stop"),
]

ACTORS = [
    md("""# Actors on the mesh

`%mesh connect` defines `mesh`, the `ProcMesh` the cells run on. Actors spawned on it live
in the same procs as the cells' namespaces."""),
    code("%mesh connect actors --procs 4"),
    code("""import torch
from monarch_kernel.actor import Actor, current_rank, endpoint


class Trainer(Actor):
    def __init__(self, lr: float):
        self.lr = lr
        self.w = torch.zeros(4)

    @endpoint
    def step(self, grad: torch.Tensor) -> float:
        self.w -= self.lr * grad * (current_rank().rank + 1)
        return round(float(self.w.sum()), 3)

    @endpoint
    def shared(self) -> object:
        from monarch_kernel.jupyter.cells import NAMESPACE
        return NAMESPACE.get("from_cell")


trainers = mesh.spawn("trainers", Trainer, lr=0.1)
trainers"""),
    md("`call` reaches every member and returns a `ValueMesh`; slicing narrows the mesh."),
    code("trainers.step.call(torch.ones(4)).get()"),
    code("trainers.slice(gpus=slice(0, 2)).step.call(torch.ones(4)).get()"),
    code("trainers.slice(gpus=3).step.call_one(torch.ones(4)).get()"),
    md("`stream` yields a Future per member as each arrives (as in Monarch); `.values()` yields the values (sorted here, since arrival order varies)."),
    code("sorted(trainers.step.stream(torch.zeros(4)).values())"),
    md("Cells and actors share the procs: an actor sees what a cell defined on its rank."),
    code("%%on_mesh\nfrom_cell = f'set by a cell on rank {rank}'"),
    code("trainers.shared.call().get()"),
    code("%mesh stop"),
]

FAILURES = [
    md("""# Failures

A raise on some ranks is reported once per distinct error, with the ranks that raised it
and the cell's own lines; the other ranks' values are kept in `_on_mesh`."""),
    code("%mesh connect failures --procs 4"),
    code("%%on_mesh\nbefore = rank\nif rank == 2:\n"
         "    raise ValueError('rank 2 does not like this')\nrank * 10", "raises-exception"),
    code("_on_mesh.values()"),
    md("The same error on every rank is shown once."),
    code("%%on_mesh\n1 / 0", "raises-exception"),
    md("""`--timeout S` interrupts every rank after S seconds, like the kernel's interrupt
button (which stops every rank within 2 s); the mesh stays usable."""),
    code("%%on_mesh --timeout 1\nwhile True:\n    pass", "raises-exception"),
    code("%on_mesh rank"),
    md("A proc that dies fails the cell at once with its rank and how it died."),
    code("%%on_mesh --ranks 3\nimport os, signal\n"
         "os.kill(os.getpid(), signal.SIGKILL)", "raises-exception"),
    code("mesh.dead_ranks()"),
    md("`respawn()` replaces dead procs; the other ranks keep their state, the new one starts empty."),
    code("mesh.respawn()\nmesh.dead_ranks()"),
    code("%on_mesh 'before' in globals()"),
    code("%mesh stop"),
]

DDP = [
    md("""# DDP on the mesh

`%mesh connect --dist` also gives every proc torchrun's environment (`RANK`, `WORLD_SIZE`,
`LOCAL_RANK`, `MASTER_ADDR`, ...) and a process group (gloo here, nccl where there is
CUDA), so `%%on_mesh` cells use `DistributedDataParallel` as a torchrun script would."""),
    code("%mesh connect ddp --procs 4 --dist"),
    code("""%%on_mesh
import os, torch, torch.distributed as dist
(os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"], dist.get_backend())"""),
    md("""A tiny model, the same initial weights everywhere, each rank its own batch. DDP
all-reduces the gradients in `backward()`; the loss shown is the mean over the 4 ranks
(an all-reduce too), so every rank prints the same falling curve."""),
    code("""%%on_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(rank)
xs = torch.randn(64, 8, generator=g)
ys = xs @ torch.linspace(-1, 1, 8).unsqueeze(1)   # a linear target the model can learn
curve = []
for step in range(30):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(xs), ys)
    loss.backward()
    opt.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    curve.append(round(mean.item() / world_size, 3))
curve[::6]"""),
    md("The weights stay identical on every rank:"),
    code("%%on_mesh\nround(sum(float(p.detach().sum()) for p in model.parameters()), 3)"),
    code("%mesh stop"),
]

TENSORS = [
    md("""# Distributed tensors from the notebook

`mesh.distribute(t, placements=[Shard(0)])` lays a tensor out over the ranks (each holds
its slice as a local DTensor) and returns a handle. Ops on handles run on every rank,
without waiting; `full_tensor()`, `inspect` and `fetch_shard` bring data back. The process
group is formed on first use."""),
    code("%mesh connect tensors --procs 4"),
    code("""import torch
from monarch_kernel.tensor import Replicate, Shard, fetch_shard, inspect

x = torch.arange(32.).reshape(8, 4)
dt = mesh.distribute(x, placements=[Shard(0)])
dt"""),
    md("`dt @ dt.T` runs on the ranks (DTensor does the collectives); it equals the local result."),
    code("y = dt @ dt.T\ntorch.equal(y.full_tensor(), x @ x.T)"),
    md("`inspect(t, gpus=i)` is rank i's shard now; `fetch_shard` is the same as a Future."),
    code("inspect(dt, gpus=1)"),
    code("fetch_shard(dt, gpus=3).get()"),
    md("A reduction: the sum is a `Partial` on the ranks until it is brought back."),
    code("s = (dt * 2).sum()\ns.placements, s.item(), (x * 2).sum().item()"),
    md("`%mesh pull` of a handle brings every rank's shard."),
    code("%mesh pull dt"),
    md("An op that fails on the ranks is reported at the next fetch, naming the op and the ranks; "
       "the mesh stays usable."),
    code("bad = torch.linalg.inv(mesh.distribute(torch.zeros(4, 4), placements=[Shard(0)]))\n"
         "bad.full_tensor()", "raises-exception"),
    code("(dt + 1).sum().item()"),
    code("%mesh stop"),
]

NOTEBOOKS = {"quickstart": QUICKSTART, "actors": ACTORS, "failures": FAILURES, "ddp": DDP, "tensors": TENSORS}


def build(name: str) -> Path:
    from nbclient import NotebookClient

    nb = new_notebook(cells=NOTEBOOKS[name])
    nb.metadata["kernelspec"] = {"name": "monarch", "display_name": "Monarch (Python 3)", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    home = tempfile.mkdtemp(prefix="mk-nb-")
    os.environ.update(MONARCH_KERNEL_HOME=home, MONARCH_KERNEL_PREWARM="0")
    NotebookClient(nb, kernel_name="monarch", timeout=120, allow_errors=True, store_widget_state=False,
                   resources={"metadata": {"path": str(HERE)}}).execute()
    path = HERE / f"{name}.ipynb"
    nbformat.write(nb, path)
    return path


if __name__ == "__main__":
    for n in sys.argv[1:] or list(NOTEBOOKS):
        print("wrote", build(n))
