"""Runs on a job's node: start this node's host agent and tell the controller where it is.

  MONARCH_KERNEL_KEY=<hex> python -m monarch_kernel.job.node --report tcp://CTL:PORT
                                   --token T [--lease S] [--name N] [--port P]

A scheduler (``srun``, ``ssh``, a pod) runs one of these per host. It binds the agent to
the node's address that routes to the controller (``MONARCH_KERNEL_BIND`` overrides; never
all interfaces unless that is what it says), reads the agent's ready line, and reports
``{token, addr, host, pid, rank}`` to the controller's rendezvous, signed with the job's
key, so no shared file system is needed. Then it waits for the agent and exits with its
code; a SIGTERM (``scancel``, pod deletion) is passed on, and the agent stops its procs.
If the agent cannot start, the report carries the error and the tail of its stderr.
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys

from .rendezvous import route_ip, send_report

READY = "MONARCH_AGENT_READY "


def rank_from_env() -> int:
    for var in ("SLURM_PROCID", "MONARCH_HOST_RANK", "JOB_COMPLETION_INDEX"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m monarch_kernel.job.node", description=__doc__.split("\n")[0])
    p.add_argument("--report", required=True, help="the controller's rendezvous, tcp://HOST:PORT")
    p.add_argument("--token", required=True)
    p.add_argument("--lease", type=float, default=3600.0)
    p.add_argument("--name", default="job")
    p.add_argument("--port", type=int, default=0)
    a = p.parse_args(argv)
    key_hex = os.environ.get("MONARCH_KERNEL_KEY", "")
    if not key_hex:
        sys.exit("monarch_kernel.job.node: MONARCH_KERNEL_KEY is not set")
    key = bytes.fromhex(key_hex)
    ctl_host = a.report.split("://", 1)[-1].rsplit(":", 1)[0]
    bind = os.environ.get("MONARCH_KERNEL_BIND") or route_ip(ctl_host)
    rank = rank_from_env()
    report = {"token": a.token, "rank": rank, "host": socket.gethostname(), "node_pid": os.getpid()}
    args = [sys.executable, "-m", "workers.agent", "--bind", bind, "--persistent", "--lease", str(a.lease),
            "--name", f"{a.name}.{rank}"]
    if a.port:
        args += ["--port", str(a.port)]
    agent = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    line = agent.stdout.readline().decode(errors="replace").strip()
    if not line.startswith(READY):
        agent.kill()
        _, err = agent.communicate()
        tail = "\n".join(err.decode(errors="replace").strip().splitlines()[-15:])
        report["error"] = f"the host agent did not start on {report['host']} (exit {agent.returncode}): {tail}"
        send_report(a.report, key, report)
        return 1
    report.update(addr=line[len(READY):], pid=agent.pid)
    send_report(a.report, key, report)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda s, _f: agent.send_signal(signal.SIGTERM))
    # The agent's stderr is its log: pass it through to ours (the scheduler's log file).
    for chunk in iter(lambda: agent.stderr.read1(65536), b""):
        sys.stderr.buffer.write(chunk)
        sys.stderr.flush()
    return agent.wait()


if __name__ == "__main__":
    sys.exit(main())
