"""Linux process plumbing: die with the parent (PR_SET_PDEATHSIG); the procs' own scheduling group."""
from __future__ import annotations

import ctypes
import os
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent(expected_parent: int | None = None, sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent exits, and exit now
    if the parent is already gone (the race between fork and prctl)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except OSError:  # pragma: no cover - not Linux
        return
    if expected_parent is not None and os.getppid() != expected_parent:
        os._exit(1)


def own_scheduling_group() -> bool:
    """Start a session of our own (the zygote, before it forks procs), so that the kernel's
    autogroup scheduler (``/proc/sys/kernel/sched_autogroup_enabled``, on by default where
    the cpu cgroup is not managed) weighs all the procs of this host together as one group
    against the agent, not each proc as the agent's equal. 256 procs printing as fast as they
    can on 2 cores left their agent, one of 257 equal tasks, ~0.8 % of a CPU: it answered no
    heartbeat for 30 s and the controller declared the host lost (issue 11's flood). The agent,
    the host's control plane, now gets a CPU when it needs one however many procs are busy.
    No effect where autogroup is off or the cpu cgroup decides (systemd slices, Kubernetes):
    there the starved-agent rule of core/host_liveness.py still tells load from loss.
    False when it could not (already a session leader)."""
    try:
        os.setsid()
    except OSError:
        return False
    return True
