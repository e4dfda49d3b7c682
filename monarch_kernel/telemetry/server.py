"""The Jupyter server side of the Mesh panel: meshes on this machine, their procs, logs.

A jupyter_server extension (enabled by ``jupyter_server_config.d/monarch_kernel.json``):

  GET  /monarch/meshes[?kernel=ID]     every mesh with a connection file here (any kernel's or
                                       script's), its hosts, procs, state, figures, sparklines,
                                       and which one the kernel ID is attached to
  GET  /monarch/meshes/NAME/logs?tail=N&grep=RE    its procs' log lines, newest last
  POST /monarch/meshes/NAME/stop       stop its procs and agents

It reads the agents the way a controller does (the key from the connection file) but never
attaches: it asks ``tel_since`` and ``tel_logs``, which any holder of the key may ask, so a
notebook attached to the mesh keeps it. The panel asks once a second while it is shown,
and not at all when it is hidden.
"""
from __future__ import annotations

import asyncio
import json
import re
import time

from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join
from tornado import web

from .store import store

SPARK_S = 60.0
ASK_TIMEOUT_S = 3.0
_CONTROLLER_PID = re.compile(r"/(\d+)-inbox-")   # core.transport.ipc_name("inbox")


def _meshes() -> list[dict]:
    """Every mesh of this machine. One whose agents are only partly gone (a job that lost a
    host) is alive here, with ``hosts_gone``: its other hosts' ranks still answer, and its
    stop button must still end them (it read "not running", the button disabled)."""
    from monarch_kernel.core.connection import agents_gone, list_meshes

    out = []
    for name, info, alive in list_meshes():
        gone = 0 if alive else agents_gone(info)
        out.append({"name": name, "info": info, "alive": alive or gone < len(info.get("agents", [])),
                    "hosts_gone": gone})
    return out


def _ask(info: dict, op: str, *args, timeout: float = ASK_TIMEOUT_S, per_agent=None) -> dict:
    """``op`` to every agent of a mesh, all at once: {address: answer or exception}.
    ``per_agent(address)``: the arguments for that agent, when they differ."""
    from monarch_kernel.core.runtime import runtime

    rt = runtime()
    key = bytes.fromhex(info["key"])
    futs = {a["addr"]: rt.agent_request(a["addr"], key, op, *(per_agent(a["addr"]) if per_agent else args))
            for a in info.get("agents", [])}
    out = {}
    for addr, f in futs.items():
        try:
            out[addr] = f.get(timeout)
        except Exception as e:   # an agent that stopped between the listing and now
            out[addr] = e
    return out


# What each agent last said of its procs (address -> its host and proc rows), so that when it
# stops answering its ranks are still listed, as lost or unreachable, not dropped from the panel.
_SEEN: dict[str, tuple[str, list[dict]]] = {}
LOST = "host gone"   # a rank whose host's agent no longer runs (its procs end with it)


def describe_mesh(name: str, info: dict, alive: bool, hosts_gone: int = 0) -> dict:
    """The panel's view of one mesh. An agent that does not answer within ASK_TIMEOUT_S
    (a host cut off, stopped, or lost on a cluster, where its pid cannot be checked) is
    named in ``hosts_silent`` and the ranks it last reported stay listed as ``unreachable``
    (those dead then stay dead), as `%mesh status` says them; those of an agent known gone
    (its local pid ended) as ``host gone``. Rows of agents never heard from cannot be listed: the count says them."""
    mesh = {"name": name, "alive": alive, "persistent": info.get("persistent", False), "hosts": [],
            "procs": [], "lease_s": info.get("lease"), "detached_s": 0.0, "controller_pids": [], "gpu": False,
            "hosts_gone": hosts_gone, "hosts_silent": 0}
    if not alive:
        return mesh
    from monarch_kernel.core.connection import agent_gone

    st = store()
    gone = [a["addr"] for a in info.get("agents", []) if agent_gone(a)]   # (not asked: no 3 s wait for them)
    answers = _ask({**info, "agents": [a for a in info.get("agents", []) if a["addr"] not in gone]}, "tel_since",
                   per_agent=lambda addr: (st.cursors.get(addr, 0),))
    for addr in gone:
        _unanswered(mesh, addr, True, info)
    for addr, ans in answers.items():
        if isinstance(ans, Exception):
            _unanswered(mesh, addr, False, info)
            continue
        st.insert(addr, ans)
        mesh["hosts"].append(ans["host"])
        mesh["lease_s"] = ans.get("lease")
        mesh["detached_s"] = max(mesh["detached_s"], ans.get("detached_s") or 0.0)
        mesh["gpu"] = mesh["gpu"] or bool(ans.get("gpu"))
        ctl = json.dumps(ans.get("controller"))
        mesh["controller_pids"] += [int(m) for m in _CONTROLLER_PID.findall(ctl)]
        latest = _latest(ans["agent"])
        rows = []
        for p in ans["procs"]:
            s = latest.get((p["mesh"], p["rank"]), {})
            alive_p = p["state"] not in ("dead", "stopping")
            rows.append({
                "rank": p["rank"], "mesh": p["mesh"], "host": ans["host"], "pid": p["pid"], "state": p["state"],
                "actors": [a for a in p.get("actors", []) if a != "__cells__"], "buffers": p.get("buffers"),
                "cpu": s.get("cpu") if alive_p else None, "rss_mb": s.get("rss") if alive_p else None,
                "uss_mb": s.get("uss") if alive_p else None,
                "gpu_util": s.get("gpu_util") if alive_p else None,
                "cpu_hist": s.get("cpu_hist", []), "rss_hist": s.get("rss_hist", []),
                "gpu_hist": s.get("gpu_hist", [])})
        _SEEN[addr] = (ans["host"], rows)
        mesh["procs"] += rows
    mesh["procs"].sort(key=lambda p: (p["mesh"], p["rank"]))
    return mesh


