"""The host agent's telemetry: samples, proc events, call and cell records, log search.

The agent is the store of record for its host: it keeps the last ``MONARCH_KERNEL_TELEMETRY_HISTORY_S`` seconds
(an hour by default) in memory, so a controller that attaches later, or a kernel that
restarts, still sees what happened. Nothing is pushed: a controller that looks (a query,
``%mesh top``, the Mesh panel) asks ``tel_since(cursor)`` and gets, in one batch per
host, every row after its cursor. Nobody looking costs nothing but the sampling.

Everything here runs on the agent's single poll-loop thread (``tick`` is called from it,
``handle`` serves the ``tel_*`` ops), except two helper threads whose results the loop
picks up at its next ``tick``: the log search (it may read gigabytes) and the sampler.
Sampling reads several /proc files per proc (smaps for USS): with 64 busy procs on 2
cores the agent gets a few % of a CPU, and a sample done on the loop kept it from
answering heartbeats for seconds, so the controller declared a healthy host lost.
The agent's calls into this module are one line each, so its loop stays readable.
Sampling keeps to a budget (``SAMPLE_BUDGET``, 2 % of one CPU): a sample of 256 procs costs
the sampler 60-150 ms of CPU on a 2-core VM, plus a pull of each proc's records (a wake of
every proc and its answer), so on a big host the next sample waits until the budget allows it
(every 3-8 s for 256 procs instead of every second: about 0.15 of a CPU back, issue 11).
"""
from __future__ import annotations

import collections
import logging
import queue
import shutil
import threading
import time

from .. import config
from ..core.messages import Ev
from ..core.silent_procs import SHORT
from .logs import log_dir, log_path, search
from .sampler import ProcSampler

log = logging.getLogger("monarch_kernel.telemetry")

MAX_ROWS = 200_000          # per table, whatever the history says
SAMPLE_BUDGET = 0.02        # of one CPU: the sampler's CPU per sample spaces the next one
SPAWN_WAIT_S = 10.0         # the longest a spawn defers the next sample
TABLES = ("samples", "proc_events", "calls", "cells")


