"""Jobs: where a mesh's hosts come from (Monarch's ``monarch.job`` names).

    from monarch_kernel.job import SlurmJob
    job = SlurmJob(meshes={"trainers": 2}, partition="gpu")
    procs = job.state().trainers.spawn_procs(per_host={"gpus": 8})
    job.kill()

``state()`` caches the job beside the mesh connection files, so the same call in a
restarted kernel re-attaches to the same allocation, procs and actors (see base.py).
"""
from .base import JobError, JobGoneError, JobState, JobTrait, job_load
from .local import LocalJob, ProcessJob
from .slurm import SlurmJob

__all__ = ["JobTrait", "JobState", "JobError", "JobGoneError", "job_load", "LocalJob", "ProcessJob", "SlurmJob"]
