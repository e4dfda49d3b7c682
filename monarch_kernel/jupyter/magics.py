"""``%mesh``, ``%%on_mesh`` and ``%on_mesh``: the notebook's handles on the mesh.

Load with ``%load_ext monarch_kernel`` (the Monarch kernel loads it at start).

Adding a ``%mesh`` subcommand (how code sync and the debugger plug in, without editing
this file): in ``monarch_kernel/<feature>/magic.py``

    from monarch_kernel.jupyter.magics import mesh_command, mesh_parser
    parser = mesh_parser("sync", "push edited local code to every host; workers reload it")
    parser.add_argument("--dry-run", action="store_true")

    @mesh_command(parser)
    def sync(ctx, args):          # ctx: MeshContext; args: the parsed argparse Namespace
        procs, cells = ctx.require()   # the connected ProcMesh and cell runner, or a clear error
        ...                           # print, or return an object to display

``%mesh NAME`` finds NAME in ``MESH_COMMANDS``; when it is not there, it imports
``monarch_kernel.NAME.magic`` if that module exists (``OPTIONAL_COMMANDS`` lists the
known ones for ``%mesh`` help). A wrong flag raises IPython's UsageError with the usage.
"""
from __future__ import annotations

import argparse
import importlib
import math
import re
import shlex
import sys
from collections.abc import Callable

import IPython
from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class

from monarch_kernel.core.mesh import view_of

from ..core.errors import ActorError, HostUnreachableError, MeshGoneError, SupervisionError
from . import fast_path
from .display import CellInterrupted, cell_error
from .on_mesh import (
    _Run,
    cell_run_args,
    outcome,
    output_options,
    refused_for_death,
    select,
    supervision_message,
    values_after_death,
)
from .output import OutputRouter
from .session import NotConnected, session

OPTIONAL_COMMANDS = {"sync": "monarch_kernel.sync.magic", "debug": "monarch_kernel.debug.magic",
                     "logs": "monarch_kernel.telemetry.magic", "top": "monarch_kernel.telemetry.magic"}


class MagicArgumentParser(argparse.ArgumentParser):
    """argparse that reports a bad flag as a UsageError (with the usage) instead of exiting."""

    def error(self, message):
        raise UsageError(f"{self.prog}: {message}\n{self.format_usage().rstrip()}")

    def exit(self, status=0, message=None):
        if status:
            raise UsageError(message or f"{self.prog}: bad arguments")
        raise _HelpShown()


class _HelpShown(Exception):
    pass


class MeshCommand:
    def __init__(self, name: str, parser: MagicArgumentParser, handler: Callable):
        self.name, self.parser, self.handler = name, parser, handler


MESH_COMMANDS: dict[str, MeshCommand] = {}


def mesh_parser(name: str, description: str, usage: str | None = None) -> MagicArgumentParser:
    return MagicArgumentParser(prog=f"%mesh {name}", description=description,
                               usage=usage.replace("%", "%%") if usage else None, add_help=True)


def mesh_command(parser: MagicArgumentParser, name: str | None = None):
    """Register ``handler(ctx, args)`` as ``%mesh <name>`` (the parser's name by default)."""

    def register(handler):
        n = name or parser.prog.split()[-1]
        MESH_COMMANDS[n] = MeshCommand(n, parser, handler)
        return handler

    return register


def find_command(name: str) -> MeshCommand | None:
    cmd = MESH_COMMANDS.get(name)
    if cmd is None and re.fullmatch(r"[a-z_]+", name):
        module = OPTIONAL_COMMANDS.get(name, f"monarch_kernel.{name}.magic")
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as e:
            if not module.startswith(e.name or "\0"):
                raise
        cmd = MESH_COMMANDS.get(name)
    return cmd


class MeshContext:
    """What a ``%mesh`` handler gets: the shell, the session and helpers."""

    def __init__(self, magics: MeshMagics):
        self.magics = magics
        self.shell = magics.shell
        self.session = session()
        self.router = magics.router

    def require(self):
        return self.magics.require()

    def call_cells(self, target, method: str, args: tuple, timeout=None, what="the call"):
        """Call the cell runner (``run``, ``push``, ``pull``) with interrupt/timeout and
        grouped errors; returns the CellValues."""
        return self.magics.call_cells(target, method, args, timeout, what)


# ----------------------------------------------------------------------- %%on_mesh options
ON_MESH = MagicArgumentParser(
    prog="%%on_mesh", add_help=True,
    usage="%%%%on_mesh [--ranks SPEC] [--slice DIM=RANGE] [--timeout S] [--out NAME] [--stream] "
          "[--group-outputs merged|rank|order] [--show-ranks SPEC] [--quiet-ranks SPEC]",
    description="Run the cell on each selected rank, in that rank's persistent namespace "
                "(rank, world_size, mesh and display are predefined). The last expression's "
                "values come back as a ValueMesh.")
