"""Per-proc log files on each host: written by the proc, read and searched by its agent.

Every line a proc prints (stdout and stderr, whether or not a notebook is attached) is also
appended to ``$MONARCH_KERNEL_HOME/logs/<agent name>/<proc mesh>.rank<N>.log`` as
``<unix time> <o|e> <text>``. Files rotate at ``MONARCH_KERNEL_LOG_MB`` (default 16) with
``LOG_BACKUPS`` older files kept (``.log.1``, ``.log.2``), so one proc's log is bounded.

Reading (``search``) runs on the agent's helper thread: it scans the files of the wanted
ranks in chunks, with the regex applied to whole chunks (C speed) and only matching lines
decoded, so ``%mesh logs --grep`` over a gigabyte takes seconds, not minutes.
"""
from __future__ import annotations

import logging
import logging.handlers
import re
import threading
import time
from pathlib import Path
from typing import NamedTuple

from monarch_kernel import config

LOG_BACKUPS = 2
CHUNK = 8 * 1024 * 1024
MAX_LINES = 10_000      # most lines one answer carries; the rest is counted, not sent
_RANK_FILE = re.compile(r"^(?P<mesh>.+)\.rank(?P<rank>\d+)\.log$")


def log_dir(agent_name: str) -> Path:
    from monarch_kernel.core.connection import home

    return home() / "logs" / agent_name


def log_path(agent_name: str, mesh: str, rank: int) -> Path:
    return log_dir(agent_name) / f"{mesh}.rank{rank}.log"


def max_bytes() -> int:
    return int(config.LOG_MB.get() * 1024 * 1024)


class ProcLogFile:
    """The proc's side: a rotating file its output is copied into (any thread may write).

    Lines are formatted and appended here, one write and flush per call (the agent reads
    the file while the proc runs), rather than as a logging record per line: logging's
    rotating handler built a record, formatted it twice and asked the file for its size for
    every line, ~45 us a line, as much as the rest of a call that prints one (issue 11).
    The handler still does the rollover, so the files and their format are as before."""

    def __init__(self, path: str):
        Path(path).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._handler = logging.handlers.RotatingFileHandler(path, maxBytes=max_bytes(),
                                                             backupCount=LOG_BACKUPS, encoding="utf-8")
        self._lock = threading.Lock()
        self._size = -1   # bytes in the current file (-1: not looked at yet)

    def write(self, stream: str, text: str) -> None:
        head = "%.3f %s " % (time.time(), "e" if stream == "stderr" else "o")
        data = "".join(head + line + "\n" for line in text.rstrip("\n").split("\n")).encode("utf-8", "replace")
        h = self._handler
        with self._lock:
            if h.stream is None:
                h.stream = h._open()
            if self._size < 0:
                self._size = h.stream.seek(0, 2)
            if self._size and self._size + len(data) >= h.maxBytes:
                h.doRollover()   # as the handler would have: the current file becomes .log.1
                self._size = 0
            h.stream.buffer.write(data)
            h.stream.flush()
            self._size += len(data)

    def close(self) -> None:
        self._handler.close()


class LogLine(NamedTuple):
    time: float
    mesh: str
    rank: int
    stream: str      # "stdout" | "stderr"
    text: str


def rank_files(folder: Path, mesh: str | None, ranks: set[int] | None) -> dict[tuple[str, int], list[Path]]:
    """(mesh, rank) -> its files, oldest first (``.log.2``, ``.log.1``, ``.log``)."""
    out: dict[tuple[str, int], list[Path]] = {}
    if not folder.is_dir():
        return out
    for p in folder.iterdir():
        m = _RANK_FILE.match(p.name)
        if not m or (mesh is not None and m["mesh"] != mesh):
            continue
        rank = int(m["rank"])
        if ranks is not None and rank not in ranks:
            continue
        files = [Path(f"{p}.{i}") for i in range(LOG_BACKUPS, 0, -1)] + [p]
        out[(m["mesh"], rank)] = [f for f in files if f.exists()]
    return out


