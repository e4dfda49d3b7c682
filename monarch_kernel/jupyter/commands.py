"""The built-in ``%mesh`` subcommands: connect, status, list, disconnect, stop, push, pull.

Each is a parser plus a ``handler(ctx, args)`` registered with ``mesh_command`` (see
magics.py for how other features add theirs).
"""
from __future__ import annotations

import socket
import time

from IPython.core.error import UsageError

from .. import config
from ..core import silent_procs
from ..core.connection import agents_gone, list_meshes
from ..core.mesh import ProcMesh, state_of, view_of
from ..core.mesh_tables import rank_rows
from .display import Table, rank_ranges
from .magics import mesh_command, mesh_parser
from .on_mesh import select
from .session import CELL_ACTOR, default_mesh_name, parse_duration


def _per_host(text: str) -> dict:
    out = {}
    for term in text.split(","):
        k, eq, v = term.partition("=")
        if not eq or not k.strip().isidentifier() or not v.strip().isdigit() or int(v) < 1:
            raise ValueError(f"--per-host {text!r}: use DIM=N[,DIM=N], e.g. --per-host gpus=4")
        out[k.strip()] = int(v)
    return out


# ----------------------------------------------------------------------- connect
CONNECT = mesh_parser("connect", "attach to (or start) a local mesh; re-attaches after a kernel restart",
                      usage="%mesh connect [NAME] [--procs N | --per-host gpus=N] [--dist [BACKEND]] "
                            "[--lease DURATION] [--preload MODULES] [--hosts N | --job VAR | --slurm ARGS [--salloc] "
                            "| --ssh HOSTS [--ssh-args OPTIONS] "
                            "| --k8s NS --image IMAGE [--replicas N]] [--mesh MESH]")
CONNECT.add_argument("name", nargs="?", help=f"mesh name (default: from the notebook, here "
                                             f"{default_mesh_name()!r})")
_size = CONNECT.add_mutually_exclusive_group()
_size.add_argument("--procs", type=int, metavar="N", help="N worker procs (default: one per GPU, else core)")
_size.add_argument("--per-host", metavar="DIM=N", help="named dims per host, e.g. gpus=4")
CONNECT.add_argument("--dist", nargs="?", const="auto", metavar="BACKEND",
                     help="also form a torch.distributed process group over every proc (nccl with CUDA, "
                          "else gloo; or name the backend)")
CONNECT.add_argument("--lease", metavar="DURATION",
                     help="keep the mesh this long with no notebook attached (90s, 15m, 2h; default 1h)")
CONNECT.add_argument("--preload", metavar="MODULES",
                     help="modules each host imports once before forking its procs, so every rank starts with "
                          "them loaded, e.g. --preload numpy,matplotlib.pyplot (at 256 ranks: once a host, "
                          "not once a rank)")
_where = CONNECT.add_mutually_exclusive_group()
_where.add_argument("--hosts", type=int, metavar="N", help="N hosts on this machine, each a host agent process of "
                                                          "its own (a multi-host mesh to try here: dims hosts=N, "
                                                          "--procs or --per-host per host)")
_where.add_argument("--job", metavar="VAR", help="hosts from a monarch_kernel.job job in notebook variable VAR "
                                                 "(the cells run on its first mesh, or the one --mesh names)")
_where.add_argument("--slurm", metavar='"SBATCH ARGS"', help='hosts from a Slurm allocation, e.g. --slurm "-N 2 '
                                                             '-p gpu --gpus-per-node 8"')
_where.add_argument("--k8s", metavar="NAMESPACE", help="pods in a Kubernetes namespace (with --image and "
                                                        "--replicas; your kubeconfig)")
CONNECT.add_argument("--salloc", action="store_true",
                     help="--slurm: an interactive allocation (salloc --no-shell), granted at once instead of "
                          "at Slurm's next scheduling pass; its agents live as long as an srun on this machine")
CONNECT.add_argument("--image", metavar="IMAGE", help="--k8s: the pods' image (with this project installed)")
CONNECT.add_argument("--replicas", type=int, metavar="N", help="--k8s: number of pods (hosts), default 1")
CONNECT.add_argument("--mesh", metavar="MESH", dest="job_mesh",
                     help="which of the job's meshes the cells run on (default: its first); the others stay "
                          "reachable as job.state().MESH")
_where.add_argument("--ssh", metavar="HOST,HOST", help="an agent on each host over ssh (your ssh config and keys), "
                                                       "e.g. --ssh gpu1,alice@gpu2:2222")
CONNECT.add_argument("--ssh-args", metavar='"SSH OPTIONS"',
                     help='--ssh: options for every ssh call, e.g. --ssh-args "-F cluster.conf -o ProxyJump=login"')