def _unanswered(mesh: dict, addr: str, gone: bool, info: dict) -> None:
    """An agent gave no answer (``gone``: it no longer runs, counted in hosts_gone already):
    its ranks as it last reported them, with no figures."""
    entry = next((a for a in info.get("agents", []) if a.get("addr") == addr), {})
    host, rows = _SEEN.get(addr, (entry.get("host") or addr, []))
    if not gone:
        mesh["hosts_silent"] += 1
        mesh["hosts"].append(host)
    for p in rows:
        state = LOST if gone else "dead" if p["state"] == "dead" else "unreachable"
        mesh["procs"].append({**p, "state": state, "cpu": None, "rss_mb": None, "uss_mb": None, "gpu_util": None,
                              "cpu_hist": [], "rss_hist": [], "gpu_hist": []})


def _latest(agent: str) -> dict:
    rows = store().query("select mesh, rank, cpu_percent, rss_mb, gpu_util, uss_mb, time from samples where "
                         "agent = ? and time > ? order by time", (agent, time.time() - SPARK_S))
    out: dict = {}
    for mesh, rank, cpu, rss, gpu, uss, _t in rows:
        d = out.setdefault((mesh, rank), {"cpu_hist": [], "rss_hist": [], "gpu_hist": []})
        if uss is not None:   # read every few samples (sampler.py): the latest reading
            d["uss"] = uss
        d["cpu_hist"].append(round(cpu, 1))
        d["rss_hist"].append(round(rss, 1))
        if gpu is not None:   # no GPU: no line at all, not a line at zero
            d["gpu_hist"].append(round(gpu, 1))
        d.update(cpu=cpu, rss=rss, gpu_util=gpu)
    return out


def _forget_gone_agents(meshes: list[dict]) -> None:
    """Close this server's links to agents whose mesh is gone (no socket per dead mesh)."""
    from monarch_kernel.core.runtime import runtime

    rt = runtime()
    live = {a["addr"] for m in meshes if m["alive"] for a in m["info"].get("agents", [])}
    st = store()
    for addr in list(st.cursors):
        if addr not in live:
            rt.forget_agent(addr)
            st.cursors.pop(addr, None)
            st.hosts.pop(addr, None)
    for addr in list(_SEEN):
        if addr not in live:
            del _SEEN[addr]


def _kernel_pid(server, kernel_id: str | None) -> int | None:
    if not kernel_id:
        return None
    try:
        km = server.kernel_manager.get_kernel(kernel_id)
        return km.provisioner.pid if km.provisioner is not None else None
    except Exception:
        return None


class MeshesHandler(APIHandler):
    @web.authenticated
    async def get(self):
        meshes = _meshes()
        described = await asyncio.to_thread(lambda: [describe_mesh(m["name"], m["info"], m["alive"], m["hosts_gone"])
                                                     for m in meshes])
        _forget_gone_agents(meshes)
        pid = _kernel_pid(self.settings.get("serverapp") or self, self.get_argument("kernel", None))
        mine = next((m["name"] for m in described if pid and pid in m["controller_pids"]), None)
        self.finish(json.dumps({"meshes": described, "kernel_mesh": mine, "time": time.time()}))


class LogsHandler(APIHandler):
    @web.authenticated
    async def get(self, name: str):
        m = next((m for m in _meshes() if m["name"] == name), None)
        if m is None or not m["alive"]:
            raise web.HTTPError(404, f"no running mesh named {name!r}")
        tail = int(self.get_argument("tail", "200"))
        grep = self.get_argument("grep", None) or None
        answers = await asyncio.to_thread(_ask, m["info"], "tel_logs", None, None, grep, tail, None,
                                          timeout=60.0)
        lines = []
        for ans in answers.values():
            if not isinstance(ans, Exception):
                lines += [{"time": ln.time, "mesh": ln.mesh, "rank": ln.rank, "stream": ln.stream, "text": ln.text}
                          for ln in ans["lines"]]
        lines.sort(key=lambda ln: ln["time"])
        self.finish(json.dumps({"lines": lines[-tail:]}))


class StopHandler(APIHandler):
    @web.authenticated
    async def post(self, name: str):
        """As ``%mesh stop NAME``: a job's mesh (``--hosts``, Slurm, Kubernetes, SSH) is released
        with its job (agents, then the allocation and its record); a lone agent is asked to
        shut down (it removes its own connection file)."""
        from monarch_kernel.job import cached_job

        m = next((m for m in _meshes() if m["name"] == name), None)
        if m is None:
            raise web.HTTPError(404, f"no mesh named {name!r}")
        job = await asyncio.to_thread(cached_job, name)
        if job is not None:
            await asyncio.to_thread(job.kill)
        else:
            await asyncio.to_thread(_ask, m["info"], "shutdown", timeout=10.0)
        self.finish(json.dumps({"stopped": name}))


def _load_jupyter_server_extension(server) -> None:
    base = url_path_join(server.web_app.settings["base_url"], "monarch", "meshes")
    server.web_app.add_handlers(".*$", [
        (base, MeshesHandler),
        (url_path_join(base, r"([^/]+)", "logs"), LogsHandler),
        (url_path_join(base, r"([^/]+)", "stop"), StopHandler),
    ])
    server.log.info("monarch_kernel: Mesh panel API at %s", base)


def _jupyter_server_extension_points():
    return [{"module": "monarch_kernel.telemetry.server"}]
