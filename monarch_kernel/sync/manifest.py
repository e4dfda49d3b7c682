"""The sending side's view of a tree: walk it, apply excludes, hash what is left.

A manifest lists (path, size, mode, sha256, link target) for every file the sync would
send. Hashes are cached per absolute path by (size, mtime_ns, inode), so a no-op sync of a
large tree only stats it. A file modified within ``RACY_S`` of being hashed is not cached
(filesystem timestamps are coarse: a second write in the same tick keeps the mtime), the
same "racily clean" rule git uses.

Excludes follow ``.gitignore`` syntax (``*``, ``**``, ``?``, ``[...]``, ``!negation``,
trailing ``/`` for folders, a ``/`` inside anchors to the file's folder). Rules come from
``DEFAULT_EXCLUDES``, every ``.gitignore`` in the tree (scoped to its folder), the root's
``.meshignore`` and the caller's ``excludes``, in that order; the last match wins.
"""
from __future__ import annotations

import hashlib
import os
import re
import stat
import time
from typing import NamedTuple

DEFAULT_EXCLUDES = (
    ".git/", ".hg/", ".svn/", "__pycache__/", "*.pyc", "*.pyo", ".venv/", ".mypy_cache/",
    ".pytest_cache/", ".ruff_cache/", ".ipynb_checkpoints/", ".tox/", ".nox/", ".cache/",
    ".DS_Store", ".monarch-sync/",
)
RACY_S = 1.0


class Entry(NamedTuple):
    """One file of a manifest. ``digest`` is None for a symlink (``link`` holds its target,
    relative and inside the tree)."""

    path: str          # posix, relative to the root
    size: int
    mode: int          # permission bits
    digest: bytes | None
    link: str | None = None


class Problem(NamedTuple):
    path: str
    why: str


class Manifest(NamedTuple):
    root: str                 # absolute source folder
    scope: str                # "" for the whole root, else the relative path synced
    entries: list[Entry]
    problems: list[Problem]   # unreadable files, symlinks leaving the tree
    keep: list[str]           # paths the receiver must not delete (unreadable here)
    total_bytes: int
    walk_s: float


class SyncTooLarge(ValueError):
    """The tree is over the size limit; the message names its largest parts."""


# ---------------------------------------------------------------------------- excludes
def _translate(pat: str) -> str:
    out, i, n = [], 0, len(pat)
    while i < n:
        if pat.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
            continue
        if pat.startswith("/**", i) and i + 3 == n:
            out.append("/.*")
            i += 3
            continue
        if pat.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        c = pat[i]
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            j = pat.find("]", i + 2)
            if j == -1:
                out.append(r"\[")
            else:
                body = pat[i + 1:j]
                if body[0] in "!^":
                    body = "^" + body[1:]
                out.append("[" + body.replace("\\", "\\\\") + "]")
                i = j
        elif c == "\\" and i + 1 < n:
            i += 1
            out.append(re.escape(pat[i]))
        else:
            out.append(re.escape(c))
        i += 1
    return "".join(out)


class Rule(NamedTuple):
    base: str          # folder (relative to the root, "" = root) the rule is scoped to
    regex: re.Pattern
    negate: bool
    dir_only: bool
    anchored: bool     # matched against the path from base; else against the name
    text: str


def parse_rules(lines, base: str = "") -> list[Rule]:
    rules = []
    for raw in lines:
        line = raw.rstrip("\n").rstrip("\r")
        if not line.strip() or line.startswith("#"):
            continue
        line = line.rstrip(" ") if not line.endswith("\\ ") else line
        negate = line.startswith("!")
        if negate:
            line = line[1:]
        if line.startswith("\\"):
            line = line[1:] if line[1:2] in ("#", "!") else line
        dir_only = line.endswith("/")
        line = line.rstrip("/")
        if not line:
            continue
        anchored = "/" in line
        line = line.lstrip("/")
        rules.append(Rule(base, re.compile(_translate(line) + r"\Z", re.S), negate, dir_only, anchored, raw))
    return rules


