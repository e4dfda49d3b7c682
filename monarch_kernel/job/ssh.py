"""``SSHJob``: a host agent on each of a list of hosts, started over ssh.

    SSHJob(hosts=["gpu1", "alice@gpu2:2222"], python_exe="/shared/venv/bin/python")

It runs the system ``ssh`` client, so your ``~/.ssh/config``, keys and agent apply
(``ssh_args`` adds options, e.g. ``["-F", "cluster.conf"]``). The mesh key goes to each
host on ssh's stdin, never on a command line. Each node starter detaches its agent, so
the agents outlive the ssh sessions and the kernel (until their lease). If any host
cannot be reached, the agents already started on the others are stopped and the error
names the host and says what ssh said: all hosts or none.
"""
from __future__ import annotations

import secrets
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from .base import JobError, JobTrait, Progress
from .rendezvous import Rendezvous, controller_ip


def _split(host: str) -> tuple[str, str | None]:
    """``user@host:port`` -> (``user@host``, port)."""
    if host.count(":") == 1 and host.rsplit(":", 1)[1].isdigit():
        dest, port = host.rsplit(":", 1)
        return dest, port
    return host, None


class SSHJob(JobTrait):
    kind = "ssh"

    def __init__(self, hosts: list[str] | tuple[str, ...] | None = None, python_exe: str = sys.executable,
                 ssh_args=(), env: dict | None = None, meshes: dict[str, int] | None = None,
                 connect_timeout: float = 10.0, *, name: str | None = None, lease: float | None = None):
        if isinstance(hosts, str):
            hosts = [h for h in hosts.split(",") if h]
        if not hosts:
            raise ValueError("SSHJob needs hosts, e.g. SSHJob(hosts=['gpu1', 'user@gpu2:2222'])")
        self.hosts = list(hosts)
        self.python_exe = python_exe
        self.ssh_args = shlex.split(ssh_args) if isinstance(ssh_args, str) else list(ssh_args)
        self.env = dict(env or {})
        self.connect_timeout = connect_timeout
        meshes = meshes or {"hosts": len(self.hosts)}
        if sum(meshes.values()) != len(self.hosts):
            raise ValueError(f"meshes {meshes} ask for {sum(meshes.values())} hosts but {len(self.hosts)} were given")
        super().__init__(meshes, name=name, lease=lease)

    def spec(self) -> dict:
        return {"hosts": self.hosts, "python_exe": self.python_exe, "ssh_args": self.ssh_args, "env": self.env,
                "meshes": self._meshes, "connect_timeout": self.connect_timeout}

    # ------------------------------------------------------------------ ssh
    def _ssh(self, host: str, command: list[str], *, input: str | None = None,
             timeout: float = 60.0) -> subprocess.CompletedProcess:
        dest, port = _split(host)
        args = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={self.connect_timeout:g}", *self.ssh_args]
        if port:
            args += ["-p", port]
        args += [dest, "--", shlex.join(command)]
        try:
            # a session of its own: a kernel's interrupt (sent to its process group) must not end
            # the ssh that kill() stops an agent with while it holds the interrupt off
            return subprocess.run(args, input=input, capture_output=True, text=True, timeout=timeout,
                                  start_new_session=True)
        except FileNotFoundError:
            raise JobError("ssh is not installed here: SSHJob runs the system ssh client") from None
        except subprocess.TimeoutExpired:
            return subprocess.CompletedProcess(args, 255, "", f"no answer within {timeout:g} s")

    def _resolve(self, host: str) -> str:
        """The address ssh would connect to (its config may rename the host)."""
        dest, port = _split(host)
        r = subprocess.run(["ssh", "-G", *self.ssh_args, *(["-p", port] if port else []), dest],
                           capture_output=True, text=True)
        for line in r.stdout.splitlines():
            k, _, v = line.partition(" ")
            if k == "hostname":
                return v.strip()
        return dest.split("@")[-1]

    def _create(self, key: bytes, progress: Progress) -> list[dict]:
        ip = controller_ip(self._resolve(self.hosts[0]))
        if ip != "127.0.0.1":
            from ..core.runtime import runtime

            runtime().listen_on(ip)
        token = secrets.token_hex(8)
        rv = Rendezvous(ip, key, token)
        self._handle = {"id": f"ssh-{token}", "agents": {}}
        reports: dict[int, dict] = {}
        try:
            progress(f"ssh: starting agents on {len(self.hosts)} hosts")
            with ThreadPoolExecutor(max_workers=min(32, len(self.hosts))) as pool:
                results = list(pool.map(lambda ih: self._start(ih[0], ih[1], rv.address, token, key),
                                        enumerate(self.hosts)))
            started = sum(ok for ok, _ in results)   # each of those sent its report before ssh returned
            deadline = time.monotonic() + 5
            while len(reports) < started and time.monotonic() < deadline:
                self._collect(rv, reports, 0.1)
            failed = [(h, why) for h, (ok, why) in zip(self.hosts, results) if not ok]
            failed += [(self.hosts[rank], rep["error"]) for rank, rep in reports.items() if rep.get("error")]
            missing = [self.hosts[i] for i in range(len(self.hosts)) if i not in reports]
            if failed or missing:
                why = "; ".join(f"{h}: {w}" for h, w in failed) or \
                    f"no report from {', '.join(missing)} (can it reach {ip}?)"
                raise JobError(f"ssh job {self.name!r}: could not start an agent on every host ({why}); "
                               "none were left running")
        except JobError:
            raise
        except BaseException:
            # Interrupted while ssh sessions ran: a node starter may still bring its agent
            # up and report it; note every one that does, so that state() stops them all.
            deadline = time.monotonic() + 5
            while len(reports) < len(self.hosts) and time.monotonic() < deadline:
                self._collect(rv, reports, 0.1)
            raise
        finally:
            rv.close()
        agents = []
        ranks = sorted(reports)
        for mesh, n in self._meshes.items():
            for i in range(n):
                rank = ranks[len(agents)]
                rep = reports[rank]
                agents.append({"addr": rep["addr"], "host": rep["host"], "pid": rep["pid"], "mesh": mesh,
                               "rank": i, "ssh": self.hosts[rank]})
        return agents

    def _collect(self, rv: Rendezvous, reports: dict[int, dict], timeout: float) -> int:
        """Read the reports that came within ``timeout``; each started agent goes into the
        handle at once (what ``_release`` stops). Returns how many came."""
        got = rv.poll(timeout)
        for rep in got:
            reports[int(rep["rank"])] = rep
            if "pid" in rep and not rep.get("error"):
                self._handle["agents"][str(rep["rank"])] = rep["pid"]
        return len(got)

    def _start(self, rank: int, host: str, report: str, token: str, key: bytes) -> tuple[bool, str]:
        cmd = [self.python_exe, "-m", "monarch_kernel.job.node", "--report", report, "--token", token,
               "--lease", str(self.lease), "--name", self.name, "--rank", str(rank), "--key-stdin", "--detach"]
        if self.env:
            cmd = ["env", *(f"{k}={v}" for k, v in self.env.items()), *cmd]
        r = self._ssh(host, cmd, input=key.hex() + "\n")
        if r.returncode != 0:
            return False, (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]
        return True, ""

    # ------------------------------------------------------------------ liveness / release
    def _each(self, fn) -> list:
        items = list((self._handle or {}).get("agents", {}).items())
        if not items:
            return []
        with ThreadPoolExecutor(max_workers=min(32, len(items))) as pool:
            return list(pool.map(lambda kv: fn(self.hosts[int(kv[0])], kv[1]), items))

    def _gone_reason(self) -> str | None:
        def check(host, pid):
            # An agent that ended but was not reaped (a container whose pid 1 reaps nothing)
            # still answers kill -0: a zombie counts as ended.
            alive = f'kill -0 {int(pid)} 2>/dev/null && ! grep -qs "^State:[[:space:]]*Z" /proc/{int(pid)}/status'
            r = self._ssh(host, ["sh", "-c", alive], timeout=self.connect_timeout + 5)
            return None if r.returncode == 0 else f"the agent on {host} (pid {pid}) no longer runs"
        dead = [w for w in self._each(check) if w]
        return "; ".join(dead) or None

    def _release(self) -> None:
        self._each(lambda host, pid: self._ssh(host, ["kill", "-TERM", str(pid)], timeout=self.connect_timeout + 5))

    def describe(self) -> dict:
        return {"scheduler": "ssh", "id": self.job_id, "hosts": len(self.hosts), "nodes": ",".join(self.hosts)}
