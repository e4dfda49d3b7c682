"""The controller's side of code sync: plan with every host, stream what each lacks.

One destination root at a time, every host at once: the manifest goes to each host's
agent (``sync_plan``); hosts that lack the same files form a group, and each file is read
and compressed once per group, then sent in batches of about ``BATCH_BYTES`` with at most
``WINDOW`` batches in flight per host. A host that fails (its agent dies, its disk fills)
is dropped and reported; the others go on. Runs on the calling thread; the runtime's
I/O thread carries the messages.
"""
from __future__ import annotations

import collections
import ipaddress
import os
import uuid
import zlib
from dataclasses import dataclass, field
from typing import Callable

from monarch_kernel import config
from monarch_kernel.core.runtime import runtime

from .manifest import Entry, Manifest

BATCH_BYTES = 1 << 20
CHUNK = 1 << 20
WINDOW = 8
PLAN_TIMEOUT_S = 60.0
PUT_TIMEOUT_S = 60.0
INCOMPRESSIBLE = frozenset(
    ".gz .tgz .bz2 .xz .zst .zip .whl .jar .7z .png .jpg .jpeg .gif .webp .mp4 .mp3 .pt .pth .ckpt "
    ".safetensors .npz .so .pyd .dylib .bin .parquet .onnx".split())


@dataclass
class HostTarget:
    """One host agent we push to, and what happened there."""

    addr: str
    key: bytes
    host: str
    error: str | None = None
    agent: str = ""                      # the agent's own address (as its procs know it)
    roots: dict = field(default_factory=dict)   # dest -> receiver's commit summary (or plan)
    files_sent: int = 0
    bytes_raw: int = 0
    bytes_wire: int = 0

    @property
    def ok(self) -> bool:
        return self.error is None

    def fail(self, why: BaseException | str) -> None:
        if self.error is None:
            self.error = why if isinstance(why, str) else f"{type(why).__name__}: {why}"


@dataclass
class Progress:
    root: str
    files_done: int
    files_total: int
    bytes_done: int
    bytes_total: int


def should_compress(targets: list[HostTarget]) -> bool:
    """zlib costs CPU on both ends and saves bandwidth: worth it across a network, not to an
    agent on this machine's loopback (``auto``); MONARCH_KERNEL_SYNC_COMPRESS overrides."""
    mode = config.SYNC_COMPRESS.get()   # auto | always | never
    if mode in ("always", "never"):
        return mode == "always"
    for t in targets:
        host = t.addr.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
        try:
            if not ipaddress.ip_address(host).is_loopback:
                return True
        except ValueError:
            if host != "localhost":
                return True
    return False


def _lost(t: HostTarget) -> bool:
    link = runtime().agents.get(t.addr)
    return link is not None and link.lost


def push_root(targets: list[HostTarget], dest: str, manifest: Manifest, opts: dict, *,
              dry_run: bool = False, progress: Callable[[Progress], None] | None = None) -> None:
    """Bring ``dest`` on every target host in line with ``manifest``."""
    rt = runtime()
    sid = uuid.uuid4().hex[:12]
    entries = [tuple(e) for e in manifest.entries]
    live = [t for t in targets if t.ok]
    futs = []
    for t in live:
        if _lost(t):
            t.fail(f"host agent {t.addr} is unreachable")
            continue
        futs.append((t, rt.agent_request(t.addr, t.key, "sync_plan", sid, dest, manifest.scope,
                                         entries, manifest.keep, {**opts, "dry_run": dry_run})))
    plans = {}
    for t, f in futs:
        try:
            plans[t.addr] = f.get(PLAN_TIMEOUT_S)
            t.agent = plans[t.addr]["agent"]
        except Exception as e:
            t.fail(e)
    if dry_run:
        for t in targets:
            if t.addr in plans:
                p = plans[t.addr]
                t.roots[dest] = {"root": p["root"], "added": p["add"], "modified": p["modify"],
                                 "deleted": p["delete"], "chmod": p["chmod"], "bytes": 0, "problems": []}
        return
    by_rel = {e.path: e for e in manifest.entries}
    groups: dict[tuple, list[HostTarget]] = collections.defaultdict(list)
    for t in targets:
        if t.addr in plans and t.ok:
            p = plans[t.addr]
            groups[tuple(sorted(p["add"] + p["modify"]))].append(t)
    total_files = sum(len(k) for k in groups)
    total_bytes = sum(by_rel[r].size for k in groups for r in k)
    done = [0, 0]
    for need, group in groups.items():
        if need:
            _stream(manifest.root, [by_rel[r] for r in need], group, sid, total_files, total_bytes,
                    done, progress, dest)
    commits = [(t, rt.agent_request(t.addr, t.key, "sync_commit", sid))
               for t in targets if t.addr in plans and t.ok]
    for t, f in commits:
        try:
            t.roots[dest] = f.get(PLAN_TIMEOUT_S)
        except Exception as e:
            t.fail(e)
    for t in targets:
        if t.addr in plans and not t.ok and not _lost(t):
            rt.agent_request(t.addr, t.key, "sync_abort", sid)