@mesh_command(CONNECT)
def connect(ctx, args):
    if args.procs is not None and args.procs < 1:
        raise ValueError(f"--procs must be at least 1, got {args.procs}")
    per_host = _per_host(args.per_host) if args.per_host else None
    lease = parse_duration(args.lease) if args.lease else None
    # MONARCH_KERNEL_PRELOAD as the kernel reads it now (a `%env` after the kernel started its
    # agent ahead, or a launcher that does not carry it to the hosts), then --preload's
    preload = list(dict.fromkeys([*config.PRELOAD.get(), *(config.module_names(args.preload) if args.preload
                                                            else [])])) or None
    from .jobs import job_from_args, job_progress

    job = job_from_args(ctx.shell.user_ns, args, lease)
    t0 = time.perf_counter()
    progress = ConnectProgress(ctx)
    try:
        pm, spawned = ctx.session.connect(args.name, args.procs, per_host, lease, progress=progress.update, job=job,
                                          job_progress=job_progress() if job is not None else None,
                                          job_mesh=args.job_mesh, preload=preload)
    except BaseException:
        progress.done()
        raise
    took = time.perf_counter() - t0
    name = ctx.session.name
    dims = ", ".join(f"{k}={v}" for k, v in pm.sizes.items())
    how = "started" if spawned else "re-attached (namespaces and actors kept)"
    progress.done()
    job = ctx.session.job   # also a job found under the mesh's name
    where = f" on {job.kind} job {job.job_id}" if job is not None else ""
    others = [m for m in job.meshes if m != ctx.session.job_mesh] if job is not None else []
    if others:
        where = f" on mesh {ctx.session.job_mesh!r} of {job.kind} job {job.job_id}"
    print(f"mesh {name!r}: {len(pm)} procs ({dims}){where} {how} in {took:.2f} s")
    if preload:
        seconds = ctx.session.preloaded   # {host: seconds}
        print(f"preloaded {', '.join(preload)} on {len(seconds)} host{'s' if len(seconds) > 1 else ''} in "
              f"{max(seconds.values()):.2f} s" + ("" if spawned else ": the procs already running import them on "
                                                "first use; those spawned or respawned from now on start with them"))
    if others:
        ns = ctx.shell.user_ns
        var = args.job
        mine = ns.get("job", None)
        if var is None and (mine is None or mine is job):
            ns["job"] = job   # as `mesh`: the job, to reach its other meshes from Python
            var = "job"
        python = f"`{var}.state().{others[0]}` in Python; " if var else ""
        print(f"the job's other meshes: {', '.join(others)} ({python}"
              f"`%mesh connect {name} --mesh {others[0]}` runs the cells there)")
    dead = pm.dead_ranks()
    if dead:
        print(f"{rank_ranges(dead)} died while no notebook was attached: `mesh.respawn()` replaces them")
    ns = ctx.shell.user_ns
    if isinstance(ns.get("mesh", None), (ProcMesh, type(None))):
        ns["mesh"] = pm
        print("`mesh` is its ProcMesh (spawn actors with mesh.spawn(...)); run cells with %%on_mesh")
    if args.dist:
        _connect_dist(pm, args.dist)
    return None


def _connect_dist(pm: ProcMesh, backend: str) -> None:
    from ..tensor.dist import mesh_group

    t0 = time.perf_counter()
    pm.init_process_group(None if backend == "auto" else backend)
    g = mesh_group(pm)
    print(f"torch.distributed: {g.backend} process group over {len(pm)} ranks in {time.perf_counter() - t0:.2f} s "
          f"(collective timeout {g.timeout_s:g} s); cells can use DDP, FSDP and DTensor as under torchrun")


class ConnectProgress:
    """A progress bar while procs start (a widget in a notebook, a line elsewhere). When
    connect ends the bar becomes its own plain line, ``starting N procs`` (transient.py):
    no widget is left in a saved notebook, and the line reads the same before and after
    (nbval compares the first form with the saved one)."""

    def __init__(self, ctx):
        self.kernel = getattr(ctx.shell, "kernel", None)
        self.bar = None
        self.shown = None
        self.line = ""

    def update(self, ready: int, total: int) -> None:
        if self.bar is None:
            self.bar = False
            self.line = f"starting {total} procs"
            if self.kernel is not None:
                try:
                    import ipywidgets

                    from .transient import TransientWidget

                    self.bar = ipywidgets.IntProgress(value=0, min=0, max=total, description="procs")
                    self.shown = TransientWidget(self.bar, self.line)
                except Exception:
                    self.bar = False
            if not self.bar:
                print(f"{self.line}...", flush=True)
        if self.bar:
            self.bar.value = ready
            self.bar.description = f"{ready}/{total}"

    def done(self) -> None:
        if self.shown is not None:
            self.shown.settle(self.line)


# ----------------------------------------------------------------------- status / list
STATUS = mesh_parser("status", "ranks, pids, state, CPU and memory of each proc of the mesh",
                     usage="%mesh status [--watch SECONDS]")
