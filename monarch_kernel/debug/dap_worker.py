"""The worker half of JupyterLab's debugger on a rank: debugpy in the proc, cell sources.

``DapServer`` is spawned (by the kernel half, dap.py, which says how the two fit together)
on the chosen rank only. It runs in a worker proc and imports nothing from ipykernel.
"""
from __future__ import annotations

import os
import threading

from monarch_kernel.core.actors import Actor, endpoint

_LISTENING: tuple[str, int] | None = None


class DapServer(Actor):
    """On one rank: debugpy for JupyterLab's debugger, and the cell sources it needs."""

    def __init__(self):
        import monarch_kernel.node.proc as proc_mod

        w = proc_mod.WORKER
        if w is not None:
            w.rt.on_message("dap_src", _write_source)

    @endpoint
    def listen(self, host: str) -> int:
        """Start debugpy here (once per proc) and return its port."""
        global _LISTENING
        if _LISTENING is None:
            os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")   # frozen-modules notice
            main = threading.main_thread()
            for t in threading.enumerate():
                if t is not main:   # the proc's own threads must never stop at a breakpoint
                    t.pydev_do_not_trace = True
            import debugpy

            _LISTENING = debugpy.listen((host, 0), in_process_debug_adapter=True)
        return int(_LISTENING[1])


def _write_source(msg) -> None:
    """I/O thread: ``("dap_src", path, text)``: the cell file debugpy checks breakpoints against."""
    _, path, text = msg
    try:
        try:
            with open(path, encoding="utf-8") as f:
                if f.read() == text:
                    return
        except OSError:
            pass
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError:
        pass   # the breakpoint then shows unverified in the panel