def _stream(root: str, entries: list[Entry], group: list[HostTarget], sid: str, total_files: int,
            total_bytes: int, done: list, progress, dest: str) -> None:
    rt = runtime()
    windows = {t.addr: collections.deque() for t in group}
    for pieces, raw, files in _batches(root, entries, should_compress(group)):
        wire_bytes = sum(len(p[2]) for p in pieces)
        for t in group:
            if not t.ok:
                continue
            if _lost(t):
                t.fail(f"host agent {t.addr} is unreachable (lost mid-sync)")
                continue
            q = windows[t.addr]
            while len(q) >= WINDOW and t.ok:
                _wait(t, q.popleft())
            if not t.ok:
                continue
            q.append(rt.agent_request(t.addr, t.key, "sync_put", sid, pieces))
            t.bytes_raw += raw
            t.bytes_wire += wire_bytes
            t.files_sent += files
        done[0] += files
        done[1] += raw
        if progress is not None:
            progress(Progress(dest, done[0], total_files, done[1], total_bytes))
        if not any(t.ok for t in group):
            return
    for t in group:
        q = windows[t.addr]
        while q and t.ok:
            _wait(t, q.popleft())


def _wait(t: HostTarget, fut) -> None:
    try:
        fut.get(PUT_TIMEOUT_S)
    except Exception as e:
        t.fail(e)


def _batches(root: str, entries: list[Entry], compress_all: bool = True):
    """Yield (pieces, raw bytes, files completed); a piece is (path, offset, data, codec,
    final), codec 1 = zlib, 0 = raw."""
    pieces, raw, files = [], 0, 0
    for e in entries:
        if e.link is not None:
            pieces.append((e.path, 0, b"", 0, True))
            files += 1
            continue
        try:
            f = open(os.path.join(root, e.path), "rb")
        except OSError:
            continue   # vanished since the walk; the receiver keeps its copy and reports it
        with f:
            compress = compress_all and os.path.splitext(e.path)[1].lower() not in INCOMPRESSIBLE
            offset = 0
            while True:
                data = f.read(CHUNK)
                final = len(data) < CHUNK
                if final and offset and not data:
                    pieces.append((e.path, offset, b"", 0, True))
                else:
                    if compress and offset == 0 and len(data) > 32768:
                        sample = data[:32768]
                        compress = len(zlib.compress(sample, 1)) < 0.9 * len(sample)
                    packed, codec = data, 0
                    if compress and data:
                        z = zlib.compress(data, 1)
                        if len(z) < len(data):
                            packed, codec = z, 1
                    pieces.append((e.path, offset, packed, codec, final))
                offset += len(data)
                raw += len(data)
                if final:
                    files += 1
                if raw >= BATCH_BYTES:
                    yield pieces, raw, files
                    pieces, raw, files = [], 0, 0
                if final:
                    break
    if pieces:
        yield pieces, raw, files
