"""``SlurmJob``: one ``sbatch`` allocation holding every mesh; ``srun`` starts one host
agent per node inside it (``python -m monarch_kernel.job.node``).

``SlurmJob(..., allocation="salloc")`` asks for an interactive allocation instead
(``salloc --no-shell``), which Slurm grants in the request itself rather than at its next
scheduling pass (a batch job waits for that pass: 0.05-1.05 s on a 1 s tick, and its
``srun`` step starts later still), and starts the agents with an ``srun`` the kernel
launches in a session of its own. The agents then live as long as that ``srun`` does:
it outlives a kernel restart, but not the machine the kernel runs on (a batch job's
agents do). When the agents end (lease, ``%mesh stop``), the allocation is cancelled.

The batch script goes to ``sbatch`` on stdin and the mesh key in its environment (Slurm
keeps a job's environment readable only by its owner and root), never on a command line.
Each node's agent reports its address to the kernel's rendezvous, so nothing needs a
shared file system. The kernel listens on the local address that routes to the
partition's nodes (``MONARCH_KERNEL_BIND`` overrides). While waiting, the progress line
says what ``squeue`` says; an interrupt or ``job_start_timeout`` cancels the request.
"""
from __future__ import annotations

import os
import re
import secrets
import shlex
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from monarch_kernel import config

from ..core.runtime import runtime
from .base import JobError, JobGoneError, JobTrait, Progress
from .rendezvous import Rendezvous, controller_ip

_RUNNING = {"RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED"}
_WAITING = {"PENDING", "CONFIGURING", "REQUEUED", "RESIZING"}
# Pending reasons Slurm keeps a job for although it can never start it as asked (on a
# cluster without EnforcePartLimits, sbatch accepts such a job): fail at once instead.
_NEVER = {"PartitionConfig", "PartitionNodeLimit", "BadConstraints", "InvalidAccount", "InvalidQOS",
          "PartitionDown", "PartitionInactive", "AssocMaxNodesPerJobLimit", "QOSMaxNodePerJobLimit"}


def _run(args: list[str], *, input: str | None = None, env: dict | None = None,
         timeout: float = 30.0) -> subprocess.CompletedProcess:
    # In a session of its own: a kernel's interrupt goes to its whole process group, and
    # must not end a scancel that kill() holds the interrupt off for (base.py).
    try:
        return subprocess.run(args, input=input, capture_output=True, text=True, env=env, timeout=timeout,
                              start_new_session=True)
    except FileNotFoundError:
        raise JobError(f"{args[0]} is not installed here: a SlurmJob runs where the Slurm client tools "
                       "(sbatch, squeue, scancel) are, e.g. a login node") from None


