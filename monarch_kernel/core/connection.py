"""Connection files: how a controller finds a named mesh (agents' addresses and its key).

They live in ``$MONARCH_KERNEL_HOME/meshes/NAME.json`` (default ``~/.monarch_kernel``),
created ``0600`` inside a ``0700`` folder, because the key in them lets a holder run code.
"""
from __future__ import annotations

import json
import os
import re
import secrets
from pathlib import Path

from .. import config
from .errors import MeshGoneError

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def home() -> Path:
    return Path(config.HOME.get())


def mesh_dir() -> Path:
    d = home() / "meshes"
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    return d


def check_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"bad mesh name {name!r}: use letters, digits, '_', '.', '-' (at most 64), "
                         "starting with a letter or digit")
    return name


def connection_path(name: str) -> Path:
    return mesh_dir() / f"{check_name(name)}.json"


def new_key() -> bytes:
    return secrets.token_bytes(32)


def write_connection_file(path, info: dict) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(info, f)
    os.replace(tmp, path)


def read_connection_file(name: str) -> dict:
    path = connection_path(name)
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        known = ", ".join(sorted(p.stem for p in mesh_dir().glob("*.json"))) or "none"
        raise MeshGoneError(f"no mesh named {name!r} on this machine (known: {known}); start it with "
                            f"this_host({name!r}) or %mesh connect {name}") from None


def agent_alive(info: dict) -> bool:
    """True if every local agent pid in the file still runs (remote ones are not checked)."""
    return not agents_gone(info)


def agents_gone(info: dict) -> int:
    """How many of the file's local agents no longer run (remote ones are not checked)."""
    return sum(agent_gone(a) for a in info.get("agents", []))


def agent_gone(agent: dict) -> bool:
    """An agent (a connection file's entry) of this machine whose process has ended; False for
    another machine's, which cannot be checked from here."""
    import socket

    from .transport import pid_alive  # (a zombie is gone: an agent exited, its parent not reaping it yet)

    return agent.get("host") == socket.gethostname() and bool(agent.get("pid")) and not pid_alive(agent["pid"])


def list_meshes() -> list[tuple[str, dict, bool]]:
    out = []
    for p in sorted(mesh_dir().glob("*.json")):
        try:
            info = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        out.append((p.stem, info, agent_alive(info)))
    return out
