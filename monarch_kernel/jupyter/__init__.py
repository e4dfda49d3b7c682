"""The Jupyter face of monarch-kernel: the kernel, the %mesh / %%on_mesh magics, reprs.

``cells.py`` is the one module here that runs on workers (the cell runner actor); it
imports nothing from Jupyter.
"""
