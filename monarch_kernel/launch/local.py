"""Start a host agent on this machine, as a child in its own session.

Its own session (process group) keeps a kernel interrupt (SIGINT to the kernel's group)
away from the agent and its procs. A non-persistent agent watches our pid and exits when
we are gone; a persistent one outlives us and stops after its lease.
"""
from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from pathlib import Path

from ..core.connection import home
from ..core.errors import MeshGoneError

READY = "MONARCH_AGENT_READY "


def start_local_agent(key: bytes, *, name: str, persistent: bool, lease: float | None = None,
                      conn_file: str | Path | None = None, bind: str = "127.0.0.1",
                      timeout: float = 60.0, python: str | None = None,
                      env: dict | None = None) -> tuple[dict, subprocess.Popen]:
    log_path = agent_log(name)
    log_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    args = [python or sys.executable, "-m", "monarch_kernel.node.agent", "--bind", bind, "--name", name]
    if persistent:
        args.append("--persistent")
    else:
        args += ["--parent-pid", str(os.getpid())]
    if lease is not None:
        args += ["--lease", str(lease)]
    if conn_file:
        args += ["--conn-file", str(conn_file)]
    env = dict(os.environ, **(env or {}), MONARCH_KERNEL_KEY=key.hex())
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log,
                                env=env, start_new_session=True, cwd=os.getcwd())
    deadline = time.monotonic() + timeout
    line = b""
    fd = proc.stdout.fileno()
    while not line.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            proc.kill()
            proc.wait()
            raise MeshGoneError(f"the host agent did not start within {timeout:.0f} s; see {log_path}")
        chunk = os.read(fd, 4096)
        if not chunk:
            proc.wait()
            raise MeshGoneError(f"the host agent exited at start (code {proc.returncode}){_last_line(log_path)}; "
                                f"see {log_path}")
        line += chunk
    proc.stdout.close()
    text = line.decode().strip()
    if not text.startswith(READY):
        raise MeshGoneError(f"unexpected first line from the host agent: {text!r}; see {log_path}")
    import socket

    return {"addr": text[len(READY):], "host": socket.gethostname(), "pid": proc.pid}, proc


def _last_line(log_path: Path) -> str:
    """The agent's last words (e.g. a bad MONARCH_KERNEL_* value), for the error."""
    try:
        with open(log_path, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - 2000))
            lines = [ln for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return f": {lines[-1].strip()}" if lines else ""


def agent_log(name: str) -> Path:
    """Where the local agent started under ``name`` writes its log (appended to by each)."""
    return home() / "logs" / f"{name}.log"


def last_words(name: str, pid: int | None) -> tuple[str, str] | None:
    """What the local agent ``name`` (pid ``pid``) logged as an error before it stopped (its
    zygote killed, ...; "" if nothing) and its log's path; None with no log. A line of an
    earlier agent of that name (the log is appended to) is not its."""
    path = agent_log(name)
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - 16384))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    if pid is not None:
        mine = [i for i, ln in enumerate(lines) if f"agent pid {pid} ready" in ln]
        lines = lines[mine[-1]:] if mine else []
    errors = [ln.split(" agent ERROR ", 1)[1] for ln in lines if " agent ERROR " in ln]
    return errors[-1].removesuffix("; stopping") if errors else "", str(path)
