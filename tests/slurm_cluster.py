"""A real two-node Slurm cluster on this machine, each node its own host.

munged, slurmctld and one slurmd per node, each slurmd in its own network namespace with
its own address and hostname on a bridge whose address is the controller's (the kernel's
side). Daemons run in the foreground, so they are ours to stop by pid; the namespaces, the
bridge and the veths carry a random suffix and are deleted on stop. Needs root, iproute2,
nsenter/unshare and slurm-wlm (scripts/setup.sh installs it): ``unavailable()`` says what
is missing, for a skip reason.

    with SlurmCluster() as c:          # c.env has SLURM_CONF for sbatch/squeue/scancel
        c.link("n2", up=False)         # cut node n2 off the network

Also runnable: ``python tests/slurm_cluster.py`` brings one up until Enter (for notebooks).
"""
from __future__ import annotations

import os
import random
import secrets
import shutil
import socket
import subprocess
import tempfile
import time

from netns_hosts import BridgedHosts

TOOLS = ("ip", "nsenter", "unshare", "munged", "slurmctld", "slurmd", "sbatch", "squeue", "scancel", "sinfo")


def unavailable() -> str | None:
    """Why a cluster cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, Slurm daemons)"
    missing = [t for t in TOOLS if not shutil.which(t)]
    if missing:
        return f"missing {', '.join(missing)} (scripts/setup.sh installs slurm-wlm and munge)"
    return None


class SlurmCluster:
    def __init__(self, nodes: int = 2, cpus: int = 4):
        self.n, self.cpus = nodes, cpus
        self.net = BridgedHosts([f"n{i}" for i in range(1, nodes + 1)])
        self.tag, self.bridge_ip, self.node_ip = self.net.tag, self.net.bridge_ip, self.net.ip
        self.dir = tempfile.mkdtemp(prefix="mk-slurm-")
        self.conf = os.path.join(self.dir, "slurm.conf")
        self.env = dict(os.environ, SLURM_CONF=self.conf)
        self.procs: list[subprocess.Popen] = []
        self.node_procs: dict[str, subprocess.Popen] = {}

    # ------------------------------------------------------------------ bring-up
    def __enter__(self) -> SlurmCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc):
        self.stop()

    def start(self) -> None:
        self.net.open()
        d = self.dir
        key = os.path.join(d, "munge.key")
        with open(key, "wb") as f:
            f.write(secrets.token_bytes(1024))
        os.chmod(key, 0o400)
        self.munge_socket = os.path.join(d, "munge.sock")
        # Daemons must not carry the tests' MONARCH_KERNEL_HOME: the orphan check would count them.
        denv = {k: v for k, v in os.environ.items() if not k.startswith("MONARCH_")}
        denv["SLURM_CONF"] = self.conf
        self.procs.append(subprocess.Popen(
            ["munged", "-F", "--force", f"--socket={self.munge_socket}", f"--key-file={key}",
             f"--pid-file={d}/munged.pid", f"--log-file={d}/munged.log", f"--seed-file={d}/munged.seed"],
            env=denv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        self._wait(lambda: os.path.exists(self.munge_socket), "munged")
        self._write_conf()
        self.procs.append(subprocess.Popen(["slurmctld", "-D", "-i", "-f", self.conf], env=denv,
                                           stdout=subprocess.DEVNULL, stderr=open(f"{d}/slurmctld.err", "wb")))
        for node in self.node_ip:
            cmd = self.net.enter(node, ["slurmd", "-D", "-f", self.conf, "-N", node])
            p = subprocess.Popen(cmd, env=denv, stdout=subprocess.DEVNULL,
                                 stderr=open(f"{d}/slurmd-{node}.err", "wb"))
            self.procs.append(p)
            self.node_procs[node] = p
        self._wait(self._all_idle, "every node idle in sinfo", timeout=30)

    def _write_conf(self) -> None:
        d = self.dir
        port = random.randint(20000, 29000)
        lines = [
            f"ClusterName=mk{self.tag}", f"SlurmctldHost={socket.gethostname()}({self.bridge_ip})",
            f"SlurmctldPort={port}", "SlurmdPort=6818", "SlurmUser=root", "SlurmdUser=root",
            "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={d}/state", f"SlurmdSpoolDir={d}/spool-%n",
            f"SlurmctldPidFile={d}/slurmctld.pid", f"SlurmdPidFile={d}/slurmd-%n.pid",
            f"SlurmctldLogFile={d}/slurmctld.log", f"SlurmdLogFile={d}/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU", "SlurmdParameters=config_overrides",
            "AccountingStorageType=accounting_storage/none", "JobAcctGatherType=jobacct_gather/none",
            "ReturnToService=2", "MailProg=/bin/true", "MpiDefault=none", "KillWait=2", "InactiveLimit=0",
            "SchedulerParameters=sched_interval=1", "MessageTimeout=5", "EnforcePartLimits=ALL",
        ]
        for node, ip in self.node_ip.items():
            lines.append(f"NodeName={node} NodeHostname={node} NodeAddr={ip} CPUs={self.cpus} State=UNKNOWN")
        lines.append(f"PartitionName=debug Nodes={','.join(self.node_ip)} Default=YES MaxTime=INFINITE State=UP")
        os.makedirs(f"{d}/state", exist_ok=True)
        with open(self.conf, "w") as f:
            f.write("\n".join(lines) + "\n")

    def _all_idle(self) -> bool:
        for p in self.procs:
            if p.poll() is not None:
                raise RuntimeError(f"a Slurm daemon exited at start ({p.args[0]}, code {p.returncode}); "
                                   f"see {self.dir}")
        r = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=self.env, capture_output=True, text=True)
        states = dict(line.split() for line in r.stdout.splitlines() if line.strip())
        return len(states) == self.n and all(s == "idle" for s in states.values())

    def _wait(self, cond, what: str, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise RuntimeError(f"Slurm test cluster: no {what} after {timeout:.0f} s; see {self.dir}")
            time.sleep(0.05)

    # ------------------------------------------------------------------ use
    def link(self, node: str, up: bool) -> None:
        """Cut a node off the network (its host-side veth down), or bring it back."""
        self.net.link(node, up)

    def queue(self) -> list[str]:
        """Jobs Slurm still holds as pending or running (nothing, after a clean kill)."""
        r = subprocess.run(["squeue", "-h", "-o", "%i %T"], env=self.env, capture_output=True, text=True)
        return [line for line in r.stdout.splitlines()
                if line.split()[1] in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING")]

    def run(self, *args) -> subprocess.CompletedProcess:
        return subprocess.run(list(args), env=self.env, capture_output=True, text=True, timeout=30)

    # ------------------------------------------------------------------ tear-down
    def stop(self) -> None:
        if any(p.poll() is None for p in self.procs):
            for node in self.node_ip:
                self.link(node, up=True)
            subprocess.run(["scancel", "--full", "-u", "root"], env=self.env, capture_output=True, timeout=30)
            deadline = time.monotonic() + 15
            while self._has_jobs() and time.monotonic() < deadline:
                time.sleep(0.1)
        for p in reversed(self.procs):   # slurmds, slurmctld, then munged
            if p.poll() is None:
                p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs.clear()
        self.net.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _has_jobs(self) -> bool:
        try:
            return bool(self.queue())
        except Exception:
            return False


if __name__ == "__main__":
    why = unavailable()
    if why:
        raise SystemExit(f"cannot start a Slurm test cluster: {why}")
    with SlurmCluster() as c:
        print(f"SLURM_CONF={c.conf}", flush=True)
        input("Slurm test cluster up; Enter stops it\n")


def cluster_fixture():
    """Body of a module-scoped pytest fixture: a cluster, SLURM_CONF set while it runs."""
    import pytest

    why = unavailable()
    if why:
        pytest.skip(f"no Slurm test cluster: {why}")
    old = os.environ.get("SLURM_CONF")
    try:
        c = SlurmCluster().__enter__()
    except (RuntimeError, subprocess.CalledProcessError) as e:
        pytest.skip(f"cannot start a Slurm test cluster here: {getattr(e, 'stderr', '') or e}")
    os.environ["SLURM_CONF"] = c.conf
    try:
        yield c
    finally:
        c.stop()
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old
