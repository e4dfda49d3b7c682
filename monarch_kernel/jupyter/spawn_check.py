"""A notebook cell that spawns actors shows their failed ``__init__`` under itself.

``spawn`` returns at once (as Monarch's does), so a cell that only spawns would end before
an ``__init__`` raises, and the error would surface in whichever cell next touches the
runtime. In a notebook, a cell ends by waiting for the ``__init__`` of every actor mesh it
spawned and left unused; a failure is shown under that cell (and not raised again later).
A cell that used the mesh already saw the error from that call. Interrupt (I, I) stops
the wait; the spawn goes on.
"""
from __future__ import annotations

import sys

from ..core import mesh as mesh_mod
from ..core.endpoint import _consume_unhandled
from ..core.runtime import runtime

WAIT_S = 600.0


def _pre_run_cell(*_args) -> None:
    mesh_mod.recent_spawns = []


def _post_run_cell(*_args) -> None:
    spawned = mesh_mod.recent_spawns or []
    mesh_mod.recent_spawns = []
    for am in spawned:
        if am.used or am.initialized is None:
            continue
        try:
            am.initialized.get(WAIT_S)
        except KeyboardInterrupt:
            print(f"stopped waiting for the __init__ of '{am.name}'; it goes on", file=sys.stderr)
            return
        except TimeoutError:
            continue
        except Exception:
            pass
        err = am.init_error
        if err is not None and not am.used:
            am.used = True
            _consume_unhandled(runtime(), err)
            from IPython import get_ipython

            shell = get_ipython()
            if shell is not None:
                shell.showtraceback((type(err), err, None), tb_offset=0)
            else:
                print(f"{type(err).__name__}: {err}", file=sys.stderr)


def install(ipython) -> None:
    if mesh_mod.recent_spawns is None:
        mesh_mod.recent_spawns = []
    if _post_run_cell not in ipython.events.callbacks["post_run_cell"]:
        ipython.events.register("pre_run_cell", _pre_run_cell)
        ipython.events.register("post_run_cell", _post_run_cell)