ON_MESH.add_argument("--ranks", metavar="SPEC", help="Monarch rank grammar: 3 | 1,4,6 | 0:8:2 | gpus=1:3")
ON_MESH.add_argument("--slice", metavar="DIM=RANGE", help="slice by a named dim, e.g. gpus=0:2")
ON_MESH.add_argument("--timeout", type=float, metavar="S", help="interrupt every rank after S seconds")
ON_MESH.add_argument("--out", metavar="NAME", help="store the ValueMesh in this notebook variable")
ON_MESH.add_argument("--stream", action="store_true",
                     help="write output as it arrives (default: hold up to 1 s, then stream)")
ON_MESH.add_argument("--group-outputs", choices=("merged", "rank", "order", "engine"), default="merged",
                     help="merged: identical lines once, with their ranks (default); rank: each rank's "
                          "output together; order: collated, every rank's first line, then second...")
ON_MESH.add_argument("--show-ranks", metavar="SPEC", help="show only these ranks' output (the cell runs on all)")
ON_MESH.add_argument("--quiet-ranks", metavar="SPEC", help="hide these ranks' output (kept in `%%mesh logs`)")
_VALUED = {"--ranks", "--slice", "--timeout", "--out", "--group-outputs", "--show-ranks", "--quiet-ranks"}
_PARSED: dict[str, argparse.Namespace] = {}   # %%on_mesh's line -> its options (most cells repeat a few)


def on_mesh_options(line: str) -> argparse.Namespace:
    """``ON_MESH.parse_args`` of ``line`` (a fresh copy: callers may change it), parsed once
    per distinct line; a bad line raises each time, as argparse says."""
    args = _PARSED.get(line)
    if args is None:
        args = ON_MESH.parse_args(shlex.split(line))
        if len(_PARSED) < 64:
            _PARSED[line] = args
    return argparse.Namespace(**vars(args))


def split_line_options(line: str) -> tuple[list[str], str]:
    """Leading ``--flag [value]`` options of ``%on_mesh``, and the expression after them."""
    opts: list[str] = []
    rest = line.lstrip()
    while rest.startswith("--"):
        m = re.match(r"(--[\w-]+)(?:=(\S+)|\s+(\S+))?\s*", rest)
        flag = m.group(1)
        if flag in _VALUED:
            value = m.group(2) or m.group(3)
            opts += [flag] + ([value] if value else [])
            rest = rest[m.end():]
        else:
            opts.append(flag)
            rest = rest[len(flag):].lstrip()
    return opts, rest


