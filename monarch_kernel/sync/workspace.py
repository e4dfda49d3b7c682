"""``sync_workspace``: push local code (and optionally the environment) to every host of
a mesh, then have the procs pick it up.

Where things land on each host (under ``receiver.base_dir``):
  ``workspace/``        the controller's working directory; the procs' cwd and sys.path[0]
  ``roots/NAME-HASH/``  another folder given as PATH; on the procs' sys.path
  ``env/site-packages`` with ``env=True``: the active environment's site-packages
  ``editable/NAME-HASH`` with ``env=True``: each editable install's source folder
A PATH inside the working directory syncs only that part of ``workspace/``.
"""
from __future__ import annotations

import hashlib
import os
import sysconfig
import time
from dataclasses import dataclass, field
from typing import Callable

from monarch_kernel import config
from monarch_kernel.core.errors import MeshGoneError, MonarchError
from monarch_kernel.core.mesh import state_of, view_of
from monarch_kernel.core.mesh_tables import RANKS_CHARS, alike, rank_ranges

from .manifest import Problem, build_manifest, human
from .reload import ACTOR_NAME, SyncActor
from .sender import HostTarget, Progress, push_root

RELOAD_TIMEOUT_S = 120.0


class SyncError(MonarchError):
    """Some hosts could not be synced; ``report`` says which and what the others got."""

    def __init__(self, message: str, report: SyncReport):
        super().__init__(message)
        self.report = report


@dataclass
class Root:
    src: str
    dest: str
    scope: str = ""
    cwd: bool = False
    on_path: bool = True
    env: bool = False


@dataclass
class SyncReport:
    """What one sync did, per host; ``str(report)`` is the summary ``%mesh sync`` prints."""

    roots: list[Root]
    hosts: list[HostTarget]
    problems: list[Problem] = field(default_factory=list)
    reload: dict = field(default_factory=dict)    # proc mesh name -> {rank: result}
    dry_run: bool = False
    elapsed_s: float = 0.0
    hashed_bytes: int = 0

    @property
    def ok(self) -> bool:
        return all(t.ok for t in self.hosts)

    @property
    def failed_hosts(self) -> list[HostTarget]:
        return [t for t in self.hosts if not t.ok]

    def changes(self, host: int = 0) -> dict[str, list[str]]:
        """{'added': [...], 'modified': [...], 'deleted': [...]} on one host, paths as
        ``dest/relpath``."""
        out = {"added": [], "modified": [], "deleted": []}
        for dest, r in self.hosts[host].roots.items():
            for k in out:
                out[k] += [f"{dest}/{p}" for p in r.get(k, ())]
        return out

    @property
    def files_sent(self) -> int:
        return sum(t.files_sent for t in self.hosts)

    @property
    def bytes_sent(self) -> int:
        return sum(t.bytes_wire for t in self.hosts)

    def __str__(self) -> str:
        verb = "would sync" if self.dry_run else "synced"
        srcs = ", ".join(sorted({r.src + ("/" + r.scope if r.scope else "") for r in self.roots}))
        raw = sum(t.bytes_raw for t in self.hosts)
        lines = [f"{verb} {srcs} to {len(self.hosts)} host(s) in {self.elapsed_s:.2f} s: "
                 f"{self.files_sent} file(s) sent ({human(raw)}, {human(self.bytes_sent)} on the wire)"]
        for i, t in enumerate(self.hosts):
            if not t.ok:
                lines.append(f"  {t.host}: FAILED: {t.error}. The other hosts are done; sync again to "
                             "complete this one")
                continue
            c = self.changes(i)
            ws = next((r["root"] for d, r in t.roots.items() if d == "workspace"), None)
            where = f"  ({ws})" if ws else ""
            lines.append(f"  {t.host}: {len(c['added'])} added, {len(c['modified'])} modified, "
                         f"{len(c['deleted'])} deleted{where}")
            for k, sign in (("added", "+"), ("modified", "~"), ("deleted", "-")):
                for p in c[k][:10]:
                    lines.append(f"    {sign} {p}")
                if len(c[k]) > 10:
                    lines.append(f"    {sign} ... {len(c[k]) - 10} more")
            for r in t.roots.values():
                for path, why in r.get("problems", ()):
                    lines.append(f"    ! {path}: {why}")
        for p in self.problems:
            lines.append(f"  ! {p.path}: {p.why}")
        for mesh, by_rank in self.reload.items():
            lines.extend(_reload_lines(mesh, by_rank))
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<SyncReport ok={self.ok} files_sent={self.files_sent}>\n{self}"


