"""Rich output from a rank (runs in a worker proc): ``display()``, figures, ``plt.show()``.

A rank has no Jupyter front-end of its own, so what a local kernel would show is
formatted here, with IPython's own formatters, and sent to the controller as
``("display", rank, data, metadata)``; the controller puts it under the cell that ran
(jupyter/output.py), labelled with the rank.

* ``display(obj)`` (predefined in the cell namespace; ``IPython.display.display`` is
  pointed at it on a rank) formats ``obj`` as a local ``display`` would: ``_repr_html_``,
  ``_repr_png_``, DataFrames, and matplotlib figures as PNG, so
  ``display(fig); plt.close(fig)`` shows the figure.
* ``figure_backend`` is the procs' matplotlib backend: the kernel's own backend
  (matplotlib-inline) is inherited by the procs but cannot work there, so the proc
  replaces it. ``plt.show()`` sends every open figure and closes it; figures still open
  when a cell ends are sent then (as the inline backend does).
"""
from __future__ import annotations

import base64
import os
import sys
import weakref

BACKEND = "module://monarch_kernel.node.figure_backend"
FRONT_END_BACKENDS = ("matplotlib_inline", "ipympl", "nbagg", "widget")
_FORMATTER = None
SHOWN: weakref.WeakSet = weakref.WeakSet()   # figures display()ed during this cell


def use_on_this_rank() -> None:
    """Make this proc's matplotlib send figures to the notebook; leave an explicit,
    non-front-end backend choice (``MPLBACKEND=agg``) alone."""
    current = os.environ.get("MPLBACKEND", "")
    if current and current != BACKEND and not any(b in current for b in FRONT_END_BACKENDS):
        return
    os.environ["MPLBACKEND"] = BACKEND
    if "matplotlib.pyplot" in sys.modules:
        sys.modules["matplotlib.pyplot"].switch_backend(BACKEND)
    elif "matplotlib" in sys.modules:
        sys.modules["matplotlib"].use(BACKEND)
    try:
        import IPython.core.display_functions as ipy_display
        import IPython.display

        IPython.display.display = ipy_display.display = display
    except ImportError:
        pass


def display(*objs, include=None, exclude=None, metadata=None, raw: bool = False, **kwargs) -> None:
    """Show objects under the notebook cell that runs this code, labelled with the rank."""
    for obj in objs:
        if raw:
            data, md = dict(obj), dict(metadata or {})
        else:
            data, md = format_object(obj, include, exclude)
            if metadata:
                md.update(metadata)
        if not data:
            continue
        if _is_figure(obj):
            SHOWN.add(obj)
        send(data, md)


def format_object(obj, include=None, exclude=None) -> tuple[dict, dict]:
    """IPython's mime bundle for ``obj``, with binary payloads as base64 text (as Jupyter's
    wire format has them)."""
    try:
        data, md = _formatter().format(obj, include=include, exclude=exclude)
    except Exception:
        return {"text/plain": repr(obj)}, {}
    data = {k: base64.b64encode(v).decode() if isinstance(v, bytes) else v for k, v in data.items()}
    return data, dict(md)


def _formatter():
    global _FORMATTER
    if _FORMATTER is None:
        from IPython.core.formatters import DisplayFormatter

        _FORMATTER = DisplayFormatter()
        _FORMATTER.formatters["image/png"].for_type_by_name("matplotlib.figure", "Figure", _figure_png)
    return _FORMATTER


def _figure_png(fig) -> bytes | None:
    from IPython.core.pylabtools import print_figure

    return print_figure(fig, "png", bbox_inches="tight")


def _is_figure(obj) -> bool:
    mod = sys.modules.get("matplotlib.figure")
    return mod is not None and isinstance(obj, mod.Figure)


def send(data: dict, metadata: dict) -> None:
    import monarch_kernel.node.proc as proc_mod

    w = proc_mod.WORKER
    if w is None or w.sink is None:
        print(data.get("text/plain", ""))
        return
    w.flush_output()   # keep order: text printed before the display arrives before it
    w.rt.send(w.sink[0], w.sink[1], ("display", w.rank, data, metadata))


def send_open_figures(skip_displayed: bool = True) -> None:
    """Send every open figure (not already display()ed in this cell) and close them all."""
    plt = sys.modules.get("matplotlib.pyplot")
    if plt is None:   # after every cell on every rank: nothing to do, at the least cost
        if SHOWN.data:
            SHOWN.clear()
        return
    for num in plt.get_fignums():
        fig = plt.figure(num)
        if skip_displayed and fig in SHOWN:
            continue
        data, md = format_object(fig)
        if "image/png" in data:
            send(data, md)
    plt.close("all")
    SHOWN.clear()

