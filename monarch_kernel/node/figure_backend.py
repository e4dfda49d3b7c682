"""The matplotlib backend of a worker proc (``MPLBACKEND=module://monarch_kernel.node.figure_backend``).

Agg draws; ``plt.show()`` sends the open figures to the notebook cell that runs, labelled
with the rank, and closes them (rich_output.py says why a rank needs its own backend).
"""
from __future__ import annotations

from matplotlib.backends.backend_agg import FigureCanvasAgg as FigureCanvas  # noqa: F401

from .rich_output import send_open_figures


def show(*args, block=None, **kwargs) -> None:
    """``plt.show()`` on a rank: the open figures go under the cell now."""
    send_open_figures(skip_displayed=False)