def _reload_lines(mesh: str, by_rank: dict) -> list[str]:
    if isinstance(by_rank, str):
        return [f"  procs '{mesh}': {by_rank}"]
    names = sorted({m for r in by_rank.values() if isinstance(r, dict) for m in r.get("reloaded", ())})
    out = []
    if names:
        out.append(f"  procs '{mesh}': reloaded {', '.join(names)} on {len(by_rank)} rank(s)")
    said: list[tuple[int, str]] = []   # what ranks say alike is one line (256 ranks, one failure)
    for rank, r in sorted(by_rank.items()):
        if not isinstance(r, dict):
            said.append((rank, str(r)))
            continue
        for m, err in r.get("failed", {}).items():
            said.append((rank, f"reloading {m} failed ({err}); it keeps the old code"))
        for m in r.get("needs_restart", ()):
            said.append((rank, f"{m} is compiled; restart the procs to use the new one"))
        runtime = [n for n in r.get("runtime") or () if not n.startswith("__")]   # not __main__ (the zygote)
        if runtime:
            said.append((rank, f"{len(runtime)} of the runtime's own modules changed ({', '.join(sorted(runtime)[:3])}"
                               f"{', ...' if len(runtime) > 3 else ''}): a proc runs them, so they are not reloaded "
                               "in place; `%mesh stop` then `%mesh connect` starts procs with the new code"))
    out += [f"  procs '{mesh}' {rank_ranges(ranks, RANKS_CHARS)}: {text}" for ranks, text in alike(said)]
    return out


# ---------------------------------------------------------------------------- roots
def _tag(path: str) -> str:
    return f"{os.path.basename(path.rstrip('/')) or 'root'}-{hashlib.sha1(path.encode()).hexdigest()[:6]}"


def resolve_roots(paths=None, env: bool | str = False, cwd: str | None = None) -> list[Root]:
    """Turn PATH arguments (default: the working directory) into destination roots."""
    cwd = os.path.abspath(cwd or os.getcwd())
    roots: list[Root] = []
    for p in (paths or [cwd]):
        ap = os.path.abspath(os.path.expanduser(str(p)))
        if not os.path.lexists(ap):
            raise FileNotFoundError(f"cannot sync {str(p)!r}: it does not exist (looked for {ap}). Give "
                                    f"an existing file or folder, or no PATH for the working directory {cwd}")
        if ap == cwd or ap.startswith(cwd + os.sep):
            roots.append(Root(cwd, "workspace", os.path.relpath(ap, cwd).replace(os.sep, "/")
                              if ap != cwd else "", cwd=True))
        elif os.path.isdir(ap):
            roots.append(Root(ap, f"roots/{_tag(ap)}"))
        else:
            parent = os.path.dirname(ap)
            roots.append(Root(parent, f"roots/{_tag(parent)}", os.path.basename(ap)))
    if env:
        site = env if isinstance(env, str) else sysconfig.get_paths()["purelib"]
        if not os.path.isdir(site):
            raise FileNotFoundError(f"cannot sync the environment: {site!r} is not a folder")
        roots.append(Root(os.path.abspath(site), "env/site-packages", env=True))
        synced = {r.src for r in roots if not r.scope}
        for src in editable_sources(site):
            if src not in synced:
                roots.append(Root(src, f"editable/{_tag(src)}", env=True))
                synced.add(src)
    return roots


def editable_sources(site: str) -> list[str]:
    """Source folders of editable installs: folders named by ``.pth`` lines in ``site``
    (setuptools, hatchling, flit, pdm and uv all write one per editable project)."""
    out = []
    site = os.path.realpath(site)
    for name in sorted(os.listdir(site)):
        if not name.endswith(".pth"):
            continue
        try:
            with open(os.path.join(site, name), encoding="utf-8", errors="replace") as f:
                lines = f.read().splitlines()
        except OSError:
            continue
        for line in lines:
            line = line.strip()
            if not line or line.startswith(("#", "import ", "import\t")):
                continue
            path = os.path.realpath(os.path.join(site, line))
            if os.path.isdir(path) and not path.startswith(site + os.sep) and path not in out:
                out.append(path)
    return out