def _parse(raw: bytes, mesh: str, rank: int) -> LogLine | None:
    head, _, text = raw.partition(b" ")
    tag, _, text = text.partition(b" ")
    try:
        t = float(head)
    except ValueError:
        return None
    return LogLine(t, mesh, rank, "stderr" if tag == b"e" else "stdout", text.decode("utf-8", "replace"))


def _text_of(line: bytes) -> bytes:
    return line[line.find(b" ", line.find(b" ") + 1) + 1:]


def _matching_lines(path: Path, pattern: re.Pattern | None, start: int = 0):
    """Raw lines of ``path`` from byte ``start`` (whole lines only) that match ``pattern``."""
    anchored = pattern is not None and b"^" in pattern.pattern
    with open(path, "rb") as f:
        f.seek(start)
        rest = b""
        while True:
            chunk = f.read(CHUNK)
            if not chunk:
                break
            buf = rest + chunk
            cut = buf.rfind(b"\n") + 1
            buf, rest = buf[:cut], buf[cut:]
            if pattern is None:
                yield from buf.splitlines()
                continue
            if anchored:   # '^' means the start of the text, after the "<time> <tag> " prefix
                for line in buf.splitlines():
                    if pattern.search(_text_of(line)):
                        yield line
                continue
            pos = 0
            for m in pattern.finditer(buf):
                if m.start() < pos:
                    continue
                a = buf.rfind(b"\n", 0, m.start()) + 1
                b = buf.find(b"\n", m.end())
                b = len(buf) if b < 0 else b
                # the match may be in the "<time> <tag> " prefix: check against the text only
                line = buf[a:b]
                if pattern.search(_text_of(line)):
                    yield line
                pos = b + 1


def _last_lines(files: list[Path], n: int) -> list[bytes]:
    """The last ``n`` lines across ``files`` (oldest first), reading only their ends."""
    out: list[bytes] = []
    for path in reversed(files):
        size = path.stat().st_size
        want = 256 * (n + 1)
        while True:
            with open(path, "rb") as f:
                f.seek(max(0, size - want))
                data = f.read()
            lines = data.splitlines()
            if want < size:
                lines = lines[1:]   # the first may be cut
            if len(lines) >= n - len(out) or want >= size:
                break
            want *= 4
        out = lines[-(n - len(out)):] + out if n > len(out) else out
        if len(out) >= n:
            break
    return out


def search(folder: Path, mesh: str | None = None, ranks: set[int] | None = None, grep: str | None = None,
           tail: int | None = None, since: dict | None = None) -> dict:
    """Lines of the wanted ranks, in time order. ``tail``: only the last N (after ``grep``).
    ``since``: {file name: (inode, size)} from a previous answer; only what was appended
    after that is read (``--follow``). The answer carries ``since`` for the next call."""
    pattern = re.compile(grep.encode(), re.MULTILINE) if grep else None
    lines: list[LogLine] = []
    cursor: dict[str, tuple[int, int]] = {}
    total = 0
    for (m, rank), files in rank_files(folder, mesh, ranks).items():
        if pattern is None and since is None and tail is not None:   # no need to read it all
            for raw in _last_lines(files, tail):
                total += 1
                line = _parse(raw, m, rank)
                if line is not None:
                    lines.append(line)
            continue
        for path in files:
            st = path.stat()
            start = 0
            if since is not None:
                if path.suffix != ".log":
                    continue   # a follow reads the live file only
                old = since.get(path.name)
                start = old[1] if old and old[0] == st.st_ino and old[1] <= st.st_size else 0
            if path.suffix == ".log":
                cursor[path.name] = (st.st_ino, st.st_size)
            for raw in _matching_lines(path, pattern, start):
                total += 1
                line = _parse(raw, m, rank)
                if line is not None:
                    lines.append(line)
            if len(lines) > 4 * MAX_LINES:   # keep memory bounded: the newest matter most
                lines.sort(key=lambda ln: ln.time)
                del lines[:-MAX_LINES]
    lines.sort(key=lambda ln: ln.time)
    keep = min(tail, MAX_LINES) if tail is not None else MAX_LINES
    dropped = max(0, total - keep)
    return {"lines": lines[-keep:] if keep else [], "matched": total, "dropped": dropped, "since": cursor}
