"""A bench's own folders (its MONARCH_KERNEL_HOME, an IPYTHONDIR): the caller's when the
variable is set, else a temporary one removed when the bench ends (runs had left one a run
in /tmp, and the caller's setting still made an empty one)."""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile


def private_dir(var: str, prefix: str) -> str:
    """``$var`` if set; else a new temporary folder, put in ``$var`` and removed at exit
    (after the runtime's own exit handlers, registered later, have stopped the bench's
    agents and procs)."""
    path = os.environ.get(var)
    if path:
        return path
    path = tempfile.mkdtemp(prefix=prefix)
    os.environ[var] = path
    atexit.register(shutil.rmtree, path, True)
    return path
