"""Jobs on a cluster: SlurmJob on the two-node test cluster (tests/slurm_cluster.py, each
node its own network namespace), and ProcessJob for comparison.

  sudo .venv/bin/python bench/bench_jobs.py [--runs 3]

Figures (one JSON line each, the shared record format; median of --runs):
  slurm_state_s             job.state(): sbatch to both agents attached
  slurm_first_reply_s       job.state() + spawn 2 nodes x 2 procs + first actor reply (goal <= 1.5 s)
  slurm_node_loss_s         a node's link down to the failed future of a call on it (goal <= 5 s)
  slurm_reattach_s          a new process: state() re-attaching + the first reply of an existing actor (<= 1 s)
  slurm_kill_s              kill() to nothing queued and no agent left (goal <= 2 s)
  Where the first reply's time goes (node-side timestamps from each node's report; the
  two "nodes" share this machine's cores, so their zygotes import torch side by side):
  slurm_submit_to_nodes_s   sbatch to the last node's starter running (Slurm: schedule, batch step, srun):
  slurm_submit_to_batch_s   ... of which sbatch to the batch script running (scheduling)
  slurm_batch_to_nodes_s    ... and the batch script to the last node's starter (the srun step)
  slurm_node_to_agent_s     a node's starter running to its agent ready and reported (slowest node)
  slurm_agents_to_state_s   the last report to state() returning (attach)
  slurm_state_to_reply_s    state() returning to the first reply: the zygotes' torch import, fork, spawn
  slurm_node_to_zygote_s    the last node's starter running to its zygote forked (it imports at once; the
                            starter reports when it forked it; before that report, estimated from the
                            agents' logs in log_dir, ms stamps): the node starter, then the agent, start it
  slurm_zygote_preload_s    the slowest zygote's preload (torch, the runtime, IPython.display)
  slurm_first_reply_1node_s the same first reply from 1 node x 2 procs: one zygote on the machine's cores,
                            as each real node has its own
  slurm_first_reply_no_torch_s  the same first reply with MONARCH_KERNEL_NO_TORCH=1 (zygotes skip torch):
                            what the orchestration costs without the per-node torch import
  slurm_salloc_state_s      SlurmJob(allocation="salloc"): salloc --no-shell + srun, to both agents attached
  slurm_salloc_first_reply_s        ... to the first reply from 2 nodes x 2 procs (goal <= 1.5 s)
  slurm_salloc_first_torch_reply_s  ... to the first reply of an endpoint that uses torch (same procs)
  slurm_salloc_submit_to_nodes_s    salloc to the last node's starter running (allocation + srun step);
                            slurm_salloc_node_to_agent_s etc.: the same split as the sbatch run's
  slurm_salloc_kill_s       kill() to nothing queued and no agent left
  slurm_salloc_first_reply_no_torch_s  salloc, zygotes without torch (MONARCH_KERNEL_NO_TORCH=1)
  slurm_first_torch_reply_s the sbatch run's first reply of the torch endpoint
  The timeline of one start, each phase's time since the state() call (the last node's, where
  there are two), for sbatch (slurm_at_*) and salloc (slurm_salloc_at_*):
    *_at_accepted_s           sbatch returned the job id / salloc was granted the allocation
    *_at_running_s            the job runs: the batch script started (sbatch) / granted (salloc)
    *_at_step_started_s       the srun step started the last node's starter (python -m monarch_kernel.job.node)
    *_at_zygote_import_s      the last zygote began its imports (torch first): the starter forks it first
    *_at_agents_up_s          the last agent printed its address (it listens)
    *_at_agents_connected_s   the last node's report reached the controller's rendezvous
    *_at_state_s              state() returned: every agent attached (hello answered)
    *_at_zygotes_ready_s      the last zygote finished its preload (torch, the runtime, IPython.display)
    *_at_procs_spawned_s      spawn_procs() returned: 2 x 2 procs forked and registered
    *_at_first_reply_s        the first reply of a trivial endpoint (actors spawned)
    *_at_first_torch_reply_s  the first reply of an endpoint that uses torch (torch.ones(4).sum())
  process_first_reply_s     the same first reply with ProcessJob (local agent processes)
  k8s_fake_state_s          KubernetesJob on the FAKE API server (tests/fake_k8s.py): pods created to
                            both agents attached
  k8s_fake_first_reply_s    ... to the first reply from 2 pods x 2 procs
  k8s_fake_running_to_reply_s  from both pods Running to that first reply
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from _home import private_dir

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))
private_dir("MONARCH_KERNEL_HOME", "mk-bench-jobs-")
from _common import common  # noqa: E402

emit = common.emit

REATTACH = """
import json, sys, time
t0 = time.perf_counter()
from monarch_kernel.job import SlurmJob
job = SlurmJob(meshes={"hosts": 2}, log_dir=sys.argv[1])   # the same spec, so the same cached job
pm = job.state().hosts.proc_mesh("procs")
pm.actor_mesh("where").host.call().get(timeout=30)
print(json.dumps(time.perf_counter() - t0))
job.disconnect()
"""


def _actor():
    from monarch_kernel.actor import Actor, endpoint

    class Where(Actor):
        @endpoint
        def host(self) -> str:
            import socket

            return socket.gethostname()

        @endpoint
        def sleep(self, s: float) -> float:
            time.sleep(s)
            return s

        @endpoint
        def torch_sum(self) -> float:
            import torch

            return float(torch.ones(4).sum())

    return Where


def _agents_left(pids) -> int:
    left = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                left += f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            pass
    return left


def slurm_run(cluster, Where) -> dict:
    from monarch_kernel.actor import SupervisionError
    from monarch_kernel.job import SlurmJob

    out = {}
    logs = tempfile.mkdtemp(prefix="mk-bench-slurm-logs-")
    job = SlurmJob(meshes={"hosts": 2}, log_dir=logs)
    marks: dict[str, float] = {}
    t0, w0 = time.perf_counter(), time.time()
    state = job.state(progress=_marking(marks))
    out["slurm_state_s"] = time.perf_counter() - t0
    w_state = marks["state"] = time.time()
    procs = state.hosts.spawn_procs(per_host={"gpus": 2})
    marks["procs_spawned"] = time.time()
    where = procs.spawn("where", Where)
    where.host.call().get(timeout=60)
    out["slurm_first_reply_s"] = time.perf_counter() - t0
    w_reply = marks["first_reply"] = time.time()
    where.torch_sum.call().get(timeout=60)
    out["slurm_first_torch_reply_s"] = time.perf_counter() - t0
    marks["first_torch_reply"] = time.time()
    out.update(_breakdown(job._agents, w0, w_state, w_reply))
    zygotes = _zygotes(os.path.join(logs, f"monarch-{job.job_id}.out"), job._agents)
    out.update(_timeline("slurm", w0, marks, job._agents, zygotes))
    out.update({k: v for k, v in zygotes.items() if not k.startswith("_")})
    job.disconnect()
    r = subprocess.run([sys.executable, "-c", REATTACH, logs], capture_output=True, text=True, timeout=120, cwd=ROOT)
    out["slurm_reattach_s"] = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else None
    where = job.state().hosts.proc_mesh("procs").actor_mesh("where")
    fut = where.slice(hosts=1).sleep.call(30)
    time.sleep(0.3)
    cluster.link("n2", up=False)
    t0 = time.perf_counter()
    try:
        fut.get(timeout=30)
    except SupervisionError:
        out["slurm_node_loss_s"] = time.perf_counter() - t0
    cluster.link("n2", up=True)
    pids = [a["pid"] for a in job._agents]
    t0 = time.perf_counter()
    job.kill()
    while cluster.queue() or _agents_left(pids):
        time.sleep(0.01)
    out["slurm_kill_s"] = time.perf_counter() - t0
    return out


def _breakdown(agents: list[dict], w0: float, w_state: float, w_reply: float) -> dict:
    ts = [a.get("t") or {} for a in agents]
    if not all("node_started" in t and "reported" in t for t in ts):
        return {}
    out = {}
    if all("batch_started" in t for t in ts):   # Slurm's part: scheduling, then the srun step
        out = {"slurm_submit_to_batch_s": min(t["batch_started"] for t in ts) - w0,
               "slurm_batch_to_nodes_s": max(t["node_started"] for t in ts) - min(t["batch_started"] for t in ts)}
    return {**out, "slurm_submit_to_nodes_s": max(t["node_started"] for t in ts) - w0,
            "slurm_node_to_agent_s": max(t["reported"] - t["node_started"] for t in ts),
            "slurm_agents_to_state_s": w_state - max(t["reported"] for t in ts),
            "slurm_state_to_reply_s": w_reply - w_state}


def _marking(marks: dict):
    """A progress callback that notes when the scheduler accepted the job and when squeue
    first said it runs."""
    def progress(line: str) -> None:
        now = time.time()
        if ("submitted" in line or "allocated" in line) and "accepted" not in marks:
            marks["accepted"] = now
        if "allocated" in line:
            marks.setdefault("running", now)   # an interactive allocation runs once granted
    return progress


def _timeline(prefix: str, w0: float, marks: dict, agents: list[dict], zygotes: dict) -> dict:
    """Each phase of one start as seconds since the state() call (the last node's)."""
    ts = [a.get("t") or {} for a in agents]
    at = dict(marks)
    if all("batch_started" in t for t in ts):   # sbatch: the job runs once its batch script does
        at["running"] = min(t["batch_started"] for t in ts)
    for phase, key in (("step_started", "node_started"), ("agents_up", "agent_ready"),
                       ("agents_connected", "reported")):
        if ts and all(key in t for t in ts):
            at[phase] = max(t[key] for t in ts)
    if "_began" in zygotes:
        at["zygote_import"], at["zygotes_ready"] = zygotes["_began"], zygotes["_ready"]
    if ts and all("zygote_started" in t for t in ts):   # the starter's own stamp of the fork
        at["zygote_import"] = max(t["zygote_started"] for t in ts)
    order = ("accepted", "running", "step_started", "zygote_import", "agents_up", "agents_connected", "state",
             "zygotes_ready", "procs_spawned", "first_reply", "first_torch_reply")
    return {f"{prefix}_at_{p}_s": at[p] - w0 for p in order if p in at}


def _zygotes(log: str, agents: list[dict]) -> dict:
    """From the nodes' agent logs (log_dir): when each zygote began its preload (torch, the
    runtime) and how long that took, i.e. "zygote ready (preload X s)" minus X."""
    import datetime
    import re

    seen: list[tuple[float, float]] = []
    deadline = time.time() + 5
    while len(seen) < len(agents) and time.time() < deadline:
        seen = []
        with open(log) as f:
            for line in f:
                m = re.match(r"(\S+ \S+),(\d+) agent INFO zygote ready \(preload ([\d.]+) s\)", line)
                if m:
                    ready = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").timestamp() + \
                        int(m.group(2)) / 1000
                    seen.append((ready - float(m.group(3)), float(m.group(3))))
        time.sleep(0.05)
    ts = [a.get("t") or {} for a in agents]
    if len(seen) < len(agents) or not all("node_started" in t for t in ts):
        return {}
    # the ms-resolution log stamp; the last node up against the last zygote to start
    # "ready" minus the preload is when it began, if nothing runs between the preload and
    # "ready" (the zygote now freezes its objects there, ~0.13 s): the starter's stamp wins
    began = max(t["zygote_started"] for t in ts) if all("zygote_started" in t for t in ts) else \
        max(s for s, _ in seen)
    return {"slurm_node_to_zygote_s": began - max(t["node_started"] for t in ts),
            "slurm_zygote_preload_s": max(p for _, p in seen),
            "_began": max(s for s, _ in seen), "_ready": max(s + p for s, p in seen)}


def slurm_salloc_run(cluster, Where, torch: bool = True) -> dict:
    """SlurmJob(allocation="salloc"): an interactive allocation, granted in the request."""
    from monarch_kernel.job import SlurmJob

    if not torch:
        os.environ["MONARCH_KERNEL_NO_TORCH"] = "1"   # srun passes it to the nodes' zygotes
    try:
        logs = tempfile.mkdtemp(prefix="mk-bench-salloc-logs-")
        job = SlurmJob(meshes={"hosts": 2}, allocation="salloc", name=f"bench-salloc-{int(torch)}", log_dir=logs)
        marks: dict[str, float] = {}
        t0, w0 = time.perf_counter(), time.time()
        state = job.state(cached_path=None, progress=_marking(marks))
        took_state = time.perf_counter() - t0
        w_state = marks["state"] = time.time()
        procs = state.hosts.spawn_procs(per_host={"gpus": 2})
        marks["procs_spawned"] = time.time()
        where = procs.spawn("where", Where)
        where.host.call().get(timeout=60)
        first = time.perf_counter() - t0
        marks["first_reply"] = time.time()
        split = {k.replace("slurm_", "slurm_salloc_", 1): v
                 for k, v in _breakdown(job._agents, w0, w_state, marks["first_reply"]).items()}
        if torch:
            where.torch_sum.call().get(timeout=60)
            first_torch = time.perf_counter() - t0
            marks["first_torch_reply"] = time.time()
            zygotes = _zygotes(os.path.join(logs, f"monarch-{job.job_id}.out"), job._agents)
            split.update(_timeline("slurm_salloc", w0, marks, job._agents, zygotes))
            split.update({k.replace("slurm_", "slurm_salloc_", 1): v for k, v in zygotes.items()
                          if not k.startswith("_")})
        pids = [a["pid"] for a in job._agents]
        t1 = time.perf_counter()
        job.kill()
        while cluster.queue() or _agents_left(pids):
            time.sleep(0.01)
        took_kill = time.perf_counter() - t1
    finally:
        os.environ.pop("MONARCH_KERNEL_NO_TORCH", None)
    if not torch:
        return {"slurm_salloc_first_reply_no_torch_s": first}
    out = {"slurm_salloc_state_s": took_state, "slurm_salloc_first_reply_s": first,
           "slurm_salloc_first_torch_reply_s": first_torch, "slurm_salloc_kill_s": took_kill}
    return {**out, **split}


def slurm_one_node_run(Where) -> dict:
    """1 node x 2 procs: one zygote on this machine's 2 cores, as a real node has its own."""
    from monarch_kernel.job import SlurmJob

    job = SlurmJob(meshes={"hosts": 1}, name="bench-one-node")
    t0 = time.perf_counter()
    job.state(cached_path=None).hosts.spawn_procs(per_host={"gpus": 2}).spawn("where", Where) \
        .host.call().get(timeout=60)
    took = time.perf_counter() - t0
    job.kill()
    return {"slurm_first_reply_1node_s": took}


def slurm_no_torch_run(Where) -> dict:
    from monarch_kernel.job import SlurmJob

    os.environ["MONARCH_KERNEL_NO_TORCH"] = "1"   # sbatch exports it to the nodes' zygotes
    try:
        job = SlurmJob(meshes={"hosts": 2}, name="bench-no-torch")
        t0 = time.perf_counter()
        job.state(cached_path=None).hosts.spawn_procs(per_host={"gpus": 2}).spawn("where", Where) \
            .host.call().get(timeout=60)
        took = time.perf_counter() - t0
        job.kill()
    finally:
        del os.environ["MONARCH_KERNEL_NO_TORCH"]
    return {"slurm_first_reply_no_torch_s": took}


def process_run(Where) -> dict:
    from monarch_kernel.job import ProcessJob

    job = ProcessJob(meshes={"hosts": 2})
    t0 = time.perf_counter()
    where = job.state().hosts.spawn_procs(per_host={"gpus": 2}).spawn("where", Where)
    where.host.call().get(timeout=60)
    took = time.perf_counter() - t0
    job.kill()
    return {"process_first_reply_s": took}


def k8s_run(Where) -> dict:
    from fake_k8s import FakeKubernetes

    from monarch_kernel.job import ImageSpec, KubernetesJob

    with FakeKubernetes(use_netns=os.geteuid() == 0) as k8s:
        job = KubernetesJob(kubeconfig=k8s.kubeconfig).add_mesh("hosts", 2, image_spec=ImageSpec("fake/monarch:1"))
        running: list[float] = []
        t0 = time.perf_counter()
        state = job.state(progress=lambda line: running.append(time.perf_counter())
                          if "Running 2" in line and not running else None)
        took_state = time.perf_counter() - t0
        state.hosts.spawn_procs(per_host={"gpus": 2}).spawn("where", Where).host.call().get(timeout=60)
        end = time.perf_counter()
        job.kill()
    return {"k8s_fake_state_s": took_state, "k8s_fake_first_reply_s": end - t0,
            "k8s_fake_running_to_reply_s": end - running[0] if running else None}


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--only", choices=("slurm", "salloc", "process", "k8s"),
                   help="run one part (salloc: only the SlurmJob(allocation='salloc') figures)")
    a = p.parse_args(argv)
    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    Where = _actor()
    from slurm_cluster import SlurmCluster, unavailable

    runs: list[dict] = []
    why = unavailable() if a.only in (None, "slurm", "salloc") else "not asked for (--only)"
    if why:
        print(f"# no Slurm test cluster: {why}; Slurm figures skipped", file=sys.stderr)
    else:
        with SlurmCluster() as cluster:
            os.environ["SLURM_CONF"] = cluster.conf
            for _ in range(a.runs):
                if a.only != "salloc":
                    runs.append(slurm_run(cluster, Where))
                runs.append(slurm_salloc_run(cluster, Where))
                runs.append(slurm_salloc_run(cluster, Where, torch=False))
                if a.only != "salloc":
                    runs.append(slurm_no_torch_run(Where))
                    runs.append(slurm_one_node_run(Where))
    for _ in range(a.runs if a.only in (None, "process") else 0):
        runs.append(process_run(Where))
    try:
        import kubernetes  # noqa: F401

        for _ in range(a.runs if a.only in (None, "k8s") else 0):
            runs.append(k8s_run(Where))
    except ImportError:
        print("# no kubernetes client (pip install 'monarch-kernel[kubernetes]'); k8s figures skipped",
              file=sys.stderr)
    metrics: dict[str, list[float]] = {}
    for r in runs:
        for k, v in r.items():
            if v is not None:
                metrics.setdefault(k, []).append(v)
    for k, vs in metrics.items():
        emit(k, round(statistics.median(vs), 3), "s", n=len(vs), runs=[round(v, 3) for v in vs],
             best=round(min(vs), 3), load=round(os.getloadavg()[0], 1), machine=f"{os.cpu_count()} cores, shared")


if __name__ == "__main__":
    main()
