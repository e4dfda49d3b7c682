"""``%mesh sync [PATH ...] [--env] [--dry-run] [--no-reload] [--exclude PAT] [--max-size N]``.

Imported by ``%mesh`` on first use (monarch_kernel/jupyter/magics.py finds
``monarch_kernel.sync.magic``). Transfers over about 1 MB show a live progress line
(files and bytes); the summary of what changed per host follows.
"""
from __future__ import annotations

import re
import time

from IPython.core.error import UsageError

from monarch_kernel.jupyter.magics import mesh_command, mesh_parser

from .manifest import SyncTooLarge, human
from .sender import Progress
from .workspace import SyncError, sync_workspace

PROGRESS_MIN_BYTES = 1_000_000

parser = mesh_parser(
    "sync", "push local code to every host of the mesh (only what changed); the procs reload the "
            "modules whose files changed",
    usage="%mesh sync [PATH ...] [--env] [--dry-run] [--no-reload] [--exclude PATTERN] [--max-size SIZE]")
parser.add_argument("paths", nargs="*", metavar="PATH", help="files or folders (default: the working directory)")
parser.add_argument("--env", action="store_true",
                    help="also sync the active environment's site-packages and its editable installs")
parser.add_argument("--dry-run", action="store_true", help="say what would change; change nothing")
parser.add_argument("--no-reload", action="store_true", help="do not reload changed modules on the procs")
parser.add_argument("--exclude", action="append", default=[], metavar="PATTERN",
                    help=".gitignore-style pattern to leave out (repeatable); see also .meshignore")
parser.add_argument("--max-size", metavar="SIZE", help="refuse trees larger than this (e.g. 2GB, 500MB)")


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*", text or "", re.I)
    if not m:
        raise UsageError(f"%mesh sync: --max-size {text!r} is not a size; write e.g. 500MB or 2GB")
    unit = (m.group(2) or "").lower().rstrip("b").rstrip("i")
    return int(float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[unit])


class _ProgressLine:
    """A display that updates in place; shown only for transfers over PROGRESS_MIN_BYTES."""

    def __init__(self):
        self.handle = None
        self.last = 0.0

    def __call__(self, p: Progress) -> None:
        if p.bytes_total < PROGRESS_MIN_BYTES:
            return
        now = time.monotonic()
        done = p.files_done >= p.files_total
        if not done and now - self.last < 0.2:
            return
        self.last = now
        text = (f"sync {p.root}: {p.files_done}/{p.files_total} files, "
                f"{human(p.bytes_done)}/{human(p.bytes_total)}")
        from IPython.display import display

        if self.handle is None:
            self.handle = display({"text/plain": text}, raw=True, display_id=True)
        else:
            self.handle.update({"text/plain": text}, raw=True)


@mesh_command(parser)
def sync(ctx, args):
    procs, _cells = ctx.require()
    max_bytes = parse_size(args.max_size) if args.max_size else None
    try:
        report = sync_workspace(procs, args.paths or None, env=args.env, dry_run=args.dry_run,
                                reload=not args.no_reload, excludes=args.exclude, max_bytes=max_bytes,
                                progress=_ProgressLine())
    except (FileNotFoundError, SyncTooLarge) as e:
        raise UsageError(f"%mesh sync: {e}") from None
    except SyncError as e:
        print(e.report)
        # Why each host failed, here too: the report above may list hundreds of files' problems.
        failed = "; ".join(f"{t.host}: {t.error}" for t in e.report.failed_hosts[:4])
        more = len(e.report.failed_hosts) - 4
        raise UsageError(f"%mesh sync: {len(e.report.failed_hosts)} host(s) failed: {failed}"
                         f"{f'; and {more} more (above)' if more > 0 else ''}; run %mesh sync again to "
                         "complete them") from None
    print(report)
