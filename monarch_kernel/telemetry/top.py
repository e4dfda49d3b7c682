"""``%mesh top``: per-rank CPU, memory and GPU bars and state, refreshed until closed.

The figures come from the hosts' samples (``MeshTelemetry.latest``), the state from the
procs themselves (``ProcMesh.states``, answered by their I/O threads even while they run
a cell), so the view keeps moving while other cells run. It refreshes on its own thread
(widget updates go out on iopub, which ipykernel allows from any thread). Closed, or
after ``MAX_RUN_S``, it stops and leaves one plain text line behind, which is also what a
saved notebook shows in place of the widget.
"""
from __future__ import annotations

import html
import threading
import time
import weakref

MAX_RUN_S = 3600.0
BAR_W = 120
SHOWN: weakref.WeakSet = weakref.WeakSet()   # the views shown in this kernel (tests look at them)


class MeshTop:
    def __init__(self, procs, name: str, interval: float = 1.0):
        self.procs, self.name, self.interval = procs, name, interval
        self.tel = procs.telemetry
        self.rows: list[dict] = []
        self.updates = 0
        self.open = False
        self._handle = None
        self._stop = threading.Event()

    # ---------------------------------------------------------------- data
    def refresh(self) -> list[dict]:
        latest = self.tel.latest()
        states = list(self.procs.states(timeout=2.0).values())
        rows = []
        for ref, st in zip(self.procs.procs(), states):
            s = latest.get(ref.rank, {}) if st.get("state") != "dead" else {}
            rows.append({"rank": ref.rank, "host": st.get("host", ref.host), "state": _state(st.get("state", "?")),
                         "cpu": s.get("cpu_percent"), "rss_mb": s.get("rss_mb"), "gpu_util": s.get("gpu_util"),
                         "gpu_mem_mb": s.get("gpu_mem_mb")})
        self.rows = rows
        self.updates += 1
        return rows

    def summary(self) -> str:
        rows = self.rows
        dead = sum(r["state"] == "dead" for r in rows)
        paused = sum(r["state"].startswith("paused") for r in rows)
        cpu = sum(r["cpu"] or 0 for r in rows)
        mem = sum(r["rss_mb"] or 0 for r in rows)
        extra = "".join([f" · {dead} dead" if dead else "", f" · {paused} paused" if paused else ""])
        return f"mesh {self.name} · {len(rows)} procs{extra} · CPU {cpu:.0f}% · RSS {mem:.0f} MiB"

    def text(self) -> str:
        if not self.rows:
            self.refresh()
        gpu = self.tel.has_gpu()
        head = ["rank", "host", "state", "cpu %", "rss MiB"] + (["gpu %", "gpu MiB"] if gpu else [])
        body = [[str(r["rank"]), r["host"], r["state"], _num(r["cpu"]), _num(r["rss_mb"])]
                + ([_num(r["gpu_util"]), _num(r["gpu_mem_mb"])] if gpu else []) for r in self.rows]
        widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(x, widths)).rstrip() for x in [head, *body]]
        return "\n".join([self.summary(), *lines])

    def html(self) -> str:
        gpu = self.tel.has_gpu()
        mem_scale = max([r["rss_mb"] or 0 for r in self.rows] + [1.0])
        head = "".join(f"<th style='text-align:left;padding-right:12px'>{h}</th>" for h in
                       ["rank", "host", "state", "CPU", "memory"] + (["GPU", "GPU memory"] if gpu else []))
        body = []
        for r in self.rows:
            color = "#c62828" if r["state"] == "dead" else "#ef8f00" if r["state"].startswith("paused") else ""
            cells = [str(r["rank"]), html.escape(r["host"]),
                     f"<span style='color:{color}'>{html.escape(r['state'])}</span>",
                     _bar(r["cpu"], 100.0, f"{_num(r['cpu'])}%"),
                     _bar(r["rss_mb"], mem_scale, f"{_num(r['rss_mb'])} MiB")]
            if gpu:
                cells += [_bar(r["gpu_util"], 100.0, f"{_num(r['gpu_util'])}%"),
                          _bar(r["gpu_mem_mb"], max([x["gpu_mem_mb"] or 0 for x in self.rows] + [1.0]),
                               f"{_num(r['gpu_mem_mb'])} MiB")]
            body.append("<tr class='monarch-top-row'>" + "".join(f"<td style='padding-right:12px'>{c}</td>"
                                                                  for c in cells) + "</tr>")
        return (f"<div class='monarch-top'><b>{html.escape(self.summary())}</b>"
                f"<table><tr>{head}</tr>{''.join(body)}</table>"
                f"<div style='color:#777;font-size:85%'>update {self.updates}, every {self.interval:g} s</div></div>")

    # ---------------------------------------------------------------- the widget
    def show(self) -> None:
        import ipywidgets as W
        from IPython.display import display

        self.refresh()
        self.pane = W.HTML(self.html())
        close = W.Button(description="close", tooltip="stop refreshing; leaves a text line")
        close.on_click(lambda _: self.close())
        self.box = W.VBox([self.pane, close])
        self.box.add_class("monarch-top-widget")
        bundle = self.box._repr_mimebundle_()
        bundle["text/plain"] = self.summary()
        self._handle = display(bundle, raw=True, display_id=True)
        self.open = True
        SHOWN.add(self)
        threading.Thread(target=self._run, name="mesh-top", daemon=True).start()

    def _run(self) -> None:
        started = time.monotonic()
        why = "closed"
        while not self._stop.wait(self.interval):
            if time.monotonic() - started > MAX_RUN_S:
                why = f"stopped after {MAX_RUN_S / 3600:g} h: run %mesh top again"
                break
            try:
                self.refresh()
                self.pane.value = self.html()
            except Exception as e:   # the mesh is gone, or disconnected: say so and stop
                why = f"stopped: {e}"
                break
        self._finish(why)

    def close(self) -> None:
        self._stop.set()

    def _finish(self, why: str) -> None:
        if not self.open:
            return
        self.open = False
        line = f"{self.summary()} ({why})"
        try:
            self._handle.update({"text/plain": line}, raw=True)
            self.box.close()
        except Exception:
            pass


def _state(s: str) -> str:
    if s == "in __cells__.run":
        return "running cell"
    if s.startswith("in __cells__."):
        return "busy (push/pull)"
    if s.startswith("in "):
        return f"in endpoint {s[3:]}"
    return s


def _num(v) -> str:
    return "" if v is None else f"{v:.0f}"


def _bar(v, scale: float, label: str) -> str:
    if v is None:
        return ""
    w = int(BAR_W * min(1.0, max(0.0, v / scale))) if scale else 0
    return (f"<div style='display:flex;align-items:center;gap:6px'><div style='width:{BAR_W}px;height:10px;"
            f"background:#eee'><div style='width:{w}px;height:10px;background:#4a90d9'></div></div>"
            f"<span>{html.escape(label)}</span></div>")
