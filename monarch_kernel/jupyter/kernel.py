"""MonarchKernel: IPython's kernel with the mesh magics loaded and the local agent warm.

Started by ``python -m monarch_kernel -f CONNECTION_FILE`` (the kernelspec ``monarch``)
through ``IPKernelApp.launch_instance``, which wires the control channel and the
debugger. At start it loads ``%load_ext monarch_kernel`` and, unless
``MONARCH_KERNEL_PREWARM=0``, starts (or attaches to) the notebook's default mesh agent
and its warm zygote in the background, so ``%mesh connect`` does not wait for Python and
torch to import. On shutdown or restart, meshes with procs are left running (detached,
kept for their lease); an agent that was only prewarmed is stopped.
"""
from __future__ import annotations

import os

from ipykernel.ipkernel import IPythonKernel
from traitlets import Type

from .. import __version__
from .session import session


class MonarchKernel(IPythonKernel):
    implementation = "monarch_kernel"
    implementation_version = __version__
    banner = ("Monarch kernel (IPython) - %mesh connect starts a local mesh; %%on_mesh runs a cell "
              "on every rank; %mesh -h lists commands")
    # JupyterLab's debugger panel can drive one rank (`%mesh debug dap RANK`, debug/dap.py)
    debugger_class = Type("monarch_kernel.debug.dap.MonarchDebugger")

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.shell.extension_manager.load_extension("monarch_kernel")
        if os.environ.get("MONARCH_KERNEL_PREWARM", "1") != "0":
            session().prewarm()

    def do_shutdown(self, restart):
        try:
            session().shutdown_kernel()
        except Exception as e:
            self.log.warning("leaving the mesh failed: %s", e)
        return super().do_shutdown(restart)