@magics_class
class MeshMagics(Magics):
    def __init__(self, shell, router: OutputRouter):
        super().__init__(shell)
        self.router = router

    # ------------------------------------------------------------------ %mesh
    @line_magic
    def mesh(self, line: str = ""):
        """%mesh connect|status|list|disconnect|stop|push|pull ...  (%mesh -h for help)"""
        try:
            argv = shlex.split(line)
        except ValueError as e:
            raise UsageError(f"%mesh: {e}")
        if not argv or argv[0] in ("-h", "--help", "help"):
            print(mesh_help())
            return None
        cmd = find_command(argv[0])
        if cmd is None:
            raise UsageError(f"%mesh: unknown command {argv[0]!r}\n{mesh_help()}")
        try:
            args = cmd.parser.parse_args(argv[1:])
        except _HelpShown:
            return None
        try:
            return cmd.handler(MeshContext(self), args)
        except (ValueError, NotConnected) as e:
            raise UsageError(f"{cmd.parser.prog}: {e}\n{cmd.parser.format_usage().rstrip()}")
        except (MeshGoneError, HostUnreachableError) as e:   # a clear message, not the controller's stack
            raise UsageError(f"{cmd.parser.prog}: {e}")

    def require(self):
        try:
            return session().require()
        except (NotConnected, MeshGoneError) as e:
            raise UsageError(str(e))

    # ------------------------------------------------------------------ %%on_mesh
    @cell_magic("on_mesh")
    def on_mesh_cell(self, line: str, cell: str):
        """Run the cell on the mesh (the kernel rewrites this to an awaited call, so it
        stays responsive; this sync form is used with %autoawait off)."""
        return self._on_mesh_sync(line, cell, want_value=True)

    @line_magic("on_mesh")
    def on_mesh_line(self, line: str):
        """%on_mesh [options] EXPR -> a ValueMesh of EXPR on each selected rank."""
        opts, expr = split_line_options(line)
        if not expr.strip():
            raise UsageError("%on_mesh needs an expression, e.g. %on_mesh torch.cuda.device_count()\n"
                             + ON_MESH.format_usage().replace("%%on_mesh", "%on_mesh").rstrip() + " EXPR")
        return self._on_mesh_sync(" ".join(shlex.quote(o) for o in opts), expr, want_value=True)

    def _prepare(self, line: str, code: str, want_value: bool):
        try:
            args = on_mesh_options(line)
        except _HelpShown:
            return None
        procs, cells = self.require()
        if args.timeout is not None and not (math.isfinite(args.timeout) and args.timeout > 0):
            raise UsageError(f"--timeout must be a positive, finite number of seconds, got {args.timeout:g}; "
                             "leave it out to wait as long as the cell runs")
        if args.out is not None and not args.out.isidentifier():
            raise UsageError(f"--out needs a variable name, got {args.out!r}")
        try:
            target = select(cells, args.ranks, args.slice)
        except (ValueError, TypeError) as e:
            raise UsageError(f"%%on_mesh: {e}\n{ON_MESH.format_usage().rstrip()}")
        run_args = cell_run_args(CELL_NUMBER.now, code, want_value)
        try:
            options = output_options(cells, args)
        except (ValueError, TypeError) as e:
            raise UsageError(f"%%on_mesh: {e}\n{ON_MESH.format_usage().rstrip()}")
        cap = self.router.begin(view_of(target).ranks, live=args.stream, options=options)
        try:
            run = _Run(target, "run", run_args, args.timeout, cap)
        except SupervisionError as e:
            self.router.end(cap)
            raise refused_for_death(target) or _died(e)
        except BaseException:
            self.router.end(cap)
            raise
        return args, run, cap

    def _on_mesh_sync(self, line, code, want_value):
        prepared = self._prepare(line, code, want_value)
        if prepared is None:
            return None
        args, run, cap = prepared
        try:
            values = _values(run)
        except CellInterrupted as e:   # ranks that would not stop: keep what the others returned
            self._keep_partial(args, e)
            raise
        finally:
            run.done()
            self.router.end(cap)
        return self._result(args, run, values)

    async def on_mesh_async(self, line: str, code: str):
        prepared = self._prepare(line, code, True)
        if prepared is None:
            return None
        args, run, cap = prepared
        try:
            try:
                values = (await run.wait_async()).values()
            except (ActorError, SupervisionError) as e:
                values = _partial_values(e, run)
        except CellInterrupted as e:
            self._keep_partial(args, e)
            raise
        finally:
            run.done()
            self.router.end(cap)
        return self._result(args, run, values)

    def _keep_partial(self, args, e) -> None:
        if getattr(e, "results", None) is not None:
            self.shell.user_ns["_on_mesh"] = e.results
            if args.out:
                self.shell.user_ns[args.out] = e.results

    def _result(self, args, run, values):
        ns = self.shell.user_ns
        try:
            result = outcome(run, values)
        except BaseException as e:
            ns["_on_mesh"] = e.results if getattr(e, "results", None) is not None else None
            if args.out and getattr(e, "results", None) is not None:
                ns[args.out] = e.results
            raise
        ns["_on_mesh"] = result
        if args.out:
            ns[args.out] = result
        if values.count(None) == len(values):
            return None
        return result

    def call_cells(self, target, method, args, timeout=None, what="the call"):
        try:
            run = _Run(target, method, args, timeout, None, what)
        except SupervisionError as e:
            raise _died(e)
        values = _values(run)
        return outcome(run, values)


def _values(run) -> list:
    try:
        return run.wait_sync().values()
    except (ActorError, SupervisionError) as e:
        return _partial_values(e, run)


def _partial_values(e: ActorError | SupervisionError, run=None) -> list:
    """A cell that failed on some ranks still gives every rank's outcome (ActorError carries
    them); a dead proc fails its rank, and the ranks that finished keep their values (the
    grouped cell error says which). Anything else propagates."""
    if isinstance(e, SupervisionError):
        values = values_after_death(run, e) if run is not None else None
        if values is None:
            raise _died(e)
        return values
    if e.results is None:
        raise e
    return e.results.values()


def _died(e: SupervisionError):
    f = e.failure
    ranks = [f.rank] if f is not None and f.rank is not None else []
    return cell_error([(ranks, "SupervisionError", supervision_message(e), "")])


def mesh_help() -> str:
    for name in OPTIONAL_COMMANDS:
        find_command(name)
    lines = ["%mesh COMMAND [options]   (%mesh COMMAND -h for its options)"]
    for name, cmd in MESH_COMMANDS.items():
        lines.append(f"  {name:<11} {cmd.parser.description or ''}")
    return "\n".join(lines)


