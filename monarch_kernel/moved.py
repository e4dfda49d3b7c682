"""Old import paths of modules that moved, kept working as aliases of the new ones.

Deployments start agents as ``python -m workers.agent``; notebooks read
``monarch_kernel.jupyter.cells.NAMESPACE``. Those modules now live on the node side
(``monarch_kernel/node/``), and the old names still work:

* ``import OLD`` gives the SAME module object as ``import NEW`` (module-global state,
  such as a proc's ``WORKER`` or the cells' ``NAMESPACE``, exists once), with the new
  name as its ``__name__`` and ``__spec__``;
* ``python -m OLD`` runs the new module's code as ``__main__`` (runpy asks this finder
  for the code; tracebacks name the real file).

Why a finder, not a shim file at each old path: with no file left at the old path, git
sees each move as a rename, so edits made to the old paths on other branches merge into
the new files instead of conflicting with a shim. The package that owned an old path
calls ``install()`` (``workers/__init__.py``, ``monarch_kernel/jupyter/__init__.py``);
new code imports the new names.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

# old package -> new package: every OLD.X is NEW.X
MOVED_PACKAGES = {"workers": "monarch_kernel.node"}
# old module -> new module
MOVED_MODULES = {
    "monarch_kernel.jupyter.cells": "monarch_kernel.node.cells",
    "monarch_kernel.jupyter.display_worker": "monarch_kernel.node.rich_output",
    "monarch_kernel.jupyter.figure_backend": "monarch_kernel.node.figure_backend",
}


def new_name(old: str) -> str | None:
    """The module ``old`` now lives at, or None if it did not move."""
    if old in MOVED_MODULES:
        return MOVED_MODULES[old]
    package, dot, rest = old.partition(".")
    if dot and package in MOVED_PACKAGES:
        return MOVED_PACKAGES[package] + "." + rest
    return None


class MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.InspectLoader):
    """Finds an old name and loads it as the new module (see the module docstring)."""

    def find_spec(self, fullname, path=None, target=None):
        new = new_name(fullname)
        if new is None:
            return None
        real = importlib.util.find_spec(new)
        if real is None:
            return None
        spec = importlib.util.spec_from_loader(fullname, self, origin=real.origin)
        spec.has_location = real.has_location   # runpy sets __file__ to the real file
        return spec

    def create_module(self, spec):
        module = importlib.import_module(new_name(spec.name))
        spec.loader_state = module.__spec__   # its own spec, given back in exec_module
        return module

    def exec_module(self, module):
        # The real module ran when create_module imported it; importlib has just set its
        # __spec__ to the alias's: give it back its own (reload and pickle look at it).
        module.__spec__ = module.__spec__.loader_state

    def get_code(self, fullname):   # runpy: python -m OLD
        new = new_name(fullname)
        return importlib.util.find_spec(new).loader.get_code(new)

    def get_source(self, fullname):
        new = new_name(fullname)
        return importlib.util.find_spec(new).loader.get_source(new)


def install() -> None:
    """Put the finder on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, MovedModuleFinder())