# ---------------------------------------------------------------------------- meshes
def _targets(mesh) -> tuple[list[HostTarget], list]:
    from monarch_kernel.core.hosts import HostMesh
    from monarch_kernel.core.mesh import ProcMesh

    if isinstance(mesh, ProcMesh):
        st = state_of(mesh)
        if st.stopped:
            raise MeshGoneError(f"proc mesh '{st.name}' was stopped; spawn a new one to sync to")
        hm = st.host_mesh
        if hm is None:
            seen = {}
            for ref in st.procs:
                seen.setdefault(ref.agent, HostTarget(ref.agent, st.key, ref.host))
            return list(seen.values()), [mesh]
        mesh = hm
    if not isinstance(mesh, HostMesh):
        raise TypeError(f"sync_workspace needs a ProcMesh or HostMesh, got {type(mesh).__name__}")
    mesh.check_attached()
    targets = [HostTarget(a["addr"], mesh.mesh_key, info.get("host") or a.get("host") or a["addr"])
               for a, info in mesh.agents_and_infos()]
    return targets, list(mesh.proc_meshes.values())


def sync_workspace(mesh, paths=None, *, env: bool | str = False, dry_run: bool = False,
                   reload: bool = True, excludes=(), max_bytes: int | None = None,
                   progress: Callable[[Progress], None] | None = None) -> SyncReport:
    """Push ``paths`` (default: the working directory) to every host of ``mesh``, once per
    host, sending only files a host lacks; then the procs reload changed modules.

    ``env=True`` also syncs the active environment's site-packages and the source folders
    of its editable installs (or pass a site-packages path). ``excludes``: extra
    .gitignore-style patterns. Raises FileNotFoundError for a missing PATH, SyncTooLarge
    for a tree over ``max_bytes`` (default 1 GB, 10 GB for the environment), and
    SyncError (with ``.report``) when some hosts failed after the others finished."""
    from .manifest import CACHE

    t0 = time.perf_counter()
    targets, proc_meshes = _targets(mesh)
    roots = resolve_roots(paths, env)
    hashed0 = CACHE.hashed_bytes
    manifests = []
    for r in roots:
        limit = max_bytes
        if limit is None:
            limit = (config.SYNC_ENV_MAX_BYTES if r.env else config.SYNC_MAX_BYTES).get()
        manifests.append(build_manifest(r.src, r.scope, excludes=excludes, max_bytes=limit))
    report = SyncReport(roots, targets, dry_run=dry_run)
    for r, m in zip(roots, manifests, strict=True):
        report.problems += [Problem(f"{r.src}/{p.path}", p.why) for p in m.problems]
        push_root(targets, r.dest, m, {"on_path": r.on_path, "cwd": r.cwd}, dry_run=dry_run,
                  progress=progress)
    report.hashed_bytes = CACHE.hashed_bytes - hashed0
    if not dry_run and any(t.ok for t in targets):
        by_agent = {}
        for t in targets:
            if not t.ok or not t.roots:
                continue
            setup = next((r.get("setup") for r in reversed(list(t.roots.values())) if r.get("setup")), None)
            changes = [{"src": root.src, "dest": t.roots[root.dest]["root"],
                        "modified": t.roots[root.dest]["added"] + t.roots[root.dest]["modified"],
                        "deleted": t.roots[root.dest]["deleted"]}
                       for root in roots if root.dest in t.roots]
            by_agent[t.agent] = {"setup": setup, "changes": changes}
        for pm in proc_meshes:
            report.reload[pm.name] = _apply(pm, by_agent, reload)
    report.elapsed_s = time.perf_counter() - t0
    if not report.ok:
        bad = ", ".join(f"{t.host} ({t.error})" for t in report.failed_hosts)
        raise SyncError(f"sync failed on {len(report.failed_hosts)} of {len(targets)} host(s): {bad}. "
                        "The other hosts are synced; run the sync again to complete these.\n\n"
                        f"{report}", report)
    return report


def _apply(pm, by_agent: dict, reload: bool):
    """Run SyncActor.apply on every live proc of ``pm``: {rank: result}."""
    from monarch_kernel.core.shape import MeshView

    try:
        am = pm.actor_mesh(ACTOR_NAME)
    except KeyError:
        if pm.dead_ranks():
            return f"not set up: dead ranks {pm.dead_ranks()}; respawn() them, then sync again"
        am = pm.spawn(ACTOR_NAME, SyncActor)
    dead = set(pm.dead_ranks())
    ranks = [r for r in view_of(am).ranks if r not in dead]
    try:
        if not dead:
            values = am.apply.call(by_agent, reload).get(RELOAD_TIMEOUT_S).values()
            return dict(zip(ranks, values, strict=True))
        out = {}
        for r in ranks:
            one = type(am)(state_of(am), MeshView((), (), (r,)))
            out[r] = one.apply.call_one(by_agent, reload).get(RELOAD_TIMEOUT_S)
        return out
    except Exception as e:
        return f"could not apply the sync: {e}"
