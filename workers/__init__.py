"""A shim, kept for the command line: the node side lives in ``monarch_kernel.node``.

Deployments, Kubernetes pod specs and docs start host agents as ``python -m workers.agent
...``, and user code (or an older notebook) may ``import workers.proc``; both keep
working. Every ``workers.X`` is an alias of ``monarch_kernel.node.X``:

* ``import workers.proc`` returns the SAME module object as ``monarch_kernel.node.proc``
  (proc-global state such as ``WORKER`` exists once), and
* ``python -m workers.agent`` runs ``monarch_kernel/node/agent.py`` as ``__main__``
  (runpy asks this package's finder for the code; tracebacks name the real file).

Why a finder here rather than one shim file per module: with no ``workers/agent.py`` file
beside the real one, git sees the move as a rename, so edits made to the old paths on
other branches merge into ``monarch_kernel/node/`` instead of conflicting with a shim.
New code imports ``monarch_kernel.node``.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

_OLD, _NEW = __name__ + ".", "monarch_kernel.node."


class _NodeAlias(importlib.abc.MetaPathFinder, importlib.abc.InspectLoader):
    """``workers.X`` -> ``monarch_kernel.node.X``: for import (the same module object) and
    for runpy (``python -m workers.X`` runs the real module's code)."""

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith(_OLD):
            return None
        real = importlib.util.find_spec(_NEW + fullname[len(_OLD):])
        if real is None:
            return None
        spec = importlib.util.spec_from_loader(fullname, self, origin=real.origin)
        spec.has_location = real.has_location   # runpy sets __file__ to the real file
        spec.loader_state = real
        return spec

    def create_module(self, spec):
        return importlib.import_module(_NEW + spec.name[len(_OLD):])

    def exec_module(self, module):
        # The real module ran when create_module imported it; importlib has just set its
        # __spec__ to this alias's: give it back its own (reload and pickle look at it).
        module.__spec__ = module.__spec__.loader_state

    def get_code(self, fullname):   # runpy: python -m workers.X
        real = _NEW + fullname[len(_OLD):]
        return importlib.util.find_spec(real).loader.get_code(real)

    def get_source(self, fullname):
        real = _NEW + fullname[len(_OLD):]
        return importlib.util.find_spec(real).loader.get_source(real)


if not any(isinstance(f, _NodeAlias) for f in sys.meta_path):
    sys.meta_path.insert(0, _NodeAlias())