# ----------------------------------------------------------------------- the async rewrite
# (fast_path.ASYNC_PREFIX is its start)
_ASYNC_CALL = ("await __import__('monarch_kernel.jupyter.magics', fromlist=['_']).on_mesh_async({line!r}, "
               "{body!r})\n")


def rewrite_on_mesh_cell(lines: list[str]) -> list[str]:
    """IPython cleanup transformer: an ``%%on_mesh`` cell becomes one awaited call, so the
    kernel's event loop (comms, widgets) keeps running while the ranks do."""
    if not lines or not lines[0].startswith("%%on_mesh"):
        return lines
    first = lines[0][len("%%on_mesh"):]
    if first[:1] not in ("", " ", "\t", "\n"):
        return lines
    shell = _SHELL
    if shell is None or not getattr(shell, "autoawait", False) or getattr(shell, "kernel", None) is None:
        return lines
    return [_ASYNC_CALL.format(line=first.strip(), body="".join(lines[1:]))]


async def on_mesh_async(line: str, body: str):
    return await _MAGICS.on_mesh_async(line, body)


class CellNumber:
    """The ``In [N]`` of the cell running now, for the cell's name on the ranks.

    IPython 9 increments ``execution_count`` as a cell starts (inside ``In [3]`` it reads 4);
    IPython 8 did it when the cell ended. ``pre_run_cell`` fires after that increment, with
    ``info.store_history`` saying whether it happened; a silent run has no number."""

    COUNTS_AHEAD = int(IPython.__version__.split(".")[0]) >= 9

    def __init__(self):
        self.shell = None
        self.now: int | None = None

    def install(self, shell) -> None:
        self.shell = shell
        for event, fn in (("pre_execute", self.clear), ("pre_run_cell", self.started)):
            if fn not in shell.events.callbacks[event]:
                shell.events.register(event, fn)

    def clear(self) -> None:
        self.now = None

    def started(self, info) -> None:
        n = self.shell.execution_count
        self.now = n - 1 if info.store_history and self.COUNTS_AHEAD else n


CELL_NUMBER = CellNumber()
_SHELL = None
_MAGICS: MeshMagics | None = None
_ROUTER: OutputRouter | None = None


def load_ipython_extension(ipython) -> None:
    global _SHELL, _MAGICS, _ROUTER
    from ..core.runtime import runtime
    from . import commands  # noqa: F401  (registers connect, status, ...)

    if _ROUTER is None or _ROUTER.shell is not ipython:
        _ROUTER = OutputRouter(ipython)
    try:
        rt = runtime()
    except Exception as e:   # a MONARCH_KERNEL_BIND that is no address of this machine (zmq cannot bind it)
        from .. import config
        from ..core.runtime import Runtime, install_runtime

        if not config.BIND.get():
            raise
        print(f"monarch kernel: {config.BIND.env}={config.BIND.get()} is not an address of this machine ({e}); "
              "listening on loopback: local meshes work, and a job's %mesh connect says what to set",
              file=sys.stderr)
        rt = Runtime(bind_host="127.0.0.1")
        install_runtime(rt)
    _ROUTER.install(rt)
    _SHELL = ipython
    if not hasattr(ipython, "_last_traceback"):
        # ipykernel 7 reads it after any error; a UsageError (our bad-input reports) as the
        # first error of a kernel would otherwise crash the execute_request (no reply).
        ipython._last_traceback = None
    CELL_NUMBER.install(ipython)
    _MAGICS = MeshMagics(ipython, _ROUTER)
    from .spawn_check import install as install_spawn_check

    install_spawn_check(ipython)   # a cell that spawns shows a failed __init__ under itself
    ipython.register_magics(_MAGICS)
    if rewrite_on_mesh_cell not in ipython.input_transformers_cleanup:
        ipython.input_transformers_cleanup.append(rewrite_on_mesh_cell)
    fast_path.install_transform(ipython)   # the rewritten cell skips IPython's later steps
    for name in OPTIONAL_COMMANDS:
        try:
            find_command(name)
        except Exception as e:   # a broken optional feature must not break the kernel
            print(f"monarch_kernel: %mesh {name} is unavailable: {e}", file=sys.stderr)


def unload_ipython_extension(ipython) -> None:
    if rewrite_on_mesh_cell in ipython.input_transformers_cleanup:
        ipython.input_transformers_cleanup.remove(rewrite_on_mesh_cell)
    fast_path.uninstall_transform(ipython)


__all__ = ["MESH_COMMANDS", "MeshContext", "MeshGoneError", "mesh_command", "mesh_parser",
           "load_ipython_extension"]
