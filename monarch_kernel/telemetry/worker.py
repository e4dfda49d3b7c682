"""A proc's side of telemetry: its log file, and its record of calls and cells.

``install(worker, cfg)`` is called once by the proc worker. On the call path it costs one
``perf_counter`` pair and a ``deque.append`` per endpoint call (``record_call``); the
records leave the proc only when its agent asks (``tel_pull``, once per sampling period,
answered on the proc's I/O thread), batched, never with the call's reply.
"""
from __future__ import annotations

import collections
import sys

from .logs import ProcLogFile

CELL_ACTOR = "__cells__"     # jupyter.session.CELL_ACTOR (not imported: this runs in procs)
MAX_PENDING = 50_000          # records kept while nobody pulls; the oldest go first


class ProcTelemetry:
    def __init__(self, worker, cfg: dict):
        self.worker = worker
        self.mesh, self.rank = cfg["mesh_name"], cfg["rank"]
        self.calls: collections.deque = collections.deque(maxlen=MAX_PENDING)
        self.cells: collections.deque = collections.deque(maxlen=MAX_PENDING)
        self.log = None
        if cfg.get("log_path"):
            try:
                self.log = ProcLogFile(cfg["log_path"])
            except OSError as e:   # a read-only home must not stop the proc
                sys.__stderr__.write(f"monarch_kernel: rank {self.rank} keeps no log file ({e})\n")
        self.enabled = True   # off while the agent's sampling is off (tel_config 0)
        worker.rt.on_agent_event("tel_pull", self._on_pull, replace=True)
        worker.rt.on_agent_event("tel_enable", self._on_enable, replace=True)

    def record_call(self, actor: str, endpoint: str, args: tuple, started: float, seconds: float, ok: bool,
                    value) -> None:
        """A finished endpoint call (the main thread, after the call, before its reply)."""
        if not self.enabled:
            return
        if actor == CELL_ACTOR:
            if endpoint == "run" and len(args) > 1:   # run(code, filename, ...); a failed cell returns a CellFailure
                ok = ok and type(value).__name__ != "CellFailure"   # (one line a statement: a line event each)
                self.cells.append((started, self.mesh, self.rank, args[1] if type(args[1]) is str else "", seconds, ok))
            return
        # (node/proc.py's _linked_call makes these rows itself, a function call less on the hot path: change both)
        self.calls.append((started, self.mesh, self.rank, actor, endpoint, seconds, ok))

    def _on_enable(self, link, on: bool):
        self.enabled = bool(on)

    def _on_pull(self, link):
        """On the proc's I/O thread: send what was recorded since the last pull, and what
        the proc is doing now (its state, actors, debugger and buffers: the Mesh panel's)."""
        w = self.worker
        status = {"state": w.state, "actors": sorted({s.name for s in w.actors.values()}), **w.query_extra()}
        w.rt.agent_send(w.agent_link, w.key, "tel_calls", _drain(self.calls), _drain(self.cells), w.proc_key, status)


def _drain(d: collections.deque) -> list:
    out = []
    while True:
        try:
            out.append(d.popleft())
        except IndexError:
            return out
