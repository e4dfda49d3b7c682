"""``procs.telemetry`` (``mesh.telemetry`` in a notebook): SQL, latest figures and logs
of one proc mesh, from the agents of its hosts.

    mesh.telemetry.query("select rank, max(rss_mb) from samples group by rank")
    mesh.telemetry.query("select * from proc_events where event = ?", "died")
    mesh.telemetry.latest()            # {rank: newest sample as a dict}
    mesh.telemetry.logs(grep="loss", tail=20)
    mesh.telemetry.sampling(0)         # stop sampling on its hosts (1.0: every second)

A query sees this mesh's rows only, across its hosts (``agent``, ``host``) and respawns;
see ``store.py`` for the columns.
"""
from __future__ import annotations

from .result import QueryResult
from .store import SCHEMA, store

LOG_TIMEOUT_S = 120.0


class MeshTelemetry:
    def __init__(self, state):
        self._state = state   # the ProcMeshState (shared by every view of the mesh)
        self.unreachable: dict[str, str] = {}   # agent address -> why it gave nothing at the last look

    def _agents(self) -> dict[str, bytes]:
        return {addr: self._state.key for addr in self._state.agents()}

    def _agent_names(self) -> list[str]:
        hosts = store().hosts
        return [hosts[a]["agent"] for a in self._agents() if a in hosts]

    def refresh(self) -> None:
        """Fetch what the hosts gathered since the last look (one batch per host). A host that
        cannot answer keeps its rows from before (a lost host's last samples are what a
        post-mortem wants); ``unreachable`` names it and says why."""
        self.unreachable = store().pull(self._agents())

    def query(self, sql: str, *params) -> QueryResult:
        """Run SQL over this mesh's rows of the telemetry tables, fresh from the hosts (a
        mesh of the same name spawned before is not in them). ``?`` marks ``params``."""
        self.refresh()
        return store().query(sql, params, mesh_id=self._state.id)

    def latest(self) -> dict[int, dict]:
        """The newest sample of each live rank of this mesh, as dicts (for ``%mesh top``).
        Raises HostUnreachableError when no host answered (nothing here is live)."""
        self.refresh()
        if self.unreachable and len(self.unreachable) >= len(self._state.agents()):
            from monarch_kernel.core.errors import HostUnreachableError

            raise HostUnreachableError(next(iter(self.unreachable.values())))
        names = self._agent_names()
        if not names:
            return {}
        marks = ",".join("?" * len(names))
        rows = store().query(
            f"select s.* from samples s join (select agent, rank, max(time) t from samples where mesh_id = ? and "
            f"agent in ({marks}) group by agent, rank) m on s.agent = m.agent and s.rank = m.rank and s.time = m.t",
            (self._state.id, *names))
        out = {r[rows.columns.index("rank")]: dict(zip(rows.columns, r)) for r in rows}
        # a proc's USS is read every few samples (sampler.py): its latest reading, not the newest row's
        uss = store().query(f"select rank, uss_mb, max(time) from samples where mesh_id = ? and agent in ({marks}) "
                            f"and uss_mb is not null group by agent, rank", (self._state.id, *names))
        for rank, mb, _t in uss:
            if rank in out:
                out[rank]["uss_mb"] = mb
        return out

    def history(self, column: str, seconds: float = 60.0) -> dict[int, list[float]]:
        """rank -> the last ``seconds`` of one samples column (sparklines); no refresh."""
        if column not in SCHEMA["samples"]:
            raise ValueError(f"no column {column!r} in samples ({SCHEMA['samples']})")
        names = self._agent_names()
        marks = ",".join("?" * len(names)) or "''"
        rows = store().query(f"select rank, {column} from samples where mesh_id = ? and agent in ({marks}) and "
                             f"time > (select max(time) from samples) - ? order by time",
                             (self._state.id, *names, seconds))
        out: dict[int, list[float]] = {}
        for rank, v in rows:
            out.setdefault(rank, []).append(v)
        return out

    def has_gpu(self) -> bool:
        hosts = store().hosts
        return any(hosts.get(a, {}).get("gpu") for a in self._agents())

    def sampling(self, seconds: float) -> None:
        """Sample this mesh's hosts every ``seconds`` (0: off, also for call records)."""
        from monarch_kernel.core.runtime import runtime

        rt = runtime()
        for f in [rt.agent_request(a, k, "tel_config", float(seconds)) for a, k in self._agents().items()]:
            f.get(10)

    def logs(self, ranks=None, grep: str | None = None, tail: int | None = None, since: dict | None = None) -> dict:
        """Log lines of this mesh's ranks kept on their hosts, merged in time order.
        ``since``: the ``since`` of a previous answer, for only what came after (follow)."""
        from monarch_kernel.core.runtime import runtime

        if grep:
            import re

            try:
                re.compile(grep)
            except re.error as e:
                raise ValueError(f"--grep {grep!r} is not a valid regular expression: {e}") from None
        rt = runtime()
        since = since or {}
        rank_list = None if ranks is None else sorted(ranks)
        futs = {a: rt.agent_request(a, k, "tel_logs", self._state.name, rank_list, grep, tail, since.get(a))
                for a, k in self._agents().items()}
        lines, matched, dropped, cursor = [], 0, 0, {}
        for a, f in futs.items():
            ans = f.get(LOG_TIMEOUT_S)
            lines.extend(ans["lines"])
            matched += ans["matched"]
            dropped += ans["dropped"]
            cursor[a] = ans["since"]
        lines.sort(key=lambda ln: ln.time)
        if tail is not None and len(lines) > tail:
            dropped += len(lines) - tail
            lines = lines[-tail:] if tail else []
        return {"lines": lines, "matched": matched, "dropped": dropped, "since": cursor}

    def __repr__(self):
        return (f"<telemetry of proc mesh '{self._state.name}' ({len(self._state.procs)} procs): "
                f"tables {', '.join(SCHEMA)}; .query(sql), .latest(), .logs(...)>")
