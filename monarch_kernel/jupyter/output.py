"""Worker output in the notebook: rank-labelled, under the cell that caused it.

Workers send ``("out", rank, stream, text)`` and ``("display", rank, data, metadata)``
to the controller's inbox; the runtime's I/O thread hands them to ``OutputRouter``
(``rt.output`` and ``rt.handlers["display"]``).

While an ``%%on_mesh`` cell runs, its output is first *held* and, when the cell ends
within ``HOLD_S``, written in rank order (rank 0's lines, then rank 1's, ...): the
cell's output is then the same on every run, which is what nbval compares. A cell that
runs longer switches to *live*: what was held is written in arrival order, and every
later line is written at once, from the I/O thread, under the cell's parent header
(ipykernel's streams and display publisher take a per-thread parent). Per rank, order is
always kept: a worker flushes its stdout before it sends a display or a reply, on the
same socket. ``--stream`` on ``%%on_mesh`` goes live at once; ``MONARCH_KERNEL_HOLD_S``
changes the hold.
"""
from __future__ import annotations

import os
import sys
import threading

HOLD_S = float(os.environ.get("MONARCH_KERNEL_HOLD_S", "1.0"))


def label_lines(rank: int, text: str) -> str:
    return "".join(f"[rank {rank}] {line}\n" for line in text.rstrip("\n").split("\n"))


def label_display(rank: int, data: dict, metadata: dict) -> tuple[dict, dict]:
    """Mark a worker's display with its rank (text, HTML, and the metadata)."""
    data = dict(data)
    md = dict(metadata or {})
    md["monarch_kernel"] = {"rank": rank}
    if "text/plain" in data:
        data["text/plain"] = f"[rank {rank}] {data['text/plain']}"
    tag = f'<div style="font-size:smaller;opacity:.7">rank {rank}</div>'
    if "text/html" in data:
        data["text/html"] = f"<div>{tag}{data['text/html']}</div>"
    else:
        for mime in ("image/png", "image/jpeg"):
            if mime in data:
                data["text/html"] = f'<div>{tag}<img src="data:{mime};base64,{data[mime]}"/></div>'
                break
    return data, md


class CellCapture:
    """The output of one running cell: held (then ordered by rank) or live."""

    def __init__(self, router: OutputRouter, parent: dict | None, ranks, live: bool):
        self.router = router
        self.parent = parent
        self.ranks = set(ranks)
        self.live = live
        self.held: list[tuple[int, tuple]] = []
        self.lock = threading.Lock()

    def add(self, rank: int, item: tuple) -> None:
        with self.lock:
            if not self.live:
                self.held.append((rank, item))
                return
        self.router.emit(rank, item, self.parent)

    def go_live(self) -> None:
        """Write what was held, in arrival order, and stream the rest."""
        with self.lock:
            if self.live:
                return
            self.live = True
            held, self.held = self.held, []
            for rank, item in held:
                self.router.emit(rank, item, self.parent)

    def finish(self) -> None:
        """The cell is done: write what was held, ordered by rank (stable per rank)."""
        with self.lock:
            held, self.held = self.held, []
            self.live = True
        for rank, item in sorted(held, key=lambda ri: ri[0]):
            self.router.emit(rank, item, None)
        self.router.flush()


class OutputRouter:
    """Installed once per controller process by the magics (``install``)."""

    def __init__(self, shell=None):
        self.shell = shell
        self.active: CellCapture | None = None
        self.last_parent: dict | None = None
        self._streams = {"stdout": sys.stdout, "stderr": sys.stderr}

    def install(self, rt) -> None:
        rt.output = self.on_output
        rt.handlers["display"] = self.on_display

    # ---------------------------------------------------------------- I/O thread
    def on_output(self, rank: int, stream: str, text: str) -> None:
        self._route(rank, ("stream", stream, text))

    def on_display(self, msg) -> None:
        _, rank, data, metadata = msg
        self._route(rank, ("display", data, metadata))

    def _route(self, rank: int, item: tuple) -> None:
        cap = self.active
        if cap is not None and rank in cap.ranks:
            cap.add(rank, item)
        else:
            self.emit(rank, item, self.last_parent)

    # ---------------------------------------------------------------- a cell
    def begin(self, ranks, live: bool = False) -> CellCapture:
        parent = self._current_parent()
        self.last_parent = parent
        cap = self.active = CellCapture(self, parent, ranks, live)
        return cap

    def end(self, cap: CellCapture) -> None:
        if self.active is cap:
            self.active = None
        cap.finish()

    def _current_parent(self) -> dict | None:
        kernel = getattr(self.shell, "kernel", None)
        if kernel is None:
            return None
        try:
            return kernel.get_parent("shell")
        except Exception:
            return None

    # ---------------------------------------------------------------- writing
    def emit(self, rank: int, item: tuple, parent: dict | None) -> None:
        """Write one item; ``parent`` set means "from a non-main thread, for that cell"."""
        if item[0] == "stream":
            _, stream, text = item
            out = self._streams.get(stream) if parent is not None else None
            if out is None:
                out = sys.stderr if stream == "stderr" else sys.stdout
            self._with_parent(out, parent, lambda: out.write(label_lines(rank, text)))
        else:
            _, data, metadata = item
            data, md = label_display(rank, data, metadata)
            pub = getattr(self.shell, "display_pub", None)
            if pub is None:
                sys.stdout.write(data.get("text/plain", "") + "\n")
                return
            self.flush()
            self._with_parent(pub, parent, lambda: pub.publish(data=data, metadata=md))

    def flush(self) -> None:
        for s in (sys.stdout, sys.stderr):
            try:
                s.flush()
            except Exception:
                pass

    @staticmethod
    def _with_parent(obj, parent, fn) -> None:
        setp = getattr(obj, "set_thread_parent", None) if parent is not None else None
        if setp is None:
            fn()
            return
        token = setp(parent)
        try:
            fn()
        finally:
            obj.reset_thread_parent(token)