class Excludes:
    """Ordered rules; ``excluded(rel, is_dir)`` -> the last matching rule decides."""

    def __init__(self, rules: list[Rule]):
        self.rules = rules
        self._fast = None     # without negations order does not matter: one regex per kind
        if not any(r.negate for r in rules):
            groups: dict[tuple, list[str]] = {}
            for r in rules:
                groups.setdefault((r.base, r.anchored, r.dir_only), []).append(r.regex.pattern)
            self._fast = [(base, anchored, dir_only, re.compile("|".join(f"(?:{p})" for p in pats), re.S))
                          for (base, anchored, dir_only), pats in groups.items()]

    def extended(self, more: list[Rule]) -> Excludes:
        return Excludes(self.rules + more) if more else self

    def excluded(self, rel: str, name: str, is_dir: bool) -> bool:
        if self._fast is not None:
            for base, anchored, dir_only, rx in self._fast:
                if dir_only and not is_dir:
                    continue
                if base:
                    if not rel.startswith(base + "/"):
                        continue
                    sub = rel[len(base) + 1:]
                else:
                    sub = rel
                if rx.match(sub if anchored else name):
                    return True
            return False
        for r in reversed(self.rules):
            if r.dir_only and not is_dir:
                continue
            if r.base:
                if not rel.startswith(r.base + "/"):
                    continue
                sub = rel[len(r.base) + 1:]
            else:
                sub = rel
            if r.regex.match(sub if r.anchored else name):
                return not r.negate
        return False


def root_excludes(root: str, extra=(), defaults=DEFAULT_EXCLUDES) -> Excludes:
    rules = parse_rules(defaults)
    for fname in (".gitignore", ".meshignore"):
        try:
            with open(os.path.join(root, fname), encoding="utf-8", errors="replace") as f:
                rules += parse_rules(f)
        except OSError:
            pass
    return Excludes(rules + parse_rules(extra))


# ---------------------------------------------------------------------------- hashing
class HashCache:
    """abs path -> (size, mtime_ns, inode, digest); lives as long as the controller."""

    def __init__(self):
        self._d: dict[str, tuple[int, int, int, bytes]] = {}
        self.hashed_bytes = 0

    def digest(self, path: str, st: os.stat_result) -> bytes:
        hit = self._d.get(path)
        if hit is not None and hit[0] == st.st_size and hit[1] == st.st_mtime_ns and hit[2] == st.st_ino:
            return hit[3]
        now = time.time_ns()
        with open(path, "rb") as f:
            d = hashlib.file_digest(f, "sha256").digest()
        self.hashed_bytes += st.st_size
        if now - st.st_mtime_ns > RACY_S * 1e9:
            self._d[path] = (st.st_size, st.st_mtime_ns, st.st_ino, d)
        else:
            self._d.pop(path, None)
        return d


CACHE = HashCache()


# ---------------------------------------------------------------------------- the walk
def build_manifest(root: str, scope: str = "", excludes=(), max_bytes: int | None = None,
                   defaults=DEFAULT_EXCLUDES, cache: HashCache = CACHE) -> Manifest:
    """Walk ``root`` (or only ``root/scope``) and hash every file that is not excluded.

    Raises FileNotFoundError for a missing root or scope and SyncTooLarge past
    ``max_bytes`` (before hashing anything, naming the largest folders and files)."""
    t0 = time.perf_counter()
    root = os.path.abspath(root)
    if not os.path.isdir(root):
        raise FileNotFoundError(f"cannot sync {root!r}: no such folder")
    ex = root_excludes(root, extra=excludes, defaults=defaults)
    found: list[tuple[str, os.stat_result, str | None]] = []
    problems: list[Problem] = []
    keep: list[str] = []
    real_root = os.path.realpath(root)
    start = scope.strip("/")
    if start:
        full = os.path.join(root, start)
        if os.path.isfile(full) or os.path.islink(full):
            _consider(root, real_root, start, os.path.basename(start), found, problems)
            stack = []
        elif os.path.isdir(full):
            for part in _parents(start)[:-1]:
                ex = _with_gitignore(ex, root, part)
            stack = [(start, ex)]
        else:
            raise FileNotFoundError(f"cannot sync {full!r}: no such file or folder")
    else:
        stack = [("", ex)]
    while stack:
        rel_dir, ex_parent = stack.pop()
        ex_here = _with_gitignore(ex_parent, root, rel_dir) if rel_dir else ex_parent
        try:
            it = os.scandir(os.path.join(root, rel_dir) if rel_dir else root)
        except OSError as e:
            problems.append(Problem(rel_dir or ".", f"cannot list folder: {e.strerror}"))
            keep.append(rel_dir)
            continue
        subdirs = []
        with it:
            for de in it:
                rel = f"{rel_dir}/{de.name}" if rel_dir else de.name
                try:
                    is_dir = de.is_dir(follow_symlinks=False)
                except OSError:
                    is_dir = False
                if ex_here.excluded(rel, de.name, is_dir):
                    continue
                if is_dir:
                    subdirs.append((rel, ex_here))
                else:
                    _consider(root, real_root, rel, de.name, found, problems, de)
        stack.extend(sorted(subdirs, reverse=True))
    total = sum(st.st_size for _, st, link in found if link is None)
    if max_bytes is not None and total > max_bytes:
        raise SyncTooLarge(_too_large(root, found, total, max_bytes))
    entries = []
    root_sep = root + os.sep
    for rel, st, link in found:
        if link is not None:
            entries.append(Entry(rel, 0, 0o777, None, link))
            continue
        try:
            d = cache.digest(root_sep + rel, st)
        except OSError as e:
            problems.append(Problem(rel, f"cannot read: {e.strerror or e}"))
            keep.append(rel)
            continue
        entries.append(Entry(rel, st.st_size, stat.S_IMODE(st.st_mode), d))
    entries.sort()
    return Manifest(root, start, entries, problems, keep, total, time.perf_counter() - t0)


