"""``%mesh top``: per-rank CPU, memory and GPU bars and state, refreshed until closed.

The figures come from the hosts' samples (``MeshTelemetry.latest``), the state from the
procs themselves (``ProcMesh.states``, answered by their I/O threads even while they run
a cell), so the view keeps moving while other cells run. It refreshes on its own thread
(widget updates go out on iopub, which ipykernel allows from any thread). Closed, or
after ``MAX_RUN_S``, it stops and leaves one plain text line behind, which is also what a
saved notebook shows in place of the widget.

Past ``BIG_TABLE`` ranks (core/mesh_tables.py) a row a rank is a page of bars redrawn every
second; there the view has a row a host (its ranks, how many in each state, CPU mean and
busiest rank, memory total and largest rank) and then a row for each rank to look at (dead
or paused, or not answering), as the Mesh panel does; ``%mesh top --all`` keeps a row a rank.
"""
from __future__ import annotations

import html
import threading
import time
import weakref

from ..core import silent_procs
from ..core.mesh_tables import BIG_TABLE, ranges

MAX_RUN_S = 3600.0
BAR_W = 120
SHOWN: weakref.WeakSet = weakref.WeakSet()   # the views shown in this kernel (tests look at them)


class MeshTop:
    def __init__(self, procs, name: str, interval: float = 1.0, all_ranks: bool = False):
        self.procs, self.name, self.interval, self.all_ranks = procs, name, interval, all_ranks
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
            rows.append({"rank": ref.rank, "host": st.get("host", ref.host),
                         "state": silent_procs.doing(st.get("state", "?"), st.get("os_state")),
                         "cpu": s.get("cpu_percent"), "rss_mb": s.get("rss_mb"), "uss_mb": s.get("uss_mb"),
                         "gpu_util": s.get("gpu_util"),
                         "gpu_mem_mb": s.get("gpu_mem_mb")})
        self.rows = rows
        self.updates += 1
        return rows

    def summary(self) -> str:
        rows = self.rows
        dead = sum(r["state"] == "dead" for r in rows)
        paused = sum(r["state"].startswith("paused") for r in rows)
        stuck = sum(r["state"] in STUCK for r in rows)
        cpu = sum(r["cpu"] or 0 for r in rows)
        mem = sum(r["rss_mb"] or 0 for r in rows)
        extra = "".join([f" · {dead} dead" if dead else "", f" · {paused} paused" if paused else "",
                         f" · {stuck} not answering" if stuck else ""])
        own = f" · own {_own(rows):.0f} MiB" if any(r.get("uss_mb") is not None for r in rows) else ""
        return f"mesh {self.name} · {len(rows)} procs{extra} · CPU {cpu:.0f}% · RSS {mem:.0f} MiB{own}"

    @property
    def per_host(self) -> bool:
        """A row a host rather than a rank (see the module docstring)."""
        return not self.all_ranks and len(self.rows) > BIG_TABLE

    def text(self) -> str:
        if not self.rows:
            self.refresh()
        gpu = self.tel.has_gpu()
        lines = [self.summary()]
        if self.per_host:
            head = ["host", "ranks", "states", "cpu % mean", "busiest", "own MiB", "largest rss"] + (
                ["gpu % mean"] if gpu else [])
            body = [[h["host"], h["ranks"], h["states"], _num(h["cpu_mean"]), h["cpu_top"], _num(h["own_total"]),
                     h["rss_top"]] + ([_num(h["gpu_mean"])] if gpu else []) for h in host_rows(self.rows)]
            lines += _columns(head, body)
            look = attention(self.rows)
            if look:
                lines += ["", "ranks to look at:"] + _columns(*self._rank_table(look, gpu))
            lines.append(f"({len(self.rows)} ranks, a row a host: %mesh top --all for a row a rank)")
            return "\n".join(lines + self._silent_hosts())
        return "\n".join(lines + _columns(*self._rank_table(self.rows, gpu)) + self._silent_hosts())

    def _silent_hosts(self) -> list[str]:
        """A line a host that gave no figures at the last look: why (its words name it)."""
        return [f"no figures from it now: {why}" for why in self.tel.unreachable.values()]

    @staticmethod
    def _rank_table(rows: list[dict], gpu: bool) -> tuple[list[str], list[list[str]]]:
        head = ["rank", "host", "state", "cpu %", "rss MiB"] + (["gpu %", "gpu MiB"] if gpu else [])
        body = [[str(r["rank"]), r["host"], r["state"], _num(r["cpu"]), _num(r["rss_mb"])]
                + ([_num(r["gpu_util"]), _num(r["gpu_mem_mb"])] if gpu else []) for r in rows]
        return head, body

    def html(self) -> str:
        gpu = self.tel.has_gpu()
        if self.per_host:
            look = attention(self.rows)
            tables = (self._hosts_html(gpu) + (f"<div style='margin-top:6px'>ranks to look at:</div>"
                                               f"{self._ranks_html(look, gpu)}" if look else "")
                      + f"<div style='color:#777;font-size:85%'>{len(self.rows)} ranks, a row a host: "
                        f"<code>%mesh top --all</code> for a row a rank</div>")
        else:
            tables = self._ranks_html(self.rows, gpu)
        tables += "".join(f"<div style='color:#b45309'>{html.escape(line)}</div>" for line in self._silent_hosts())
        return (f"<div class='monarch-top'><b>{html.escape(self.summary())}</b>{tables}"
                f"<div style='color:#777;font-size:85%'>update {self.updates}, every {self.interval:g} s</div></div>")

    def _hosts_html(self, gpu: bool) -> str:
        hosts = host_rows(self.rows)
        mem_scale = max([h["own_total"] or 0 for h in hosts] + [1.0])
        head = "".join(f"<th style='text-align:left;padding-right:12px'>{h}</th>" for h in
                       ["host", "ranks", "states", "CPU (mean, busiest)", "memory (its own, largest RSS)"]
                       + (["GPU (mean)"] if gpu else []))
        body = []
        for h in hosts:
            color = "#c62828" if "dead" in h["states"] else "#ef8f00" if any(
                _held(part.split(" ", 1)[-1]) for part in h["states"].split(" · ")) else ""
            cells = [html.escape(h["host"]), h["ranks"],
                     f"<span style='color:{color}'>{html.escape(h['states'])}</span>",
                     _bar(h["cpu_mean"], 100.0, f"{_num(h['cpu_mean'])}%, {h['cpu_top']}"),
                     _bar(h["own_total"], mem_scale, f"{_num(h['own_total'])} MiB, {h['rss_top']}")]
            if gpu:
                cells.append(_bar(h["gpu_mean"], 100.0, f"{_num(h['gpu_mean'])}%"))
            body.append("<tr class='monarch-top-host'>" + "".join(f"<td style='padding-right:12px'>{c}</td>"
                                                                   for c in cells) + "</tr>")
        return f"<table><tr>{head}</tr>{''.join(body)}</table>"

    @staticmethod
    def _ranks_html(rows: list[dict], gpu: bool) -> str:
        mem_scale = max([r["rss_mb"] or 0 for r in rows] + [1.0])
        head = "".join(f"<th style='text-align:left;padding-right:12px'>{h}</th>" for h in
                       ["rank", "host", "state", "CPU", "memory"] + (["GPU", "GPU memory"] if gpu else []))
        body = []
        for r in rows:
            color = "#c62828" if r["state"] == "dead" else "#ef8f00" if _held(r["state"]) else ""
            cells = [str(r["rank"]), html.escape(r["host"]),
                     f"<span style='color:{color}'>{html.escape(r['state'])}</span>",
                     _bar(r["cpu"], 100.0, f"{_num(r['cpu'])}%"),
                     _bar(r["rss_mb"], mem_scale, f"{_num(r['rss_mb'])} MiB")]
            if gpu:
                cells += [_bar(r["gpu_util"], 100.0, f"{_num(r['gpu_util'])}%"),
                          _bar(r["gpu_mem_mb"], max([x["gpu_mem_mb"] or 0 for x in rows] + [1.0]),
                               f"{_num(r['gpu_mem_mb'])} MiB")]
            body.append("<tr class='monarch-top-row'>" + "".join(f"<td style='padding-right:12px'>{c}</td>"
                                                                  for c in cells) + "</tr>")
        return f"<table><tr>{head}</tr>{''.join(body)}</table>"

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


