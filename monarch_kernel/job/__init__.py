"""Jobs: where a mesh's hosts come from (Monarch's ``monarch.job`` names).

    from monarch_kernel.job import SlurmJob
    job = SlurmJob(meshes={"trainers": 2}, partition="gpu")
    procs = job.state().trainers.spawn_procs(per_host={"gpus": 8})
    job.kill()

``state()`` caches the job beside the mesh connection files, so the same call in a
restarted kernel re-attaches to the same allocation, procs and actors (see base.py).
Names load on first use: ``python -m monarch_kernel.job.node`` on a node imports none
of the controller side.
"""
from __future__ import annotations

import importlib

_WHERE = {"JobTrait": "base", "JobState": "base", "JobError": "base", "JobGoneError": "base",
          "JobInterrupted": "base",
          "job_load": "base", "cached_job": "base",
          "LocalJob": "local", "ProcessJob": "local", "SlurmJob": "slurm",
          "SSHJob": "ssh",
          "KubernetesJob": "kubernetes", "ImageSpec": "kubernetes"}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"monarch_kernel.job has no {name!r}; it has {', '.join(__all__)}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
