"""MonarchKernel: IPython's kernel with the mesh magics loaded and the local agent warm.

Started by ``python -m monarch_kernel -f CONNECTION_FILE`` (the kernelspec ``monarch``)
through ``IPKernelApp.launch_instance``, which wires the control channel and the
debugger. At start it loads ``%load_ext monarch_kernel`` and, unless
``MONARCH_KERNEL_PREWARM=0``, starts (or attaches to) the notebook's default mesh agent
and its warm zygote in the background, so ``%mesh connect`` does not wait for Python and
torch to import. On shutdown or restart, meshes with procs are left running (detached,
kept for their lease); an agent that was only prewarmed is stopped, and widgets still
shown become a line of text (transient.py). Its stdout and stderr skip a flush when they
hold no text (output.flush_only_text: ipykernel waits for its I/O thread on each flush, and
flushes both streams several times a cell).
"""
from __future__ import annotations

import logging
import sys

from ipykernel.ipkernel import IPythonKernel
from traitlets import Type

from monarch_kernel import config

from .. import __version__
from .fast_path import HistoryWrites, remember_accepted_parameters
from .output import flush_only_text
from .session import session


class MonarchKernel(IPythonKernel):
    implementation = "monarch_kernel"
    implementation_version = __version__
    banner = ("Monarch kernel (IPython) - %mesh connect starts a local mesh; %%on_mesh runs a cell "
              "on every rank; %mesh -h lists commands")
    # JupyterLab's debugger panel can drive one rank (`%mesh debug dap RANK`, debug/dap.py)
    debugger_class = Type("monarch_kernel.debug.dap.MonarchDebugger")

    _COMM_MSGS = frozenset({"comm_open", "comm_msg", "comm_close"})

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._cells_running = 0
        _drop_unhandled_debug_records(self.log)
        remember_accepted_parameters()   # ipykernel reads a signature every cell otherwise
        self._history_writes = HistoryWrites(self.shell.history_manager)   # not while a cell prepares
        for stream in (sys.stdout, sys.stderr):   # ipykernel's streams, set up before the kernel
            flush_only_text(stream)
        self.shell.extension_manager.load_extension("monarch_kernel")
        try:
            prewarm = config.PREWARM.get()
        except config.ConfigError as e:   # the kernel still starts; %mesh connect works without it
            self.log.warning("not starting the default mesh's agent ahead of time: %s", e)
            prewarm = False
        if prewarm:
            session().prewarm()

    async def execute_request(self, stream, ident, parent):
        self._cells_running += 1
        self._history_writes.cell_started(_code_of(parent))
        try:
            return await super().execute_request(stream, ident, parent)
        finally:
            self._cells_running -= 1
            self._history_writes.cell_ended()

    def _publish_status(self, status, channel, parent=None):
        """A widget's comm message handled while a cell runs (the debugger widget drives the
        ranks that cell paused) says nothing of the kernel's state: its busy/idle pair
        would show JupyterLab's indicator idle while the cell still runs."""
        if self._cells_running and status in ("busy", "idle"):
            msg = parent or self.get_parent(channel)
            if (msg or {}).get("header", {}).get("msg_type") in self._COMM_MSGS:
                return
        super()._publish_status(status, channel, parent)

    def do_shutdown(self, restart):
        try:   # no widget of ours is left in the notebook to break once the kernel is gone
            from .transient import settle_all

            settle_all("(widget closed: the kernel was " + ("restarted)" if restart else "shut down)"))
        except Exception as e:
            self.log.warning("replacing widgets by text failed: %s", e)
        try:
            session().shutdown_kernel()
        except Exception as e:
            self.log.warning("leaving the mesh failed: %s", e)
        return super().do_shutdown(restart)


def _code_of(parent) -> str:
    try:
        code = parent["content"]["code"]
    except (KeyError, TypeError):
        return ""
    return code if isinstance(code, str) else ""


def _drop_unhandled_debug_records(log) -> None:
    """traitlets leaves the kernel app's logger at DEBUG and filters in its handlers, so each
    of ipykernel's debug lines (four a cell) builds a record that every handler drops. Raise
    the logger to its handlers' lowest level; a change of ``log_level`` reconfigures both."""
    if not isinstance(log, logging.Logger) or not log.handlers:
        return
    lowest = min(h.level for h in log.handlers)
    if log.level < lowest:
        log.setLevel(lowest)