def host_rows(rows: list[dict]) -> list[dict]:
    """A row a host, in the order its first rank comes: its ranks (as ranges), its ranks per
    state (``30 idle · 2 dead``), CPU mean and busiest rank, the memory its procs hold of their
    own (USS, not RSS: procs forked from one zygote share most of their pages, and 32 RSS
    figures added up count those 32 times) and the largest RSS."""
    by_host: dict[str, list[dict]] = {}
    for r in rows:
        by_host.setdefault(r["host"], []).append(r)
    out = []
    for host, rs in by_host.items():
        states: dict[str, int] = {}
        for r in rs:
            states[r["state"]] = states.get(r["state"], 0) + 1
        cpu = [r for r in rs if r["cpu"] is not None]
        rss = [r for r in rs if r["rss_mb"] is not None]
        gpu = [r["gpu_util"] for r in rs if r["gpu_util"] is not None]
        busiest = max(cpu, key=lambda r: r["cpu"], default=None)
        largest = max(rss, key=lambda r: r["rss_mb"], default=None)
        out.append({
            "host": host, "ranks": ranges(r["rank"] for r in rs),
            "states": " · ".join(f"{n} {st}" for st, n in sorted(states.items(), key=lambda kv: -kv[1])),
            "cpu_mean": sum(r["cpu"] for r in cpu) / len(cpu) if cpu else None,
            "cpu_top": f"rank {busiest['rank']} {_num(busiest['cpu'])}%" if busiest else "",
            "own_total": _own(rss) if rss else None,
            "rss_top": f"rank {largest['rank']} {_num(largest['rss_mb'])} MiB" if largest else "",
            "gpu_mean": sum(gpu) / len(gpu) if gpu else None})
    return out


