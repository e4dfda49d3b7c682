"""Code sync: push local code (and the environment) to every host; procs reload it.

    from monarch_kernel.sync import sync_workspace
    report = sync_workspace(procs)            # or procs.sync_workspace(), or %mesh sync
    print(report)                             # per host: added, modified, deleted

Per host, not per proc; content-hashed; only what a host lacks travels. See
``workspace.py`` for where files land, ``reload.py`` for what happens to live actors.
"""
from .manifest import DEFAULT_EXCLUDES, SyncTooLarge
from .paths import SyncRefused, SyncWriteError
from .sender import Progress
from .workspace import SyncError, SyncReport, resolve_roots, sync_workspace

__all__ = ["DEFAULT_EXCLUDES", "Progress", "SyncError", "SyncRefused", "SyncReport", "SyncTooLarge",
           "SyncWriteError", "resolve_roots", "sync_workspace"]
