"""Runs on a job's node: start this node's host agent and tell the controller where it is.

  MONARCH_KERNEL_KEY=<hex> python -m monarch_kernel.job.node --report tcp://CTL:PORT
                                   --token T [--lease S] [--name N] [--port P]
  python -m monarch_kernel.job.node --key-stdin --detach --rank R ...     (over ssh)

A scheduler (``srun``, ``ssh``, a pod) runs one of these per host. It binds the agent to
the node's address that routes to the controller (``MONARCH_KERNEL_BIND`` overrides; never
all interfaces unless that is what it says), reads the agent's ready line, and reports
``{token, addr, host, pid, rank}`` to the controller's rendezvous, signed with the job's
key, so no shared file system is needed. Then it waits for the agent and exits with its
code; a SIGTERM (``scancel``, pod deletion) is passed on, and the agent stops its procs.
If the agent cannot start, the report carries the error and the tail of its stderr.

Over ssh (``--key-stdin --detach``) the key arrives as the first line of stdin, and once
the agent is up this process exits: the agent, in its own session, outlives the ssh
connection (a kernel restart must not end it) and logs to
``$MONARCH_KERNEL_HOME/logs/NAME.log`` on that host.
"""
from __future__ import annotations

import time

STARTED = time.time()   # reported, so a benchmark can say where the time to a first reply goes

import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402


class _ForkedZygote:
    """The zygote (torch's import, the longest part of a node's start), forked from this
    starter as its very first act: it needs no interpreter of its own to start, and it
    imports torch while this process parses its arguments and starts the agent, which
    gets its pipes. The part of ``Popen`` this module uses."""

    def __init__(self):
        cmd_r, cmd_w = os.pipe()
        ev_r, ev_w = os.pipe()
        parent = os.getpid()
        pid = os.fork()   # no thread runs yet: this module has imported only os, sys, time, subprocess
        if pid == 0:   # the zygote: it runs, and exits, as `python -m monarch_kernel.node.zygote`
            os.dup2(cmd_r, 0)   # would (an exception or SystemExit ends this interpreter as there,
            os.dup2(ev_w, 1)    # atexit handlers included: nothing below catches it)
            for fd in (cmd_r, cmd_w, ev_r, ev_w):
                os.close(fd)
            from monarch_kernel import config  # (stdlib only; the zygote imports it first thing too)

            os.environ[config.AGENT_PID.env] = str(parent)   # it dies with us
            sys.argv = sys.argv[:1]
            _show_command_line([sys.executable, "-m", "monarch_kernel.node.zygote"])
            import runpy

            runpy.run_module("monarch_kernel.node.zygote", run_name="__main__", alter_sys=True)
            sys.exit(0)
        os.close(cmd_r)
        os.close(ev_w)
        self.started = time.time()   # reported: its imports begin now
        self.pid, self.returncode = pid, None
        self.stdin, self.stdout = os.fdopen(cmd_w, "wb"), os.fdopen(ev_r, "rb")

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            pid, status = os.waitpid(self.pid, 0 if deadline is None else os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
            elif time.monotonic() > deadline:
                raise subprocess.TimeoutExpired("zygote", timeout)
            else:
                time.sleep(0.02)
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            os.kill(self.pid, 9)


def _show_command_line(argv: list[str]) -> None:
    """Show ``argv`` as this process's command line (ps, pgrep -f, /proc/PID/cmdline), so
    that the forked zygote and the procs it forks do not look like node starters. It
    rewrites the process's own argument area, as setproctitle does; best effort."""
    try:
        import ctypes

        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])   # arg_start and arg_end, stat fields 48 and 49
        text = "\0".join(argv).encode()[:end - start - 1]
        ctypes.memmove(start, text + b"\0" * (end - start - len(text)), end - start)
    except (OSError, ValueError, IndexError):
        pass


# Not over ssh (--detach): this process exits there, and the zygote dies with its parent.
ZYGOTE = _ForkedZygote() if __name__ == "__main__" and "--detach" not in sys.argv else None

import argparse  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402

from monarch_kernel import config  # noqa: E402  (stdlib only)

from .rendezvous import Reporter, local_address_error, route_ip  # noqa: E402  (stdlib only until a Reporter is made)

READY = "MONARCH_AGENT_READY "


