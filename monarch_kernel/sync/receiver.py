"""The receiving side of code sync: one per host, inside the host agent.

The agent forwards every op named ``sync_*`` here (``handle``); each op does a bounded
amount of work (one plan, or one chunk of at most a few MB), so the agent's loop stays
responsive to heartbeats and proc deaths while a large tree arrives.

Protocol, per destination root and sync id:
  ``sync_plan(sid, dest, scope, entries, keep)`` -> what this host lacks, what it will
      delete, where the root lives. Every path is checked first: absolute paths, ``..``,
      and symlink targets that leave the root are refused, the whole plan with them.
  ``sync_put(sid, pieces)`` -> bytes written. A piece is (path, offset, data, codec,
      final); a file is written to a temp file beside the root, its sha256 checked, then
      renamed into place (atomic), so a reader never sees half a file.
  ``sync_commit(sid)`` -> the summary; deletions happen here, and only of files an
      earlier sync wrote (the index), never of files the procs created themselves.
  ``sync_abort(sid)``, ``sync_info()``. Path rules live in paths.py.
The index (path -> size, mtime, mode, digest, link) is kept per root in
``BASE/.index/``; a file present but missing from it (an agent killed mid-sync) is
hashed again, within a time budget, so a later sync sends only what is really missing.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import socket
import stat
import time
import zlib
from pathlib import Path

from .paths import (
    SyncRefused,
    SyncWriteError,
    _check_link,
    _drop_pyc,
    _in_scope,
    _prune_dirs,
    _unlink,
    _write_json,
    check_rel,
)
from .paths import base_dir as base_dir  # re-exported: the host agent imports it from here

RECOVER_BUDGET_S = 1.0


class _Sync:
    __slots__ = ("dest", "root", "scope", "entries", "need", "added", "open", "written",
                 "bytes", "problems", "index", "dirty", "tmp_n", "dirs_ok", "chmod")

    def __init__(self, dest, root, scope, entries, index):
        self.dest, self.root, self.scope, self.entries, self.index = dest, root, scope, entries, index
        self.need: set[str] = set()
        self.added: set[str] = set()
        self.open: dict[str, tuple] = {}   # rel -> (file, hasher, tmp path, size so far)
        self.written: list[str] = []
        self.bytes = 0
        self.problems: list[tuple[str, str]] = []
        self.dirty = False   # the index changed: save it at commit
        self.tmp_n = 0
        self.dirs_ok: set = set()
        self.chmod: list[str] = []


class SyncReceiver:
    def __init__(self, base: str | os.PathLike, host: str = "", agent_addr: str = ""):
        self.base = Path(base)
        self.tmp_dir = str(self.base / ".tmp")
        self.host = host or socket.gethostname()
        self.agent_addr = agent_addr
        self.syncs: dict[str, _Sync] = {}
        self.indexes: dict[str, dict] = {}
        self.roots: dict[str, dict] = {}     # dest -> {"path", "on_path", "cwd"}: procs' set-up
        self._setup_changed = False
        self._load_setup()

    # ------------------------------------------------------------------ dispatch
    def handle(self, op: str, args: tuple):
        fn = getattr(self, "op_" + op.removeprefix("sync_"), None)
        if fn is None:
            raise ValueError(f"unknown sync op {op!r}")
        return fn(*args)

    def proc_setup(self) -> dict | None:
        """What a new proc needs (sys.path entries, cwd): sent in its fork config."""
        if not self.roots:
            return None
        paths = [r["path"] for r in self.roots.values() if r.get("on_path")]
        cwd = next((r["path"] for r in self.roots.values() if r.get("cwd")), None)
        return {"sys_path": paths, "cwd": cwd}

    def op_info(self):
        return {"host": self.host, "base": str(self.base), "agent": self.agent_addr,
                "setup": self.proc_setup()}

    # ------------------------------------------------------------------ plan
    def op_plan(self, sid: str, dest: str, scope: str, entries: list, keep: list, opts: dict):
        check_rel(dest, "destination")
        if scope:
            check_rel(scope, "scope")
        seen = set()
        for e in entries:
            rel = check_rel(e[0])
            if scope and not (rel == scope or rel.startswith(scope + "/")):
                raise SyncRefused(f"refused: path {rel!r} is outside the synced scope {scope!r}")
            if e[4] is not None:
                _check_link(rel, e[4])
            seen.add(rel)
        for k in keep:
            if k:
                check_rel(k)
        root = self.base / dest
        root.mkdir(parents=True, exist_ok=True)
        self._clean_tmp()
        index = self._index(dest)
        sync = _Sync(dest, root, scope, {e[0]: e for e in entries}, index)
        add, modify, chmod = [], [], []
        budget = time.monotonic() + RECOVER_BUDGET_S
        prefix = str(root) + os.sep
        for rel, size, mode, digest, link in entries:
            path = prefix + rel
            try:
                st = os.lstat(path)
            except (FileNotFoundError, NotADirectoryError):
                add.append(rel)
                continue
            have = index.get(rel)
            if link is not None:
                if stat.S_ISLNK(st.st_mode) and os.readlink(path) == link:
                    if have != [0, 0, 0o777, None, link]:
                        index[rel] = [0, 0, 0o777, None, link]
                        sync.dirty = True
                else:
                    modify.append(rel)
                continue
            if not stat.S_ISREG(st.st_mode):
                modify.append(rel)
                continue
            if have and have[0] == st.st_size and have[1] == st.st_mtime_ns and have[4] is None:
                got = bytes.fromhex(have[3])
            elif st.st_size == size and time.monotonic() < budget:
                with open(path, "rb") as f:      # recovered: written by an interrupted sync
                    got = hashlib.file_digest(f, "sha256").digest()
            else:
                modify.append(rel)
                continue
            if got != digest:
                modify.append(rel)
                continue
            entry = [st.st_size, st.st_mtime_ns, mode, digest.hex(), None]
            if have != entry:
                index[rel] = entry
                sync.dirty = True
            if stat.S_IMODE(st.st_mode) != mode:
                chmod.append(rel)
        keep_set = set(keep)
        delete = sorted(rel for rel in index if rel not in seen and _in_scope(rel, scope)
                        and not any(rel == k or rel.startswith(k + "/") for k in keep_set))
        sync.need = set(add) | set(modify)
        sync.chmod = chmod
        sync.added = set(add)
        self.syncs[sid] = sync
        if opts.get("dry_run"):
            del self.syncs[sid]
            return {"add": add, "modify": modify, "delete": delete, "chmod": chmod, "root": str(root),
                    "host": self.host, "agent": self.agent_addr}
        before = json.dumps(self.roots, sort_keys=True)
        self.roots[dest] = {"path": str(root), "on_path": bool(opts.get("on_path", True)),
                            "cwd": bool(opts.get("cwd", False))}
        if opts.get("cwd"):
            for d, r in self.roots.items():
                if d != dest:
                    r["cwd"] = False
        self._setup_changed |= before != json.dumps(self.roots, sort_keys=True)
        return {"add": add, "modify": modify, "delete": delete, "chmod": chmod, "root": str(root),
                "host": self.host, "agent": self.agent_addr}

    # ------------------------------------------------------------------ data
    def op_put(self, sid: str, pieces: list) -> int:
        sync = self._sync(sid)
        n = 0
        for rel, offset, data, codec, final in pieces:
            if rel not in sync.need:
                raise SyncRefused(f"refused: {rel!r} was not asked for in this sync")
            raw = zlib.decompress(data) if codec == 1 else data
            cur = sync.open.get(rel)
            if cur is None:
                if offset != 0:
                    raise ValueError(f"{rel!r}: chunk at offset {offset} before its start")
                sync.tmp_n += 1
                tmp = os.path.join(self.tmp_dir, f"{sid}-{sync.tmp_n}")
                try:
                    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                except FileNotFoundError:
                    os.makedirs(self.tmp_dir, exist_ok=True)
                    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                except OSError as e:
                    self._fail_write(sync, rel, e)
                cur = (fd, hashlib.sha256(), tmp, 0)
            fd, h, tmp, size = cur
            if offset != size:
                self._discard(sync, rel, cur)
                raise ValueError(f"{rel!r}: chunk at offset {offset}, expected {size}")
            try:
                view = memoryview(raw)
                while view:
                    view = view[os.write(fd, view):]
            except OSError as e:
                self._discard(sync, rel, cur)
                self._fail_write(sync, rel, e)
            h.update(raw)
            n += len(raw)
            cur = (fd, h, tmp, size + len(raw))
            sync.open[rel] = cur
            if final:
                self._finish(sync, rel, cur)
        sync.bytes += n
        return n

    def _finish(self, sync: _Sync, rel: str, cur) -> None:
        fd, h, tmp, size = cur
        del sync.open[rel]
        _, want_size, mode, digest, link = sync.entries[rel]
        if link is not None or h.digest() != digest or size != want_size:
            os.close(fd)
            _unlink(tmp)
            if link is None:
                sync.problems.append((rel, "changed while it was being synced; sync again"))
            return
        try:
            os.fchmod(fd, mode)
            st = os.fstat(fd)          # a rename keeps size and mtime
            os.close(fd)
            dest = self._target(sync, rel)
            try:
                os.replace(tmp, dest)
            except IsADirectoryError:
                shutil.rmtree(dest)    # a folder where a file now goes
                os.replace(tmp, dest)
        except SyncRefused:
            _unlink(tmp)
            raise
        except OSError as e:
            _unlink(tmp)
            self._fail_write(sync, rel, e)
        if rel.endswith(".py") and rel not in sync.added:
            _drop_pyc(dest)   # a same-second, same-size edit would otherwise keep a stale .pyc
        sync.index[rel] = [st.st_size, st.st_mtime_ns, mode, digest.hex(), None]
        sync.written.append(rel)

    def _target(self, sync: _Sync, rel: str) -> str:
        """The absolute path for ``rel``, after making its folder; refuses a parent folder
        that is (or passes through) a symlink leaving the root. Checked once per folder
        per sync."""
        dest = sync.root / rel
        parent = dest.parent
        if parent in sync.dirs_ok:
            return str(dest)
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            p = parent
            while p != sync.root and not p.is_dir():   # a file where a folder now goes
                if p.exists() or p.is_symlink():
                    p.unlink()
                    break
                p = p.parent
            parent.mkdir(parents=True, exist_ok=True)
        real_root = os.path.realpath(sync.root)
        real_parent = os.path.realpath(parent)
        if real_parent != real_root and not real_parent.startswith(real_root + os.sep):
            raise SyncRefused(f"refused: {rel!r} would be written through a symlink to {real_parent}, "
                              "outside the destination")
        sync.dirs_ok.add(parent)
        return str(dest)

    def _fail_write(self, sync: _Sync, rel: str, e: OSError):
        for r, cur in list(sync.open.items()):
            self._discard(sync, r, cur)
        free = shutil.disk_usage(self.base).free if self.base.exists() else 0
        if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise SyncWriteError(e.errno, f"no space left on {self.host} writing {rel!r} under "
                                 f"{sync.root} ({free} bytes free); the file was not changed. Free "
                                 "space there, or point MONARCH_KERNEL_SYNC_DIR at a larger disk") from None
        raise SyncWriteError(e.errno, f"cannot write {rel!r} under {sync.root} on {self.host}: "
                             f"{e.strerror or e}; the file was not changed") from None

    def _discard(self, sync, rel, cur):
        sync.open.pop(rel, None)
        try:
            os.close(cur[0])
        except OSError:
            pass
        _unlink(cur[2])

    # ------------------------------------------------------------------ commit
    def op_commit(self, sid: str, delete: bool = True) -> dict:
        sync = self.syncs.pop(sid, None)
        if sync is None:
            raise ValueError(f"no sync {sid!r} in progress on {self.host} (it was aborted, or the "
                             "agent restarted); sync again")
        for rel, cur in list(sync.open.items()):
            self._discard(sync, rel, cur)
            sync.problems.append((rel, "incomplete: its last chunk never arrived"))
        index = sync.index
        for rel, e in sync.entries.items():   # links and mode-only changes
            if e[4] is not None and rel in sync.need:
                dest = self._target(sync, rel)
                if os.path.lexists(dest):
                    os.unlink(dest)
                os.symlink(e[4], dest)
                index[rel] = [0, 0, 0o777, None, e[4]]
                sync.written.append(rel)
        chmodded = []
        for rel in sync.chmod:           # same content, new permission bits
            mode = sync.entries[rel][2]
            try:
                os.chmod(sync.root / rel, mode)
                chmodded.append(rel)
                index[rel][2] = mode
            except (OSError, KeyError):
                pass
        deleted = []
        if delete:
            seen = sync.entries
            for rel in sorted(index):
                if rel in seen or not _in_scope(rel, sync.scope):
                    continue
                p = sync.root / rel
                real = os.path.realpath(p.parent)
                rr = os.path.realpath(sync.root)
                if real == rr or real.startswith(rr + os.sep):
                    _unlink(str(p))
                    _prune_dirs(p.parent, sync.root)
                del index[rel]
                deleted.append(rel)
        if sync.dirty or sync.written or deleted or chmodded:
            self._save_index(sync.dest, index)
        if self._setup_changed:
            self._save_setup()
            self._setup_changed = False
        written = set(sync.written)
        return {"host": self.host, "root": str(sync.root),
                "added": sorted(written & sync.added), "modified": sorted(written - sync.added),
                "deleted": deleted, "chmod": chmodded, "bytes": sync.bytes, "problems": sync.problems,
                "setup": self.proc_setup()}

    def op_abort(self, sid: str) -> None:
        sync = self.syncs.pop(sid, None)
        if sync is not None:
            for rel, cur in list(sync.open.items()):
                self._discard(sync, rel, cur)

    # ------------------------------------------------------------------ state on disk
    def _sync(self, sid):
        s = self.syncs.get(sid)
        if s is None:
            raise ValueError(f"no sync {sid!r} in progress on {self.host}; sync again")
        return s

    def _index_path(self, dest: str) -> Path:
        return self.base / ".index" / (dest.replace("/", "%") + ".json")

    def _index(self, dest: str) -> dict:
        idx = self.indexes.get(dest)
        if idx is None:
            try:
                idx = json.loads(self._index_path(dest).read_text())
            except (OSError, ValueError):
                idx = {}
            self.indexes[dest] = idx
        return idx

    def _save_index(self, dest: str, index: dict) -> None:
        _write_json(self._index_path(dest), index)

    def _save_setup(self) -> None:
        _write_json(self.base / ".index" / "roots.json", self.roots)

    def _load_setup(self) -> None:
        try:
            self.roots = json.loads((self.base / ".index" / "roots.json").read_text())
        except (OSError, ValueError):
            self.roots = {}

    def _clean_tmp(self) -> None:
        if self.syncs:
            return   # another sync is under way: its temp files are live
        tmp = self.base / ".tmp"
        if tmp.is_dir():
            for p in tmp.iterdir():
                _unlink(str(p))