STATUS.add_argument("--watch", type=float, nargs="?", const=2.0, metavar="SECONDS",
                    help="refresh the table in place every SECONDS (default 2) until the cell is interrupted")


@mesh_command(STATUS)
def status(ctx, args):
    procs, _ = ctx.require()
    if args.watch is None:
        return _status_table(ctx, procs)
    if args.watch <= 0:
        raise ValueError(f"--watch takes a positive number of seconds, got {args.watch:g}")
    from IPython.display import display, update_display

    handle = display(_status_table(ctx, procs), display_id=True)
    try:
        while True:
            time.sleep(args.watch)
            procs, _ = ctx.require()
            update_display(_status_table(ctx, procs), display_id=handle.display_id)
    except KeyboardInterrupt:   # the kernel's interrupt (the stop button) ends the watch
        print("stopped watching (the table above is the last refresh)")
    return None


def _status_table(ctx, procs) -> Table:
    """Columns: ``state`` in the words of the mesh's own repr (alive, dead, stopped) and
    ``doing``: what a live proc is busy with (idle, running cell, in endpoint ...)."""
    states = procs.states().values()
    usage = {}
    try:
        usage = {r["key"]: r for r in ctx.session.host.status()}
    except Exception:
        pass
    show_buffers = any("buffers" in s for s in states)
    head = ["rank", "host", "pid", "state", "doing", "cpu %", "rss MiB", "actors"]
    if show_buffers:
        head.append("buffers")
    rows = []
    silent: dict[str, list[int]] = {}   # why -> the ranks that did not answer for that reason
    unreachable: list[int] = []           # ranks on a host whose agent is silent
    dead = set(procs.dead_ranks())
    for ref, st in zip(procs.procs(), states, strict=False):
        u = usage.get(ref.key, {})
        actors = ", ".join(a for a in st.get("actors", []) if a != CELL_ACTOR)
        raw = st.get("state", "?")
        if state_of(procs).stopped:
            state, doing = "stopped", ""
        elif raw == "unreachable":   # its host is silent: it may come back with its state
            state, doing = "unreachable", ""
            dead.discard(ref.rank)
            unreachable.append(ref.rank)
        elif ref.rank in dead or raw == "dead":
            state, doing = "dead", ""
        else:
            state, doing = "alive", silent_procs.doing(raw, st.get("os_state"))
            if raw == "unresponsive":
                silent.setdefault(st.get("why") or silent_procs.BUSY, []).append(ref.rank)
        row = [ref.rank, st.get("host", ref.host), st.get("pid", ref.pid), state, doing,
               "" if u.get("cpu") is None else f"{u['cpu']:.0f}",
               "" if u.get("rss") is None else f"{u['rss'] / 2**20:.0f}", actors]
        if show_buffers:
            row.append(_buffers(st.get("buffers")))
        rows.append(row)
    rows, merged = _merged_rows(rows)
    dims = ", ".join(f"{k}={v}" for k, v in procs.sizes.items())
    notes = [f"{rank_ranges(sorted(dead))} dead: `mesh.respawn()` replaces them"] if dead else []
    if merged:
        notes.append(merged)
    if unreachable:
        notes.append(f"{rank_ranges(unreachable)} unreachable: {silent_procs.UNREACHABLE}")
    notes += [f"{rank_ranges(ranks)} did not answer: {why}" for why, ranks in silent.items()]
    note = "\n".join(notes)
    title = f"mesh {ctx.session.name!r}: {len(procs)} procs ({dims})"
    if ctx.session.job is not None:
        from .jobs import describe_job

        title += f"; {describe_job(ctx.session.job, ctx.session.job_mesh)}"
    return Table(title, head, rows, note)


def _merged_rows(rows: list[list]) -> tuple[list[list], str]:
    """Past ``mesh_tables.BIG_TABLE`` procs, neighbours that read alike share a row (their
    pids as first…last) and the table shows its first and last rows, as a cell's values do:
    ``%mesh status`` of 256 procs was 258 lines."""
    ranks = [r[0] for r in rows]
    # cpu % and rss (columns 5, 6) do not keep neighbours apart: a shared row shows their range
    figures = [r[5:7] for r in rows]
    if all(str(c).isdigit() for f in figures for c in f):
        figures = [[int(c) for c in f] for f in figures]
    cells = [(r[1], r[3], r[4], *r[7:]) for r in rows]   # host, state, doing, actors (, buffers)
    merged, note = rank_rows(ranks, [{"cpu": f[0], "rss": f[1]} for f in figures], cells,
                             spans=[r[2] for r in rows], unit=("a row", "rows"))
    # merged: rank, cpu, rss, pid, host, state, doing, ...
    return [[m[0], m[4], m[3], m[5], m[6], m[1], m[2], *m[7:]] for m in merged], note