class AgentTelemetry:
    def __init__(self, agent):
        self.agent = agent
        self.interval = config.TELEMETRY_S.get()   # 0: off
        self.sampler = ProcSampler(agent.host)
        self.seq = 0   # the last row's number (rows are numbered across the tables)
        self.tables: dict[str, History] = {t: History() for t in TABLES}
        self.next_sample = 0.0
        self.spawn_seen = 0.0   # when the agent was first seen spawning (0: not spawning)
        self.respawning: set[str] = set()
        self.status: dict[str, dict] = {}   # proc key -> what it reported at the last pull
        self.searches: queue.SimpleQueue = queue.SimpleQueue()   # (ident, req, ok, answer) from helper threads
        # The sampler thread: takes (procs, mesh ids) jobs, gives back rows; one job at a time.
        self.sample_jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.sample_rows: queue.SimpleQueue = queue.SimpleQueue()
        self.gone_pids: queue.SimpleQueue = queue.SimpleQueue()   # the sampler forgets them (its dicts)
        self.sampling = False
        self.sample_thread: threading.Thread | None = None
        self.log_dir = log_dir(agent.name)

    # ------------------------------------------------------------------ called by the agent
    def proc_config(self, mesh: str, rank: int) -> dict:
        """Added to a proc's fork config: where its output is also written."""
        return {"log_path": str(log_path(self.agent.name, mesh, rank))}

    def expect_respawn(self, keys) -> None:
        self.respawning.update(keys)

    def proc_ready(self, p) -> None:
        if self.interval <= 0:
            self.agent.send(p.ident, Ev.make("tel_enable") + (False,))
        event = "respawned" if p.key in self.respawning else "spawned"
        self.respawning.discard(p.key)
        self._add("proc_events", (time.time(), self.agent.host, p.mesh_name, p.rank, p.pid, event, p.key), p.mesh_id)

    def proc_exited(self, p, pid: int, how: str, stopping: bool) -> None:
        self.gone_pids.put(pid)
        self.status.pop(p.key, None)
        self._add("proc_events", (time.time(), self.agent.host, p.mesh_name, p.rank, pid,
                                  "stopped" if stopping else "died", how), p.mesh_id)

    def tick(self, now: float) -> None:
        """Called at every turn of the agent's loop (a call to all 256 procs is dozens of
        turns): the queues are looked at with ``empty()``, not an exception raised each."""
        while not self.searches.empty():
            ident, req, ok, answer = self.searches.get_nowait()
            self.agent.reply(ident, req, ok, answer)
        while not self.sample_rows.empty():
            rows, mesh_ids, cost = self.sample_rows.get_nowait()
            self.sampling = False
            # A sample of many procs is costly (see the module docstring): the next waits.
            self.next_sample = max(self.next_sample, now + cost / SAMPLE_BUDGET)
            for s in rows:
                self._add("samples", tuple(s), mesh_ids.get(s.pid))
        if self.agent.spawns and self._spawning(now):
            self.next_sample = max(self.next_sample, now + self.interval)   # and one interval after it
        elif not self.agent.spawns:
            self.spawn_seen = 0.0
        if self.interval <= 0 or now < self.next_sample or self.sampling:
            return   # a sample still running (a starved host) is not queued behind again
        self.next_sample = now + self.interval
        alive = [p for p in self.agent.procs.values() if p.state == "alive" and p.pid]
        self._start_sample([(p.mesh_name, p.rank, p.pid) for p in alive], {p.pid: p.mesh_id for p in alive})
        for p in alive:   # the procs send their call records back as a tel_calls op
            self.agent.send(p.ident, Ev.make("tel_pull"))
        self._expire(time.time() - config.TELEMETRY_HISTORY_S.get())

    def _spawning(self, now: float) -> bool:
        """Wait with a sample while a spawn is under way (up to SPAWN_WAIT_S) and for one
        interval after it: it would read the /proc files of half-started procs and wake every
        started one for its records, CPU the spawn and its first calls need (256 procs: ~0.2
        s of a spawn's ~6 s of CPU on 2 cores, issue 11)."""
        if not self.spawn_seen:
            self.spawn_seen = now
        return now - self.spawn_seen < SPAWN_WAIT_S

    def _start_sample(self, procs: list, mesh_ids: dict) -> None:
        if self.sample_thread is None:
            self.sample_thread = threading.Thread(target=self._sample_loop, name="telemetry-sampler", daemon=True)
            self.sample_thread.start()
        self.sampling = True
        self.sample_jobs.put((procs, mesh_ids))

    def _sample_loop(self) -> None:
        """The sampler thread: the only one touching ``self.sampler``."""
        while True:
            job = self.sample_jobs.get()
            if job is None:
                return
            while True:
                try:
                    self.sampler.forget(self.gone_pids.get_nowait())
                except queue.Empty:
                    break
            procs, mesh_ids = job
            cpu0 = time.thread_time()
            try:
                rows = self.sampler.sample(procs)
            except Exception:
                log.exception("sampling the procs failed")
                rows = []
            # The pull of records costs about as much again, on the procs and the agent's loop.
            self.sample_rows.put((rows, mesh_ids, 2 * (time.thread_time() - cpu0)))

    def shutdown(self) -> None:
        """A private (non-persistent) mesh's logs go with it; a named mesh's stay."""
        if self.sample_thread is not None:
            self.sample_jobs.put(None)
        if not self.agent.persistent:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    # ------------------------------------------------------------------ ops (tel_*)
    def handle(self, op: str, ident: bytes, req: int, *args) -> None:
        getattr(self, "op_" + op)(ident, req, *args)

    def op_tel_since(self, ident, req, cursor: int = 0) -> None:
        """Every row after ``cursor``, by table, and the new cursor."""
        out = {name: rows.since(cursor) for name, rows in self.tables.items()}
        self.agent.reply(ident, req, True, {"cursor": self._last_seq(), "rows": out, "host": self.agent.host,
                                            "agent": self.agent.name, "gpu": self.sampler.gpu.available,
                                            "interval": self.interval, **self.now()})

    def now(self) -> dict:
        """The host's procs as they are now, and its lease (the Mesh panel, the status bar)."""
        a = self.agent
        procs = []
        for p in a.procs.values():
            st = dict(self.status.get(p.key, {}))
            st.setdefault("state", "idle" if p.state == "alive" else p.state)
            if p.state != "alive":
                st["state"] = p.state   # dead, starting or stopping: the agent knows best
            elif self.sampler.os_state.get(p.pid) in SHORT:
                st["state"] = SHORT[self.sampler.os_state[p.pid]]   # stopped by a signal, ...: its
                # last report (idle, say) is not what it is now
            procs.append({"key": p.key, "mesh": p.mesh_name, "rank": p.rank, "pid": p.pid, **st})
        detached = time.monotonic() - a.controller_seen if a.controller is None else 0.0
        return {"procs": procs, "lease": a.lease, "detached_s": detached, "persistent": a.persistent,
                "controller": a.controller_addr}

    def op_tel_config(self, ident, req, interval: float) -> None:
        """Sampling period in seconds; 0 turns sampling (and call-record collection) off."""
        self.interval = float(interval)
        self.next_sample = 0.0
        for p in self.agent.procs.values():   # procs record calls only while someone collects them
            if p.state == "alive" and p.ident is not None:
                self.agent.send(p.ident, Ev.make("tel_enable") + (self.interval > 0,))
        self.agent.reply(ident, req, True, None)

    def op_tel_calls(self, ident, req, calls: list, cells: list, key: str = "", status: dict | None = None) -> None:
        """A proc's call and cell records since its last report, and its status now (fire
        and forget)."""
        if key in self.agent.procs and status is not None:
            self.status[key] = status
        p = self.agent.procs.get(key)
        mesh_id = p.mesh_id if p is not None else None
        for table, rows in (("calls", calls), ("cells", cells)):
            if rows and type(rows) is list and set(map(type, rows)) == {tuple} and min(map(len, rows)):
                self.tables[table].add(self.seq + 1, rows, self.agent.host, mesh_id)
                self.seq += len(rows)

    def op_tel_logs(self, ident, req, mesh, ranks, grep, tail, since) -> None:
        """Search this host's proc logs on a helper thread; the loop sends the answer."""
        def run():
            try:
                ans = search(self.log_dir, mesh, None if ranks is None else set(ranks), grep, tail, since)
                self.searches.put((ident, req, True, ans))
            except Exception as e:
                self.searches.put((ident, req, False, e))
        threading.Thread(target=run, name="log-search", daemon=True).start()

    # ------------------------------------------------------------------ history
    def _add(self, table: str, row: tuple, mesh_id: str | None) -> None:
        """``mesh_id`` tells apart two meshes of one name (a mesh stopped, then spawned again)."""
        self.seq += 1
        self.tables[table].add(self.seq, [row], None, mesh_id)

    def _last_seq(self) -> int:
        return max((rows.last() for rows in self.tables.values()), default=0)

    def _expire(self, oldest: float) -> None:
        for rows in self.tables.values():
            rows.expire(oldest)


