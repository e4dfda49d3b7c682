"""The controller's telemetry: an embedded SQLite database fed by the host agents.

SQLite, not DuckDB: it is in the standard library (nothing to install on a cluster's
login node or in a kernel's environment), it takes the small batches that arrive every
second cheaply (DuckDB is built for large scans and is slow at many small inserts), and
an hour of samples of a few hundred procs is a few million rows at most, which SQLite
aggregates in milliseconds. The database is in memory, one per controller process; the
agents hold the history (an hour), so a restarted kernel gets it back on its first look.

``mesh.telemetry.query("select rank, max(rss_mb) from samples group by rank")`` pulls what
the mesh's agents gathered since the last look (one request per host, batched), then
runs the query over that mesh's rows only. Tables (``agent`` is the host agent's name,
``mesh`` the proc mesh's, ``mesh_id`` one spawn of it: a mesh stopped and spawned again
under the same name is another ``mesh_id``):

  samples(time, host, mesh, rank, pid, cpu_percent, rss_mb, uss_mb, threads, fds,
          gpu_util, gpu_mem_mb, mesh_id, agent)  gpu_* are NULL on a host without a GPU
  proc_events(time, host, mesh, rank, pid, event, detail, mesh_id, agent)
          event: spawned, died (detail: the signal or exit code), respawned, stopped
  calls(time, host, mesh, rank, actor, endpoint, seconds, ok, mesh_id, agent)
  cells(time, host, mesh, rank, cell, seconds, ok, mesh_id, agent)
"""
from __future__ import annotations

import sqlite3
import threading
import time

from .result import QueryResult

PULL_TIMEOUT_S = 10.0
HISTORY_S = 3600.0

SCHEMA = {
    "samples": "time REAL, host TEXT, mesh TEXT, rank INTEGER, pid INTEGER, cpu_percent REAL, rss_mb REAL, "
               "uss_mb REAL, threads INTEGER, fds INTEGER, gpu_util REAL, gpu_mem_mb REAL, mesh_id TEXT, agent TEXT",
    "proc_events": "time REAL, host TEXT, mesh TEXT, rank INTEGER, pid INTEGER, event TEXT, detail TEXT, "
                   "mesh_id TEXT, agent TEXT",
    "calls": "time REAL, host TEXT, mesh TEXT, rank INTEGER, actor TEXT, endpoint TEXT, seconds REAL, "
             "ok INTEGER, mesh_id TEXT, agent TEXT",
    "cells": "time REAL, host TEXT, mesh TEXT, rank INTEGER, cell TEXT, seconds REAL, ok INTEGER, mesh_id TEXT, "
             "agent TEXT",
}


class TelemetryStore:
    """One per controller process (``store()``); any thread may pull or query."""

    def __init__(self):
        self.db = sqlite3.connect(":memory:", check_same_thread=False)
        for name, cols in SCHEMA.items():
            self.db.execute(f"create table {name} ({cols})")
        self.db.execute("create index samples_by_rank on samples (agent, mesh, rank, time)")
        self.lock = threading.Lock()
        self.cursors: dict[str, int] = {}       # agent address -> last row seen
        self.hosts: dict[str, dict] = {}        # agent address -> {host, agent, gpu, interval}
        self._ncols = {n: len(c.split(",")) for n, c in SCHEMA.items()}
        self._last_trim = time.time()

    def pull(self, agents: dict[str, bytes], timeout: float = PULL_TIMEOUT_S) -> dict[str, str]:
        """Fetch new rows from each agent (``{address: key}``), all hosts at once. A host that
        cannot answer (its agent gone, or silent) keeps the rows it gave before: the others'
        are still fetched, and ``{address: why}`` says which did not answer (one lost host of
        eight stopped ``%mesh top`` for all of them)."""
        from monarch_kernel.core.errors import HostUnreachableError
        from monarch_kernel.core.runtime import runtime

        rt = runtime()
        futs = {addr: rt.agent_request(addr, key, "tel_since", self.cursors.get(addr, 0))
                for addr, key in agents.items()}
        unreachable = {}
        for addr, fut in futs.items():
            try:
                batch = fut.get(timeout)
            except HostUnreachableError as e:
                unreachable[addr] = str(e)
                continue
            self.insert(addr, batch)
        return unreachable

    def insert(self, addr: str, batch: dict) -> None:
        agent = batch.get("agent", addr)
        with self.lock:
            if batch["cursor"] < self.cursors.get(addr, 0):   # a new agent at an old address
                self._forget_agent(agent)
            for table, rows in batch["rows"].items():
                if rows and table in SCHEMA:
                    marks = ",".join("?" * self._ncols[table])
                    self.db.executemany(f"insert into {table} values ({marks})", [(*r, agent) for r in rows])
            self.cursors[addr] = batch["cursor"]
            self.hosts[addr] = {k: batch.get(k) for k in ("host", "agent", "gpu", "interval")}
            if time.time() - self._last_trim > 60:
                self._trim()

    def query(self, sql: str, params=(), mesh_id: str | None = None) -> QueryResult:
        """Run ``sql``; with ``mesh_id``, every table name in it means that mesh's rows only
        (temporary views of the same names, which SQLite looks up before the tables)."""
        with self.lock:
            try:
                if mesh_id is not None:
                    for table in SCHEMA:
                        self.db.execute(f"create temp view {table} as select * from main.{table} "
                                        f"where mesh_id = '{_sql_literal(mesh_id)}'")
                try:
                    cur = self.db.execute(sql, params)
                    cols = tuple(d[0] for d in cur.description or ())
                    rows = cur.fetchall()
                finally:
                    if mesh_id is not None:
                        for table in SCHEMA:
                            self.db.execute(f"drop view if exists temp.{table}")
            except sqlite3.Error as e:
                raise ValueError(f"telemetry query failed: {e}. Tables: {', '.join(SCHEMA)}; "
                                 f"see monarch_kernel.telemetry.store for their columns") from None
            return QueryResult(rows, cols)

    def _forget_agent(self, agent: str) -> None:
        for table in SCHEMA:
            self.db.execute(f"delete from {table} where agent = ?", (agent,))

    def _trim(self) -> None:
        self._last_trim = time.time()
        for table in SCHEMA:
            self.db.execute(f"delete from {table} where time < ?", (self._last_trim - HISTORY_S,))


def _sql_literal(text: str) -> str:
    return text.replace("'", "''")


_STORE: TelemetryStore | None = None
_STORE_LOCK = threading.Lock()


def store() -> TelemetryStore:
    global _STORE
    with _STORE_LOCK:
        if _STORE is None:
            _STORE = TelemetryStore()
        return _STORE
