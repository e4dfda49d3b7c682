"""``%mesh logs`` and ``%mesh top``: the notebook's view of the hosts' telemetry.

    %mesh logs [RANKS] [--grep RE] [--tail N] [--follow]      (RANKS: 3 | 0-3,8 | 0:8:2 ...)
    %mesh top [--interval S]
"""
from __future__ import annotations

import datetime
import time

from monarch_kernel.core.mesh import view_of

from ..core.shape import parse_rank_spec
from ..jupyter.magics import mesh_command, mesh_parser

DEFAULT_TAIL = 100
FOLLOW_POLL_S = 1.0

LOGS = mesh_parser("logs", "output of the ranks kept on their hosts (also from cells run while no notebook "
                           "was attached)",
                   usage="%mesh logs [RANKS] [--grep RE] [--tail N] [--follow] [--time]")
LOGS.add_argument("spec", nargs="?", metavar="RANKS", help="whose lines: 3 | 0-3,8 | 1,4,6 | 0:8:2 | gpus=1:3 "
                                                          "(default: every rank)")
LOGS.add_argument("--ranks", metavar="SPEC", help="the same as RANKS")
LOGS.add_argument("--grep", metavar="RE", help="only lines matching this Python regular expression")
LOGS.add_argument("--tail", type=int, metavar="N", help=f"the last N lines (default {DEFAULT_TAIL})")
LOGS.add_argument("--follow", action="store_true", help="keep printing new lines until interrupted")
LOGS.add_argument("--time", action="store_true", help="prefix each line with the time it was written")


def format_line(line, with_time: bool = False) -> str:
    stamp = datetime.datetime.fromtimestamp(line.time).strftime("%H:%M:%S.%f")[:-3] + " " if with_time else ""
    err = " stderr" if line.stream == "stderr" else ""
    return f"{stamp}[rank {line.rank}{err}] {line.text}"


@mesh_command(LOGS)
def logs(ctx, args):
    procs, _ = ctx.require()
    if args.tail is not None and args.tail < 0:
        raise ValueError(f"--tail must be 0 or more, got {args.tail}")
    if args.spec and args.ranks and args.spec != args.ranks:
        raise ValueError(f"ranks given twice ({args.spec!r} and --ranks {args.ranks!r}): give one")
    spec = args.spec or args.ranks
    ranks = set(parse_rank_spec(spec, view_of(procs)).ranks) if spec else None
    tel = procs.telemetry
    tail = DEFAULT_TAIL if args.tail is None else args.tail
    ans = tel.logs(ranks, args.grep, tail)
    for line in ans["lines"]:
        print(format_line(line, args.time))
    if ans["dropped"] and not args.follow:
        print(f"({ans['dropped']} earlier matching lines not shown: --tail N for more)")
    elif not ans["matched"] and not args.follow:
        what = f" matching {args.grep!r}" if args.grep else ""
        print(f"no log lines{what} kept for these ranks")
    if not args.follow:
        return None
    since = ans["since"]
    try:
        while True:
            time.sleep(FOLLOW_POLL_S)
            ans = tel.logs(ranks, args.grep, None, since=since)
            since = ans["since"]
            if ans["lines"]:   # one write a batch: the interrupt mostly lands in the sleep
                print("\n".join(format_line(line, args.time) for line in ans["lines"]), flush=True)
    except KeyboardInterrupt:
        print("(stopped following)")
    return None


TOP = mesh_parser("top", "a live view of each rank's CPU, memory, GPU and state, refreshed until closed",
                  usage="%mesh top [--interval S] [--all]")
TOP.add_argument("--interval", type=float, default=1.0, metavar="S", help="seconds between refreshes (at least 1)")
TOP.add_argument("--all", action="store_true", dest="all_ranks",
                 help="a row a rank also past 32 ranks (there the view has a row a host, and the dead or paused ranks)")


@mesh_command(TOP)
def top(ctx, args):
    procs, _ = ctx.require()
    if args.interval < 1.0:
        raise ValueError(f"--interval must be at least 1 second, got {args.interval}")
    from .top import MeshTop

    view = MeshTop(procs, ctx.session.name or procs.name, args.interval, args.all_ranks)
    if getattr(ctx.shell, "kernel", None) is None:   # a terminal: print one frame
        print(view.text())
        return None
    view.show()
    return None
