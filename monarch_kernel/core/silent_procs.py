"""Why a proc does not answer: its host's word for it, in a sentence a user can act on.

A proc answers a state query or an interrupt from its I/O thread within a millisecond,
unless something holds the whole process. From outside that reads the same for every
cause ("unresponsive"), but the cause decides what the user should do: a proc stopped by
a signal (``kill -STOP``, Ctrl-Z in a terminal) waits for ``kill -CONT``; one a debugger or
``py-spy`` holds waits for the tracer; one in uninterruptible I/O waits on a disk or a
network file system; only one that runs native code holding its GIL is really busy. Its
agent, on its host, asks the kernel (``/proc/PID/stat`` through psutil: the agent's
``proc_states``), so this works for procs on any host.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:   # (the runtime is imported where it is used: hosts' samplers read SHORT)
    from .runtime import ProcRef

# psutil's status -> what the user reads after "rank N is ..." ({pid}: the proc's pid)
WHY = {
    "stopped": "stopped by a signal, kill -STOP or Ctrl-Z where it was started; "
               "`kill -CONT {pid}` on its host resumes it",
    "tracing-stop": "held by a tracer, a debugger such as gdb or py-spy; it goes on when the tracer "
                    "lets go of pid {pid}",
    "disk-sleep": "waiting in uninterruptible I/O, on a disk or network file system that does not answer",
    "zombie": "exited; its host has not reaped it yet",
}
SHORT = {"stopped": "stopped (signal)", "tracing-stop": "held by a tracer", "disk-sleep": "waiting on I/O",
         "zombie": "exited"}
BUSY = "native code may hold its GIL"
_CELLS = "__cells__"   # jupyter.session.CELL_ACTOR (core imports no feature)

# A proc whose host's agent went silent (stopped, starved, cut off): failed for now, not dead.
UNREACHABLE = ("its host's agent is silent: if it answers again this proc comes back with its state; "
               "if not, stop the mesh and start a new one")


def host_silent(rt, ref: "ProcRef") -> bool:
    """Was ``ref`` failed because its host's agent went silent (its link lost, the agent not
    known to have exited)? Such a proc may come back with its state: it is not dead."""
    link = rt.agents.get(ref.agent)
    return link is not None and link.lost and not link.gone


def doing(state: str, os_state: str | None = None) -> str:
    """A proc's state (``ProcMesh.states()``) as ``%mesh status`` and ``%mesh top`` show what it
    is doing: a cell, an endpoint, or, when it does not answer, its host's word for why."""
    if state == "unresponsive":
        return SHORT.get(os_state or "", state)
    if state == f"in {_CELLS}.run":
        return "running cell"
    if state.startswith(f"in {_CELLS}."):
        return "busy (push/pull)"
    if state.startswith("in "):
        return f"in endpoint {state[3:]}"
    return state


def os_states(refs: list["ProcRef"], key: bytes, timeout: float = 1.0) -> dict[str, str]:
    """proc key -> its host's word for it (psutil's status: 'running', 'sleeping',
    'stopped', 'tracing-stop', 'disk-sleep', ...), asked of each proc's agent at once; a
    proc whose agent does not answer within ``timeout`` is left out."""
    from .runtime import runtime

    rt = runtime()
    by_agent: dict[str, list[str]] = {}
    for r in refs:
        by_agent.setdefault(r.agent, []).append(r.key)
    futs = [rt.agent_request(addr, key, "proc_states", keys) for addr, keys in by_agent.items()]
    out: dict[str, str] = {}
    for f in futs:
        try:
            got = f.get(timeout)
        except Exception:   # (a lost or older agent: the generic reason stands)
            continue
        if isinstance(got, dict):
            out.update({k: v for k, v in got.items() if isinstance(k, str) and isinstance(v, str)})
    return out


def reasons(refs: list["ProcRef"], key: bytes, busy: str = BUSY) -> dict[str, list[int]]:
    """Why these procs do not answer -> their ranks, one entry per cause their hosts name
    (``busy`` for those whose host names none)."""
    said = os_states(refs, key) if refs else {}
    by_state: dict[str | None, list] = {}
    for ref in refs:
        by_state.setdefault(said.get(ref.key), []).append(ref)
    out: dict[str, list[int]] = {}
    for os_state, group in by_state.items():
        out.setdefault(why(os_state, [r.pid for r in group], busy), []).extend(r.rank for r in group)
    return out


def why(os_state: str | None, pids: int | list[int], busy: str = BUSY) -> str:
    """The sentence for procs that did not answer, given their host's word for them (one
    word for all of ``pids``); ``busy`` where it names no cause but running code."""
    pids = [pids] if isinstance(pids, int) else pids
    shown = " ".join(str(p) for p in pids[:8]) + (" ..." if len(pids) > 8 else "")
    return WHY.get(os_state or "", busy).format(pid=shown)
