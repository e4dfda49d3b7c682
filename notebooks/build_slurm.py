"""Write notebooks/slurm.ipynb and store its outputs by running it against the Slurm test
cluster (tests/slurm_cluster.py: two nodes, each its own network namespace; needs root).

    .venv/bin/python notebooks/build_slurm.py

CI (tests/test_jobs_notebook.py) re-runs it with nbval against a fresh test cluster.
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import nbformat
from build import code, md
from nbformat.v4 import new_notebook

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

SLURM = [
    md("""# A mesh on a Slurm cluster

One cell asks Slurm for an allocation (`sbatch`), starts a host agent on each node (`srun`)
and spawns procs there. The progress line says what `squeue` says while the job waits.
Re-running the cell after a kernel restart re-attaches to the same job, procs and actors;
`%mesh stop` releases everything, `%mesh disconnect` leaves it running.

(In CI this runs against a real two-node Slurm cluster whose nodes are network namespaces
on one machine: `python tests/slurm_cluster.py` starts one.)"""),
    code('%mesh connect cluster --slurm "-N 2 --time 10:00" --procs 2', "nbval-ignore-output"),
    md("Cells run on every rank of both nodes; state stays on each rank."),
    code("%%on_mesh\nimport socket\nnode = socket.gethostname()\nf'{node}: rank {rank} of {world_size}'"),
    code("%%on_mesh --slice hosts=1\nnode"),
    md("`%mesh status` shows the job beside the procs (its id, state, nodes and time left)."),
    code("%mesh status", "nbval-ignore-output"),
    code("%mesh stop"),
    md("""## The same from Python: `SlurmJob`

A job holds one or more meshes, each a `HostMesh`; `job.state()` caches the job beside the
mesh connection files, so the same call in a restarted kernel re-attaches instead of
asking for a new allocation. `job.kill()` releases it."""),
    code("""from monarch_kernel.actor import Actor, endpoint
from monarch_kernel.job import SlurmJob

class Where(Actor):
    @endpoint
    def node(self) -> str:
        import socket
        return socket.gethostname()

job = SlurmJob(meshes={"trainers": 1, "loaders": 1}, time_limit="10:00")
state = job.state()
trainers = state.trainers.spawn_procs(per_host={"gpus": 2}).spawn("where", Where)
loaders = state.loaders.spawn_procs(per_host={"gpus": 1}).spawn("where", Where)
trainers.node.call().get().values(), loaders.node.call().get().values()"""),
    code("job.kill()\n!squeue -h | wc -l"),
]


def build() -> Path:
    from nbclient import NotebookClient
    from slurm_cluster import SlurmCluster

    nb = new_notebook(cells=SLURM)
    nb.metadata["kernelspec"] = {"name": "monarch", "display_name": "Monarch (Python 3)", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    home = tempfile.mkdtemp(prefix="mk-nb-")
    with SlurmCluster() as cluster:
        os.environ.update(MONARCH_KERNEL_HOME=home, MONARCH_KERNEL_PREWARM="0", SLURM_CONF=cluster.conf)
        NotebookClient(nb, kernel_name="monarch", timeout=120, allow_errors=True, store_widget_state=False,
                       resources={"metadata": {"path": str(HERE)}}).execute()
    path = HERE / "slurm.ipynb"
    nbformat.write(nb, path)
    return path


if __name__ == "__main__":
    print("wrote", build())
