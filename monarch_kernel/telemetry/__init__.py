"""Telemetry of a mesh: what its procs use, what happened to them, what they printed.

Agent side (``agent.py``, ``sampler.py``, ``logs.py``): each host agent samples its procs
every second, records their spawns and deaths, collects their call and cell records
(``worker.py``, in each proc) and keeps an hour of it; each proc's output is also written
to a bounded, rotated file on its host. Controller side (``store.py``, ``view.py``): an
embedded SQLite database filled from the agents, one batch per host, when someone looks:
``procs.telemetry.query(sql)``, ``%mesh top``, ``%mesh logs``, the JupyterLab Mesh panel.
"""
from .result import QueryResult

__all__ = ["QueryResult"]