def _parents(rel: str):
    parts = rel.split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]


_GI_CACHE: dict[str, tuple[int, list[Rule]]] = {}


def _with_gitignore(ex: Excludes, root: str, rel_dir: str) -> Excludes:
    """Rules of ``root/rel_dir/.gitignore`` (scoped to that folder) added to ``ex``. Rules
    of folders above are already in ``ex`` because the walk passes them down."""
    path = os.path.join(root, rel_dir, ".gitignore")
    try:
        mt = os.stat(path).st_mtime_ns
    except OSError:
        return ex
    hit = _GI_CACHE.get(path)
    if hit is None or hit[0] != mt:
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                hit = _GI_CACHE[path] = (mt, parse_rules(f, base=rel_dir))
        except OSError:
            return ex   # an unreadable .gitignore excludes nothing (the file itself is reported)
    return ex.extended(hit[1])


def _consider(root, real_root, rel, name, found, problems, de=None):
    full = de.path if de is not None else os.path.join(root, rel)
    try:
        st = de.stat(follow_symlinks=False) if de is not None else os.lstat(full)
    except OSError as e:
        problems.append(Problem(rel, f"cannot stat: {e.strerror}"))
        return
    if stat.S_ISLNK(st.st_mode):
        try:   # a link we may not follow (e.g. /proc/1/cwd as a user) is a problem, not a crash
            target = os.readlink(full)
            dest = os.path.realpath(os.path.join(os.path.dirname(full), target))
        except OSError as e:
            problems.append(Problem(rel, f"cannot read symlink: {e.strerror or e}; not synced"))
            return
        if dest != real_root and not dest.startswith(real_root + os.sep):
            problems.append(Problem(rel, f"symlink leaves the tree (-> {target}); not synced"))
            return
        rel_target = os.path.relpath(dest, os.path.realpath(os.path.dirname(full)))
        found.append((rel, st, rel_target.replace(os.sep, "/")))
    elif stat.S_ISREG(st.st_mode):
        found.append((rel, st, None))
    else:
        problems.append(Problem(rel, "not a regular file (socket, fifo or device); not synced"))


def _too_large(root, found, total, limit) -> str:
    by_top: dict[str, int] = {}
    for rel, st, link in found:
        if link is None:
            top = rel.split("/", 1)[0] + ("/" if "/" in rel else "")
            by_top[top] = by_top.get(top, 0) + st.st_size
    biggest = sorted(by_top.items(), key=lambda kv: -kv[1])[:5]
    files = sorted(((st.st_size, rel) for rel, st, link in found if link is None), reverse=True)[:3]
    lines = [f"  {name:<40} {human(size)}" for name, size in biggest]
    lines += [f"  (largest file) {rel}  {human(size)}" for size, rel in files]
    have, cap = human(total), human(limit)
    if have == cap:   # "1.1 GB over the limit of 1.1 GB": say the bytes
        have, cap = f"{total:,} bytes", f"{limit:,} bytes"
    return (f"{root} holds {have} to sync, over the limit of {cap}. Largest parts:\n"
            + "\n".join(lines) + "\nExclude them in a .meshignore file in that folder (one pattern a "
            "line, .gitignore syntax, e.g. 'data/' or '*.ckpt'), pass excludes=[...] (--exclude), "
            "or raise the limit with max_bytes= (--max-size) or MONARCH_KERNEL_SYNC_MAX_BYTES.")


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"
