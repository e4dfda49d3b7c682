"""Worker side of ``%%on_mesh``: a built-in actor that runs notebook cells in a proc.

One ``CellRunner`` is spawned per proc mesh under the reserved name ``__cells__`` (see
``session.CELL_ACTOR``). Its namespace is this module's ``NAMESPACE``, a module-global dict
of the proc, so it persists across cells (and kernel restarts, which leave procs alone)
and actors on the same proc can read it (``from monarch_kernel.node.cells import
NAMESPACE``; its older name ``monarch_kernel.jupyter.cells`` is the same module).

Cells run on the proc's main thread (actor endpoints do), so the kernel's interrupt
becomes a KeyboardInterrupt in the cell. ``run`` never raises: a failure comes back as a
``CellFailure`` whose traceback starts at the cell's own lines (registered in linecache
under the cell's filename), so the controller can group identical errors across ranks.

Rich output: ``display(obj)`` (predefined in the namespace), ``plt.show()`` and figures
left open at the end of a cell go to the controller's sink (rich_output.py).

A cell runs on every rank, so its per-cell work counts N times on a host's cores: each proc
compiles a source text once and keeps the code (``_compiled``; a later cell with the same
text gets it under its own filename, so tracebacks and the debugger still name that cell).
Parsing and compiling ``x = 1`` cost a proc ~100 us with its caches cold (256 procs on 2
cores), more than the rest of the cell. For the same reason a cell touches as little as it
can: its lines are split once per text, and figures are looked for only once pyplot is
imported or a figure was displayed (``send_open_figures``'s own test, without the call).
"""
from __future__ import annotations

import ast
import linecache
import sys
import traceback
from types import CodeType

from monarch_kernel.core.actors import Actor, endpoint
from monarch_kernel.core.context import current_rank

from .rich_output import SHOWN, display, send_open_figures, use_on_this_rank  # noqa: F401  (display: re-exported)

NAMESPACE: dict = {"__name__": "__on_mesh__"}
COMPILED_MAX = 256   # source texts kept compiled (the oldest goes first)
# (source, want_value) -> (the body's code, the last expression's code or None, their filename,
# whether either defines functions or classes: code of its own to rename, the text's lines
# (one list per text, shared by its cells' linecache entries: read-only))
_COMPILED: dict[tuple[str, bool], tuple[CodeType, CodeType | None, str, bool, list[str]]] = {}
_MODULES = sys.modules


class CellFailure:
    """What a raising cell sends back instead of raising (so all ranks' outcomes arrive)."""

    __slots__ = ("exc_type", "message", "traceback", "rank")

    def __init__(self, exc_type: str, message: str, tb: str, rank: int):
        self.exc_type, self.message, self.traceback, self.rank = exc_type, message, tb, rank

    def __reduce__(self):
        return (CellFailure, (self.exc_type, self.message, self.traceback, self.rank))

    def __repr__(self):
        return f"CellFailure(rank {self.rank}: {self.exc_type}: {self.message})"


class CellRunner(Actor):
    """Runs cells, and pushes/pulls variables, in this proc's persistent namespace."""

    def __init__(self, mesh):
        use_on_this_rank()
        rank = current_rank().rank
        NAMESPACE.update(rank=rank, world_size=len(mesh), mesh=mesh, display=display)
        NAMESPACE.setdefault("__builtins__", __builtins__)
        self.rank = rank

    @endpoint
    def run(self, code: str, filename: str, want_value: bool = True, line_offset: int = 0):
        """Execute ``code``; the value of a last bare expression is returned (None if the
        cell ends in a statement or a ';'), a CellFailure if it raised. ``line_offset``:
        lines before ``code`` in the notebook cell (its lines keep their cell numbers)."""
        if line_offset:
            code = "\n" * line_offset + code
        try:
            body, last = _compiled(code, filename, want_value)
            exec(body, NAMESPACE)
            value = None
            if last is not None:
                value = eval(last, NAMESPACE)
                if value is not None:
                    NAMESPACE["_"] = value
            return value
        except BaseException as e:   # noqa: B036  (KeyboardInterrupt too: it is the interrupt)
            return self._failure(e, filename)
        finally:
            if _MODULES.get("matplotlib.pyplot") is not None or SHOWN.data:   # (most cells: neither)
                try:
                    send_open_figures()
                except Exception:
                    pass

    @endpoint
    def push(self, values: dict) -> None:
        NAMESPACE.update(values)

    @endpoint
    def pull(self, name: str):
        if name not in NAMESPACE:
            return CellFailure("NameError", f"name {name!r} is not defined on this rank", "", self.rank)
        return NAMESPACE[name]

    def _failure(self, e: BaseException, filename: str) -> CellFailure:
        from monarch_kernel.debug.worker import post_mortem

        post_mortem(e)   # `%mesh debug --post-mortem on`: stop in the debugger at the raise first
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != filename:
            tb = tb.tb_next
        if isinstance(e, SyntaxError):
            tb = None
        text = "".join(traceback.format_exception(type(e), e, tb))
        return CellFailure(type(e).__name__, str(e), text, self.rank)


def _compiled(code: str, filename: str, want_value: bool) -> tuple[CodeType, CodeType | None]:
    """The cell's body and, if it ends in a bare expression (and not in ';') and a value is
    wanted, that expression apart; compiled once per source text, renamed for a new filename.
    The text's lines go into linecache under ``filename`` first (tracebacks, the debugger)."""
    key = (code, want_value)
    hit = _COMPILED.get(key)
    if hit is not None:
        body, last, named, nested, lines = hit
        linecache.cache[filename] = (len(code), None, lines, filename)
        if named == filename:
            return body, last
        if nested:
            body, last = _renamed(body, filename), (None if last is None else _renamed(last, filename))
        else:
            body = body.replace(co_filename=filename)
            if last is not None:
                last = last.replace(co_filename=filename)
    else:
        lines = code.splitlines(keepends=True)
        linecache.cache[filename] = (len(code), None, lines, filename)
        tree = ast.parse(code, filename, "exec")
        last = None
        if want_value and tree.body and isinstance(tree.body[-1], ast.Expr) and not code.rstrip().endswith(";"):
            last = compile(ast.Expression(tree.body.pop().value), filename, "eval")
        body = compile(tree, filename, "exec")
        nested = any(type(c) is CodeType for co in (body, last) if co is not None for c in co.co_consts)
        if len(_COMPILED) >= COMPILED_MAX:
            del _COMPILED[next(iter(_COMPILED))]
    _COMPILED[key] = (body, last, filename, nested, lines)
    return body, last


def _renamed(code: CodeType, filename: str) -> CodeType:
    """``code`` and the code of the functions and classes it defines, under ``filename``."""
    consts = tuple(_renamed(c, filename) if type(c) is CodeType else c for c in code.co_consts)
    return code.replace(co_filename=filename, co_consts=consts)