class SlurmJob(JobTrait):
    """``SlurmJob(meshes={"trainers": 2}, partition="gpu", gpus_per_node=8, time_limit="2:00:00")``."""

    kind = "slurm"

    def __init__(self, meshes: dict[str, int], python_exe: str = sys.executable, slurm_args=(),
                 job_name: str | None = None, time_limit: str | None = None, partition: str | None = None,
                 gpus_per_node: int | None = None, cpus_per_task: int | None = None, mem: str | None = None,
                 account: str | None = None, qos: str | None = None, log_dir: str | None = None,
                 job_start_timeout: float | None = None, allocation: str = "sbatch", *, name: str | None = None,
                 lease: float | None = None):
        if allocation not in ("sbatch", "salloc"):
            raise ValueError(f"allocation must be 'sbatch' (a batch job) or 'salloc' (an interactive allocation, "
                             f"granted at once), got {allocation!r}")
        self.allocation = allocation
        if isinstance(slurm_args, str):
            slurm_args = shlex.split(slurm_args)
        self.python_exe = python_exe
        self.slurm_args = list(slurm_args)
        self.job_name, self.time_limit, self.partition = job_name, time_limit, partition
        self.gpus_per_node, self.cpus_per_task, self.mem = gpus_per_node, cpus_per_task, mem
        self.account, self.qos, self.log_dir = account, qos, log_dir
        self.job_start_timeout = job_start_timeout
        super().__init__(meshes, name=name, lease=lease)

    def spec(self) -> dict:
        return {"meshes": self._meshes, "python_exe": self.python_exe, "slurm_args": self.slurm_args,
                "job_name": self.job_name, "time_limit": self.time_limit, "partition": self.partition,
                "gpus_per_node": self.gpus_per_node, "cpus_per_task": self.cpus_per_task, "mem": self.mem,
                "account": self.account, "qos": self.qos, "log_dir": self.log_dir,
                "job_start_timeout": self.job_start_timeout,
                **({"allocation": self.allocation} if self.allocation != "sbatch" else {})}

    # ------------------------------------------------------------------ sbatch
    def _resource_args(self) -> list[str]:
        total = sum(self._meshes.values())
        args = [f"--job-name={self.job_name or self.name}", f"--nodes={total}", "--ntasks-per-node=1"]
        for flag, value in (("--time", self.time_limit), ("--partition", self.partition),
                            ("--gpus-per-node", self.gpus_per_node), ("--cpus-per-task", self.cpus_per_task),
                            ("--mem", self.mem), ("--account", self.account), ("--qos", self.qos)):
            if value is not None:
                args.append(f"{flag}={value}")
        return args

    def sbatch_args(self) -> list[str]:
        out = os.path.join(self.log_dir, "monarch-%j.out") if self.log_dir else "/dev/null"
        return ["sbatch", "--parsable", *self._resource_args(), f"--output={out}", *self.slurm_args]

    def salloc_args(self) -> list[str]:
        return ["salloc", "--no-shell", *self._resource_args(), *self.slurm_args]

    def _node_command(self, report: str, token: str) -> list[str]:
        return [self.python_exe, "-m", "monarch_kernel.job.node", "--report", report, "--token", token,
                "--lease", str(self.lease), "--name", self.name]

    def batch_script(self, report: str, token: str) -> str:
        node = self._node_command(report, token)
        return ("#!/bin/sh\n# monarch-kernel: one host agent per node; the job ends when they do.\n"
                f"exec srun --ntasks-per-node=1 --kill-on-bad-exit=0 {shlex.join(node)} "
                '--batch-started "$(date +%s.%N)"\n')

    def _create(self, key: bytes, progress: Progress) -> list[dict]:
        total = sum(self._meshes.values())
        ip = controller_ip(self._node_address())
        if ip != "127.0.0.1":
            runtime().listen_on(ip)
        token = secrets.token_hex(8)
        rv = Rendezvous(ip, key, token)
        try:
            env = dict(os.environ, MONARCH_KERNEL_KEY=key.hex())
            submitted = time.time()
            if self.allocation == "salloc":
                self._salloc(env, rv, token, total, progress)
                return self._wait_for_agents(rv, total, progress, submitted)
            r = _run(self.sbatch_args(), input=self.batch_script(rv.address, token), env=env)
            if r.returncode != 0:
                raise JobError(f"sbatch refused job {self.name!r}: {r.stderr.strip() or r.stdout.strip()}")
            job_id = r.stdout.strip().split(";")[0]
            self._handle = {"id": job_id}
            progress(f"slurm job {job_id}: submitted")
            return self._wait_for_agents(rv, total, progress, submitted)
        finally:
            rv.close()

    # ------------------------------------------------------------------ salloc
    def _salloc(self, env: dict, rv: Rendezvous, token: str, total: int, progress: Progress) -> None:
        """Ask for an interactive allocation (granted in the request when the nodes are
        free), then start the agents in it with an ``srun`` in a session of its own, so that
        a kernel restart does not end it; when that step ends, the allocation is cancelled."""
        # A kernel that runs inside a Slurm job of its own (a notebook server started by sbatch,
        # Open OnDemand) has that job's SLURM_* variables, which srun reads as its defaults
        # (SLURM_NTASKS, SLURM_CPUS_PER_TASK, ...): the step would not fit the new allocation.
        env = {k: v for k, v in env.items() if not k.startswith("SLURM_") or k in ("SLURM_CONF", "SLURM_CLUSTERS")}
        try:
            # not the key: salloc runs no command, only the srun below needs it
            proc = subprocess.Popen(self.salloc_args(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE, text=True, start_new_session=True,
                                    env={k: v for k, v in env.items() if k != config.KEY.env})
        except FileNotFoundError:
            raise JobError("salloc is not installed here: a SlurmJob runs where the Slurm client tools "
                           "(salloc, srun, squeue, scancel) are, e.g. a login node") from None
        self._salloc_proc = proc
        lines: list[str] = []
        got_id = threading.Event()

        def read():
            for line in proc.stderr:
                lines.append(line.rstrip())
                m = re.search(r"job allocation (\d+)|job (\d+) queued", line)
                if m and not got_id.is_set():
                    self._handle = {"id": m.group(1) or m.group(2)}
                    got_id.set()

        reader = threading.Thread(target=read, name="monarch-salloc", daemon=True)
        reader.start()
        start, last_line, asked_at = time.monotonic(), "", 0.0
        while proc.poll() is None:
            got_id.wait(0.02)
            now = time.monotonic()
            if got_id.is_set() and now - asked_at >= 0.5:
                asked_at = now
                st = self._squeue() or {}
                if st.get("state") in _WAITING:
                    if st["reason"] in _NEVER:
                        raise JobError(f"slurm job {self.job_id} cannot start as asked ({st['reason']}: more nodes, "
                                       "time or resources than the partition allows?); it was cancelled")
                    why = f" ({st['reason']})" if st["reason"] not in ("", "None") else ""
                    line = f"slurm job {self.job_id}: queued{why}"
                    if line != last_line:
                        progress(line)
                        last_line = line
                    if self.job_start_timeout is not None and now - start > self.job_start_timeout:
                        raise JobError(f"slurm job {self.job_id} was still pending after {self.job_start_timeout:g} "
                                       f"s ({st['reason']}); it was cancelled. Raise job_start_timeout or ask for "
                                       "fewer or other nodes")
        reader.join(5)
        if proc.returncode != 0 or not got_id.is_set():
            errs = [ln for ln in lines if "error" in ln.lower()] or lines
            raise JobError(f"salloc refused job {self.name!r}: {' '.join(errs).strip() or f'exit {proc.returncode}'}")
        progress(f"slurm job {self.job_id}: allocated; starting the agents")
        out = open(os.path.join(self.log_dir, f"monarch-{self.job_id}.out"), "ab") if self.log_dir else \
            subprocess.DEVNULL
        srun = ["srun", f"--jobid={self.job_id}", f"--nodes={total}", "--ntasks-per-node=1", "--kill-on-bad-exit=0",
                "--input=none", *self._node_command(rv.address, token), "--scancel-at-end"]
        try:
            # sh holds the step and cancels the allocation once it ends; the key is in the
            # environment (as with sbatch), not on a command line. It ignores SIGTERM and SIGHUP:
            # when this machine shuts down, srun cancels the step on its SIGTERM and Slurm kills
            # the agents before a node can cancel the allocation; the sh must live to do it.
            launcher = subprocess.Popen(["sh", "-c", 'trap "" TERM HUP; j=$1; shift; srun "$@"; '
                                         'exec scancel --quiet "$j"', "sh",
                                         self.job_id, *srun[1:]], stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                        start_new_session=True, env=env, close_fds=True)
        finally:
            if out is not subprocess.DEVNULL:
                out.close()
        # Reaped when it ends (the lease, kill(), scancel from outside), not left a zombie of
        # the kernel until its next subprocess call.
        self._launcher = threading.Thread(target=launcher.wait, name=f"monarch-salloc-{self.job_id}", daemon=True)
        self._launcher.start()

    def _wait_for_agents(self, rv: Rendezvous, total: int, progress: Progress, submitted: float) -> list[dict]:
        """Collect the nodes' reports as they come, while squeue (on a thread, so a slow
        squeue never holds a report back) says what the job is doing."""
        start = time.monotonic()
        reports: dict[int, dict] = {}
        last_line, st = "", {}
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="monarch-squeue")
        try:
            asked, asked_at = pool.submit(self._squeue), time.monotonic()
            while len(reports) < total:
                for rep in rv.poll(0.05):
                    if rep.get("error"):
                        raise JobError(f"slurm job {self.job_id}: {rep['error']}")
                    reports[int(rep["rank"])] = rep
                now = time.monotonic()
                if asked is not None and asked.done():
                    st = asked.result()   # JobError: Slurm unreachable
                    asked = None
                    if st is None:
                        raise JobGoneError(f"slurm job {self.job_id} ended before its agents started (see its log: "
                                           f"{self.log_dir or 'pass log_dir= to keep one'})")
                    if st["state"] not in _RUNNING | _WAITING:
                        raise JobGoneError(f"slurm job {self.job_id} is {st['state']} ({st['reason']}) before its "
                                           "agents started")
                    if st["state"] in _WAITING and st["reason"] in _NEVER:
                        raise JobError(f"slurm job {self.job_id} cannot start as asked ({st['reason']}: more nodes, "
                                       "time or resources than the partition allows?); it was cancelled")
                if asked is None and now - asked_at >= 0.5:
                    asked, asked_at = pool.submit(self._squeue), now
                if not st:
                    continue
                if st["state"] in _WAITING:
                    why = f" ({st['reason']})" if st["reason"] not in ("", "None") else ""
                    line = f"slurm job {self.job_id}: queued{why}"
                    if self.job_start_timeout is not None and now - start > self.job_start_timeout:
                        raise JobError(f"slurm job {self.job_id} was still pending after {self.job_start_timeout:g} s "
                                       f"({st['reason']}); it was cancelled. Raise job_start_timeout or ask for "
                                       "fewer or other nodes")
                else:
                    line = f"slurm job {self.job_id}: running on {st['nodes']}; nodes up {len(reports)}/{total}"
                if line != last_line:
                    progress(line)
                    last_line = line
        finally:
            pool.shutdown(wait=False)   # an squeue still running ends on its own; nobody waits for it
        agents = []
        ranks = sorted(reports)
        for mesh, n in self._meshes.items():
            for i in range(n):
                rep = reports[ranks[len(agents)]]
                agents.append({"addr": rep["addr"], "host": rep["host"], "pid": rep["pid"], "mesh": mesh,
                               "rank": i, "t": {"submitted": submitted, **(rep.get("t") or {})}})
        return agents

    def _node_address(self) -> str:
        """An address of one of the partition's nodes: the kernel listens where it routes."""
        if config.BIND.get():
            return config.BIND.get()
        r = _run(["sinfo", "-h", "-N", "-o", "%o", *([f"--partition={self.partition}"] if self.partition else [])])
        addrs = r.stdout.split() if r.returncode == 0 else []
        if not addrs:   # no such partition: any node will do; sbatch then says what is wrong
            r = _run(["sinfo", "-h", "-N", "-o", "%o"])
            addrs = r.stdout.split() if r.returncode == 0 else []
        if not addrs:
            raise JobError(f"sinfo lists no Slurm nodes ({r.stderr.strip() or 'none'}); is the cluster up? "
                           "Set MONARCH_KERNEL_BIND to this machine's address on the cluster network")
        return addrs[0]

    # ------------------------------------------------------------------ squeue / scancel
    def _squeue(self) -> dict | None:
        """The job as squeue sees it, or None when Slurm no longer knows it."""
        r = _run(["squeue", "-h", "-j", str(self.job_id), "-o", "%T|%r|%N|%L"])
        line = r.stdout.strip().splitlines()
        if r.returncode != 0 and "Invalid job id" not in r.stderr:
            # Slurm unreachable is not "the job ended": say so instead of giving the job up
            why = r.stderr.strip() or f"squeue exit {r.returncode}"
            raise JobError(f"cannot ask Slurm about job {self.job_id}: {why}")
        if r.returncode != 0 or not line:
            return None
        state, reason, nodes, left = (line[0].split("|") + ["", "", "", ""])[:4]
        return {"state": state, "reason": reason, "nodes": nodes, "time_left": left}

    def _gone_reason(self) -> str | None:
        st = self._squeue()
        if st is None:
            return f"slurm job {self.job_id} has ended (squeue no longer lists it)"
        if st["state"] not in _RUNNING:
            return f"slurm job {self.job_id} is {st['state']}" + (f" ({st['reason']})" if st["reason"] not in
                                                                   ("", "None") else "")
        return None

    def _release(self) -> None:
        proc = self.__dict__.pop("_salloc_proc", None)
        if proc is not None and proc.poll() is None:   # still pending: salloc revokes its request
            proc.terminate()
        if not self.job_id:
            if proc is not None:
                proc.wait(10)
            return
        r = _run(["scancel", str(self.job_id)])
        if proc is not None:
            try:
                proc.wait(5)   # salloc says the request was revoked, and is reaped
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if r.returncode != 0 and "Invalid job id" not in r.stderr:
            raise JobError(f"scancel {self.job_id} failed: {r.stderr.strip()}")
        deadline = time.monotonic() + 10
        st = None
        while time.monotonic() < deadline:
            try:
                st = self._squeue()
            except JobError:
                time.sleep(0.2)
                continue
            if st is None or st["state"] not in _RUNNING | _WAITING:
                launcher = self.__dict__.pop("_launcher", None)
                if launcher is not None:   # the step's srun ends with the job, then its sh
                    launcher.join(max(0.0, deadline - time.monotonic()))
                return
            time.sleep(0.05)
        raise JobError(f"slurm job {self.job_id} still {st['state'] if st else 'unknown to squeue'} 10 s after scancel")

    def describe(self) -> dict:
        st = self._squeue() if self.job_id else None
        return {"scheduler": "slurm", "id": self.job_id, "hosts": len(self._agents),
                "state": st["state"] if st else "gone", "nodes": st["nodes"] if st else "",
                "time left": st["time_left"] if st else ""}