def _own(rows: list[dict]) -> float:
    """The memory of these procs' own: each one's USS, its RSS where no USS was read yet."""
    return sum(r["uss_mb"] if r.get("uss_mb") is not None else (r["rss_mb"] or 0) for r in rows)


def attention(rows: list[dict]) -> list[dict]:
    """The ranks a per-host view still shows one by one: dead, paused, or not answering."""
    return [r for r in rows if r["state"] == "dead" or _held(r["state"])]


STUCK = {"unresponsive", "unreachable", *silent_procs.SHORT.values()}   # a rank that does not answer, and why


def _held(state: str) -> bool:
    """Paused in the debugger, or not answering (amber where dead is red)."""
    return state.startswith("paused") or state in STUCK


def _columns(head: list[str], body: list[list[str]]) -> list[str]:
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    return ["  ".join(c.ljust(w) for c, w in zip(x, widths)).rstrip() for x in [head, *body]]


def _num(v) -> str:
    return "" if v is None else f"{v:.0f}"


def _bar(v, scale: float, label: str) -> str:
    if v is None:
        return ""
    w = int(BAR_W * min(1.0, max(0.0, v / scale))) if scale else 0
    return (f"<div style='display:flex;align-items:center;gap:6px'><div style='width:{BAR_W}px;height:10px;"
            f"background:#eee'><div style='width:{w}px;height:10px;background:#4a90d9'></div></div>"
            f"<span>{html.escape(label)}</span></div>")
