"""Distributed debugger: ``breakpoint()`` on any rank, driven from the notebook.

worker.py (in every proc), registry.py (controller: who is paused, their output),
console.py (the text console in a waiting cell or script), widget.py (ipywidgets),
magic.py (``%mesh debug``); JupyterLab's debugger on a rank: dap.py (kernel half) and
dap_worker.py (worker half). This package must stay light to import: procs import
``worker`` at start, and nothing here imports ipykernel or ipywidgets at the top.
"""
