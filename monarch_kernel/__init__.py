"""monarch-kernel: a Jupyter-first interactive cluster kernel for PyTorch.

``monarch_kernel.actor`` is the actor API; ``%load_ext monarch_kernel`` loads the magics.
"""
__version__ = "0.1.0"

from . import features  # noqa: F401,E402  (features register with the core; costs no import)


def load_ipython_extension(ipython):
    from .jupyter.magics import load_ipython_extension as load

    load(ipython)
