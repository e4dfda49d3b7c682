"""The Jupyter face of monarch-kernel: the kernel, the %mesh / %%on_mesh magics, reprs.

Everything here runs in the kernel. What runs on the procs for a notebook (the cell
runner, a rank's ``display()``, its matplotlib backend) lives in ``monarch_kernel/node/``;
their old names here (``monarch_kernel.jupyter.cells.NAMESPACE``, which notebooks read)
still work as aliases (``monarch_kernel/moved.py``).
"""
from .. import moved

moved.install()