def _buffers(b) -> str:
    """RDMA buffers a proc registered (issue 6 puts a list of {"size": ...} in its state)."""
    if b is None:
        return ""
    if isinstance(b, (list, tuple)):
        total = sum(x.get("size", 0) for x in b if isinstance(x, dict))
        return f"{len(b)} ({_human(total)})" if b else "0"
    return str(b)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


LIST = mesh_parser("list", "meshes known on this machine and whether their agents are alive")


@mesh_command(LIST)
def list_(ctx, args):
    here = socket.gethostname()
    rows = []
    for name, info, alive in list_meshes():
        gone = 0 if alive else agents_gone(info)   # (its local agents that no longer run, zombies too)
        agents = info.get("agents", [])
        local = [a for a in agents if a.get("host") == here and a.get("pid")]
        pids = ", ".join(str(a["pid"]) for a in local) or "-"
        mark = "connected" if name == ctx.session.name and ctx.session.procs is not None else ""
        # (a job that lost some of its hosts: the others' ranks still answer, until it is stopped)
        state = "alive" if not gone else "gone" if gone == len(local) else f"{gone} of {len(local)} gone"
        rows.append([name, state, len(agents), pids, mark])
    note = "" if rows else "no meshes: `%mesh connect` starts one"
    return Table("meshes on this machine", ["name", "agent", "hosts", "agent pid", "this notebook"], rows, note)


# ----------------------------------------------------------------------- disconnect / stop
DISCONNECT = mesh_parser("disconnect", "let go of the mesh and leave it running (re-attach with connect)")


@mesh_command(DISCONNECT)
def disconnect(ctx, args):
    name = ctx.session.disconnect()
    if name is None:
        print("no mesh was connected")
    else:
        print(f"disconnected from mesh {name!r}; it keeps running until its lease ends: "
              f"`%mesh connect {name}` re-attaches")
    _drop_mesh_var(ctx)


STOP = mesh_parser("stop", "stop the mesh: its procs (and their state) and its agent")
STOP.add_argument("name", nargs="?", help="mesh to stop (default: the connected one)")


@mesh_command(STOP)
def stop(ctx, args):
    name = ctx.session.stop(args.name)
    print(f"mesh {name!r} stopped")
    _drop_mesh_var(ctx)


def _drop_mesh_var(ctx):
    ns = ctx.shell.user_ns
    if isinstance(ns.get("mesh"), ProcMesh) and ctx.session.procs is None:
        ns.pop("mesh", None)


# ----------------------------------------------------------------------- push / pull
def _selection(p):
    p.add_argument("--ranks", metavar="SPEC", help="Monarch rank grammar: 3 | 1,4,6 | 0:8:2 | gpus=1:3")
    p.add_argument("--slice", metavar="DIM=RANGE", help="slice by a named dim, e.g. gpus=0:2")


PUSH = mesh_parser("push", "copy notebook variables into each selected rank's namespace",
                   usage="%mesh push NAME [NAME ...] [--ranks SPEC] [--slice DIM=RANGE]")
PUSH.add_argument("names", nargs="+", metavar="NAME")
_selection(PUSH)


@mesh_command(PUSH)
def push(ctx, args):
    _, cells = ctx.require()
    ns = ctx.shell.user_ns
    missing = [n for n in args.names if n not in ns]
    if missing:
        raise UsageError(f"%mesh push: no variable {', '.join(map(repr, missing))} in the notebook")
    target = select(cells, args.ranks, args.slice)
    ctx.call_cells(target, "push", ({n: ns[n] for n in args.names},), what="the push")
    print(f"pushed {', '.join(args.names)} to {rank_ranges(view_of(target).ranks)}")


PULL = mesh_parser("pull", "bring a variable back from each selected rank, as a ValueMesh",
                   usage="%mesh pull NAME [--ranks SPEC] [--slice DIM=RANGE]")
PULL.add_argument("name", metavar="NAME")
_selection(PULL)


@mesh_command(PULL)
def pull(ctx, args):
    _, cells = ctx.require()
    handle = ctx.shell.user_ns.get(args.name)
    if type(handle).__name__ == "DistributedTensor" and type(handle).__module__ == "monarch_kernel.tensor.handle":
        return _pull_shards(handle, args)
    target = select(cells, args.ranks, args.slice)
    return ctx.call_cells(target, "pull", (args.name,), what="the pull")


def _pull_shards(handle, args):
    """``%mesh pull`` of a distributed tensor handle: each rank's local shard, as a ValueMesh."""
    from .display import CellValues

    if args.ranks or args.slice:
        raise UsageError("%mesh pull of a distributed tensor brings every rank's shard; use "
                         "fetch_shard(t, gpus=i) for one")
    return CellValues(handle.mesh.extent, handle.local_shards())
