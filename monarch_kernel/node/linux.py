"""Linux process plumbing: die with the parent (PR_SET_PDEATHSIG)."""
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
