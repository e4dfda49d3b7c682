"""``%mesh connect`` on a cluster: which job the flags ask for, and the scheduler's progress.

    %mesh connect NAME --hosts N                      N local hosts (a ProcessJob)
    %mesh connect NAME --job VAR                      a job object from the notebook
    %mesh connect NAME --slurm "-N 2 -p gpu --gpus-per-node 8" [--salloc]
    %mesh connect NAME --ssh gpu1,alice@gpu2:2222 [--ssh-args "-F cluster.conf -i ~/.ssh/id_gpu"]
    %mesh connect NAME --k8s NAMESPACE --image IMAGE --replicas N

The job is named after the mesh, so re-running the cell in a restarted kernel finds the
job cached under that name and re-attaches (same job id, procs and actors).
"""
from __future__ import annotations

import os
import shlex

from IPython.core.error import UsageError


def job_from_args(user_ns: dict, args, lease: float | None):
    """The job the connect flags describe, or None for a local mesh."""
    from ..job import JobTrait
    from .session import default_mesh_name

    name = args.name or default_mesh_name()
    ssh_args = getattr(args, "ssh_args", None)
    if ssh_args is not None and not getattr(args, "ssh", None):
        raise UsageError("%mesh connect: --ssh-args goes with --ssh HOST,HOST (with --job, give the job "
                         "SSHJob(ssh_args=...))")
    if getattr(args, "job", None):
        job = user_ns.get(args.job)
        if job is None:
            raise UsageError(f"%mesh connect --job {args.job}: no variable {args.job!r} in the notebook; make one, "
                             "e.g. job = SlurmJob(meshes={'hosts': 2}) from monarch_kernel.job")
        if not isinstance(job, JobTrait):
            raise UsageError(f"%mesh connect --job {args.job}: {args.job!r} is a {type(job).__name__}, not a job "
                             "from monarch_kernel.job (SlurmJob, ProcessJob, ...)")
        return job
    if getattr(args, "hosts", None) is not None:
        from ..job import ProcessJob

        if args.hosts < 1:
            raise UsageError(f"%mesh connect --hosts must be at least 1, got {args.hosts}")
        return ProcessJob({"hosts": args.hosts}, name=name, lease=lease)
    if getattr(args, "salloc", False) and getattr(args, "slurm", None) is None:
        raise UsageError("%mesh connect: --salloc goes with --slurm ARGS (with --job, give the job "
                         "SlurmJob(allocation='salloc'))")
    if getattr(args, "slurm", None) is not None:
        from ..job import SlurmJob

        nodes, rest = _nodes_from_sbatch_args(args.slurm)
        return SlurmJob(meshes={"hosts": nodes}, slurm_args=rest, name=name, lease=lease,
                        allocation="salloc" if getattr(args, "salloc", False) else "sbatch")
    if (getattr(args, "image", None) or getattr(args, "replicas", None)) and not getattr(args, "k8s", None):
        raise UsageError("%mesh connect: --image and --replicas go with --k8s NAMESPACE")
    if getattr(args, "k8s", None):
        from ..job import ImageSpec, KubernetesJob

        if not args.image:
            raise UsageError("%mesh connect --k8s NAMESPACE needs --image IMAGE (an image with monarch-kernel "
                             "installed) and optionally --replicas N")
        replicas = args.replicas or 1
        if replicas < 1:
            raise UsageError(f"%mesh connect --replicas must be at least 1, got {replicas}")
        return KubernetesJob(namespace=args.k8s, name=name, lease=lease).add_mesh(
            "hosts", replicas, image_spec=ImageSpec(args.image))
    if getattr(args, "ssh", None):
        from ..job import SSHJob

        hosts = [h.strip() for h in args.ssh.split(",") if h.strip()]
        if not hosts:
            raise UsageError("%mesh connect --ssh: name the hosts, e.g. --ssh gpu1,gpu2")
        try:
            options = [os.path.expanduser(w) for w in shlex.split(ssh_args or "")]   # as a shell would
        except ValueError as e:
            raise UsageError(f"%mesh connect --ssh-args {ssh_args!r}: {e}") from None
        return SSHJob(hosts=hosts, ssh_args=options, name=name, lease=lease)
    return None


def _nodes_from_sbatch_args(text: str) -> tuple[int, list[str]]:
    """``-N 2 -p gpu`` -> (2, ["-p", "gpu"]): the node count becomes the mesh's hosts."""
    try:
        words = shlex.split(text)
    except ValueError as e:
        raise UsageError(f"%mesh connect --slurm {text!r}: {e}") from None
    nodes, rest, i = 1, [], 0
    while i < len(words):
        w = words[i]
        value = None
        if w in ("-N", "--nodes"):
            if i + 1 >= len(words):
                raise UsageError(f"%mesh connect --slurm: {w} needs a node count")
            value, i = words[i + 1], i + 2
        elif w.startswith("--nodes="):
            value, i = w.split("=", 1)[1], i + 1
        elif w.startswith("-N") and len(w) > 2:
            value, i = w[2:], i + 1
        else:
            rest.append(w)
            i += 1
            continue
        if not value.isdigit() or int(value) < 1:
            raise UsageError(f"%mesh connect --slurm: the node count must be a number like -N 2, got {value!r} "
                             "(ranges such as 2-4 are not supported: a mesh has a fixed size)")
        nodes = int(value)
    return nodes, rest


def job_progress():
    """A one-line progress display the scheduler's news replaces in place (plain text, so
    it stays readable in a saved notebook); printed lines outside a kernel."""
    from IPython import get_ipython
    from IPython.display import display

    shell = get_ipython()
    state: dict = {}

    def update(text: str) -> None:
        if shell is None or getattr(shell, "kernel", None) is None:
            print(text, flush=True)
            return
        handle = state.get("handle")
        if handle is None:
            state["handle"] = display({"text/plain": text}, raw=True, display_id=True)
        else:
            handle.update({"text/plain": text}, raw=True)

    return update


def describe_job(job, mesh: str | None = None) -> str:
    """``slurm job 12 (RUNNING on n[1-2], time left 59:40)`` for ``%mesh status``; for a
    job of several meshes, which one the cells run on: ``..., mesh 'trainers' of trainers, loaders``."""
    of = f", mesh {mesh!r} of {', '.join(job.meshes)}" if mesh and len(job.meshes) > 1 else ""
    try:
        d = job.describe()
    except Exception as e:   # the scheduler may be unreachable; status still shows the procs
        return f"{job.kind} job {job.job_id} (state unknown: {e}){of}"
    extra = [d[k] for k in ("state",) if d.get(k)]
    if d.get("nodes"):
        extra.append(f"on {d['nodes']}")
    if d.get("time left"):
        extra.append(f"time left {d['time left']}")
    return f"{d.get('scheduler', job.kind)} job {d.get('id')}" + (f" ({' '.join(extra)})" if extra else "") + of
