"""Where synced files live on a host, which paths a manifest may name, small file helpers.

The receiver trusts nothing in a manifest: every path must be relative, posix, free of
``.``/``..``/empty parts and NUL, and every symlink target must stay inside the root.
"""
from __future__ import annotations

import json
import os
import socket
from pathlib import Path

from monarch_kernel import config


class SyncRefused(ValueError):
    """A manifest path or link target that would leave the destination."""


class SyncWriteError(OSError):
    """A write failed on the receiving host (disk full, permissions); nothing half-written
    was left in place."""


def base_dir(agent_name: str) -> Path:
    """Where this host keeps synced trees: ``$MONARCH_KERNEL_SYNC_DIR`` or
    ``$MONARCH_KERNEL_HOME/workspaces/<agent>-<hostname>``."""
    env = config.SYNC_DIR.get()
    if env:
        return Path(env)
    from monarch_kernel.core.connection import home

    return home() / "workspaces" / f"{agent_name}-{socket.gethostname()}"


def check_rel(rel, what: str = "path") -> str:
    """A manifest path must be relative, posix, and stay inside the destination."""
    if not isinstance(rel, str) or not rel:
        raise SyncRefused(f"refused: {what} {rel!r} is not a non-empty string")
    if "\0" in rel:
        raise SyncRefused(f"refused: {what} {rel!r} contains a NUL byte")
    if rel.startswith("/") or os.path.isabs(rel):
        raise SyncRefused(f"refused: {what} {rel!r} is absolute; manifests hold paths relative "
                          "to the synced folder")
    parts = rel.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise SyncRefused(f"refused: {what} {rel!r} has an empty, '.' or '..' part and could "
                          "escape the destination")
    return rel


def _check_link(rel: str, target) -> None:
    if not isinstance(target, str) or not target or target.startswith("/") or "\0" in target:
        raise SyncRefused(f"refused: symlink {rel!r} -> {target!r}: targets must be relative")
    joined = os.path.normpath(os.path.join(os.path.dirname(rel), target))
    if joined == ".." or joined.startswith("../") or os.path.isabs(joined):
        raise SyncRefused(f"refused: symlink {rel!r} -> {target!r} points outside the destination")


def _in_scope(rel: str, scope: str) -> bool:
    return not scope or rel == scope or rel.startswith(scope + "/")


def _write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        pass


def _drop_pyc(path: str) -> None:
    folder, name = os.path.split(path)
    cache = os.path.join(folder, "__pycache__")
    stem = name[:-3] + "."
    try:
        for f in os.listdir(cache):
            if f.startswith(stem) and f.endswith(".pyc"):
                _unlink(os.path.join(cache, f))
    except OSError:
        pass


def _prune_dirs(folder: Path, root: Path) -> None:
    while folder != root and root in folder.parents:
        try:
            folder.rmdir()
        except OSError:
            return
        folder = folder.parent