class History:
    """One table of the agent's history: the last ``MAX_ROWS`` rows, numbered, oldest first.

    Rows stay in the chunks they came in: a proc's pull brings the records of every call it
    ran since the last one (at 256 procs, 256 records a call to all: a tuple built per record
    cost the agent's loop ~1.8 us each, ~0.45 ms a call, in bursts of ~0.15 s that held up the
    calls in flight). A row is built only when a controller asks (``since``): as the proc wrote
    it plus the mesh id, with the host after its first field when the chunk names one."""

    def __init__(self):
        self.chunks: collections.deque = collections.deque()   # [first row's number, rows, host, mesh id]
        self.count = 0

    def add(self, first: int, rows: list, host: str | None, mesh_id: str | None) -> None:
        self.chunks.append([first, rows, host, mesh_id])
        self.count += len(rows)
        if self.count > MAX_ROWS:
            self._drop(self.count - MAX_ROWS)

    def last(self) -> int:
        if not self.chunks:
            return 0
        first, rows = self.chunks[-1][:2]
        return first + len(rows) - 1

    def since(self, cursor: int) -> list:
        """The rows numbered after ``cursor``, oldest first."""
        parts = []
        for first, rows, host, mesh_id in reversed(self.chunks):
            if first + len(rows) - 1 <= cursor:
                break
            parts.append((rows[cursor - first + 1:] if first <= cursor else rows, host, mesh_id))
        out = []
        for rows, host, mesh_id in reversed(parts):
            if host is None:
                out.extend([(*r, mesh_id) for r in rows])
            else:
                out.extend([(r[0], host, *r[1:], mesh_id) for r in rows])
        return out

    def expire(self, oldest: float) -> None:
        """Drop the rows older than ``oldest`` (a time) from the oldest end, up to the first
        that is not."""
        while self.chunks:
            rows = self.chunks[0][1]
            n = 0
            while n < len(rows) and rows[n][0] < oldest:
                n += 1
            if not n:
                return
            self._drop(n)
            if n < len(rows):
                return

    def _drop(self, n: int) -> None:
        """Drop the ``n`` oldest rows."""
        while n > 0 and self.chunks:
            c = self.chunks[0]
            k = len(c[1])
            if k <= n:
                self.chunks.popleft()
            else:
                c[0], c[1], k = c[0] + n, c[1][n:], n
            self.count -= k
            n -= k