def rank_from_env() -> int:
    for var in ("SLURM_PROCID", "MONARCH_HOST_RANK", "JOB_COMPLETION_INDEX"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def _batch_started(text: str) -> dict:
    try:   # a date(1) without %N gives "1700000000.N": then the figure is left out
        return {"batch_started": float(text)}
    except ValueError:
        return {}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m monarch_kernel.job.node", description=__doc__.split("\n")[0])
    p.add_argument("--report", required=True, help="the controller's rendezvous, tcp://HOST:PORT")
    p.add_argument("--token", required=True)
    p.add_argument("--lease", type=float, default=3600.0)
    p.add_argument("--name", default="job")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--rank", type=int, default=None, help="this host's rank (default: from the scheduler)")
    p.add_argument("--key-stdin", action="store_true", help="read the key (hex) from the first line of stdin")
    p.add_argument("--detach", action="store_true", help="exit once the agent is up; it keeps running")
    p.add_argument("--scancel-at-end", action="store_true",
                   help="when the agent ends cleanly (its lease, a stop), cancel this Slurm job: an "
                        "interactive allocation (SlurmJob(allocation='salloc')) would otherwise outlive it")
    p.add_argument("--batch-started", default="",
                   help="when the batch script started (Slurm's `date +%%s.%%N`), for the timing in the report")
    a = p.parse_args(argv)
    if a.key_stdin:
        os.environ[config.KEY.env] = sys.stdin.readline().strip()
    try:
        key_hex = config.KEY.get()
    except config.ConfigError as e:
        sys.exit(f"monarch_kernel.job.node: {e}")
    if not key_hex:
        sys.exit("monarch_kernel.job.node: no key: set MONARCH_KERNEL_KEY or pass it on stdin with --key-stdin")
    key = bytes.fromhex(key_hex)
    ctl_host = a.report.split("://", 1)[-1].rsplit(":", 1)[0]
    bind = config.BIND.get()
    if bind and local_address_error(bind) is not None:
        # Not this node's: the controller's own, which the scheduler passed on with its
        # environment (sbatch does by default). This node's address is the route's.
        bind = None
    bind = bind or route_ip(ctl_host)
    rank = a.rank if a.rank is not None else rank_from_env()
    report = {"token": a.token, "rank": rank, "host": socket.gethostname(), "node_pid": os.getpid()}
    args = [sys.executable, "-m", "monarch_kernel.node.agent", "--bind", bind, "--persistent", "--lease", str(a.lease),
            "--name", f"{a.name}.{rank}"]
    if a.port:
        args += ["--port", str(a.port)]
    err_to = subprocess.PIPE
    if a.detach:
        logs = os.path.join(config.HOME.get(), "logs")
        os.makedirs(logs, mode=0o700, exist_ok=True)
        err_to = open(os.path.join(logs, f"{a.name}.{rank}.log"), "ab")
    fds = ()
    if ZYGOTE is not None:
        fds = (ZYGOTE.stdin.fileno(), ZYGOTE.stdout.fileno())
        args += ["--zygote-fds", f"{fds[0]},{fds[1]},{ZYGOTE.pid}"]
    agent = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err_to,
                             start_new_session=a.detach, pass_fds=fds)
    if ZYGOTE is not None:   # the agent holds its pipes now: it alone can end it (EOF)
        ZYGOTE.stdin.close()
        ZYGOTE.stdout.close()
    reporter = Reporter(a.report, key)   # connects while the agent starts (CURVE: keys from the job's key)
    line = agent.stdout.readline().decode(errors="replace").strip()
    if not line.startswith(READY):
        agent.kill()
        _, err = agent.communicate()
        if a.detach:
            err_to.close()
            with open(err_to.name, "rb") as f:
                err = f.read()
        tail = "\n".join(err.decode(errors="replace").strip().splitlines()[-15:])
        report["error"] = f"the host agent did not start on {report['host']} (exit {agent.returncode}): {tail}"
        reporter.send(key, report)
        return 1
    report.update(addr=line[len(READY):], pid=agent.pid, t={"node_started": STARTED, "agent_ready": time.time(),
                                                           **_batch_started(a.batch_started)})
    if ZYGOTE is not None:
        report["t"]["zygote_started"] = ZYGOTE.started
    reporter.send(key, report)
    if a.detach:
        agent.stdout.close()
        return 0
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda s, _f: agent.send_signal(signal.SIGTERM))
    # The agent's stderr is its log: pass it through to ours (the scheduler's log file).
    for chunk in iter(lambda: agent.stderr.read1(65536), b""):
        sys.stderr.buffer.write(chunk)
        sys.stderr.flush()
    code = agent.wait()
    if ZYGOTE is not None:   # it ends with the agent's pipe; reap it
        try:
            ZYGOTE.wait(5)
        except subprocess.TimeoutExpired:
            ZYGOTE.kill()
            ZYGOTE.wait()
    if a.scancel_at_end and code == 0 and os.environ.get("SLURM_JOB_ID"):
        try:   # the launcher on the kernel's machine does it too; this covers that machine gone
            subprocess.run(["scancel", "--quiet", os.environ["SLURM_JOB_ID"]], timeout=30,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired):
            pass
    return code


if __name__ == "__main__":
    sys.exit(main())
