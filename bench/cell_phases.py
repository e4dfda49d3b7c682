"""Where a trivial ``%%on_mesh`` cell's kernel-side time goes, phase by phase (issue 11).

    .venv/bin/python bench/cell_phases.py [--n 256] [--cells 30] [--code '%%on_mesh\\nx = 1']
                                          [--setup 'PYTHON RUN IN THE KERNEL FIRST']

One real kernel (this tree), a mesh of N procs, then ``--cells`` cells. bench_scale.py's
cell figure is the kernel's execute_reply header date minus the ``started`` of its
metadata (ipykernel sets it as it takes the request): all of this script's phases. In the
kernel, timestamps (wall, and the main thread's CPU: ``c_*``) are taken around the
magic's parts by wrapping them (plain cells install the wrappers; nothing is left in the
tree), and a JSON line gives each phase's median (ms):

  pre      started -> the magic runs: ipykernel and IPython (execute_input, history,
           transform, compile, hooks)
  prepare  the magic's options, mesh check, output capture, and the call sent
  fan      the call sent -> its future resolved (agent, procs, replies: the mesh's part)
  wake     resolved -> the cell's coroutine runs again
  end      output grouping, progress and the summary display (router.end)
  post     the magic returned -> the reply's date (IPython and ipykernel after the cell)

``--setup`` runs once before the timed cells (e.g. to change a setting, A/B in one tree).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cell_cpu import Tree  # noqa: E402

WRAP = r'''
import time as _t, monarch_kernel.jupyter.magics as _mg, monarch_kernel.jupyter.on_mesh as _om
_TL = []
_orig_async, _orig_prepare, _orig_wait = _mg._MAGICS.on_mesh_async, _mg._MAGICS._prepare, _om._Run.wait_async
_orig_end = _mg._MAGICS.router.end
def _at(name, d=None):
    d = _TL[-1] if d is None else d
    d[name], d["c_" + name] = _t.time(), _t.thread_time()
async def _p_async(line, code):
    d = {}; _TL.append(d); _at("entry", d)
    try:
        return await _orig_async(line, code)
    finally:
        _at("exit", d)
def _p_prepare(*a, **k):
    r = _orig_prepare(*a, **k)
    _at("sent")
    r[1].future.add_done_callback(lambda f, d=_TL[-1]: d.__setitem__("done", _t.time()))
    return r
async def _p_wait(self):
    r = await _orig_wait(self)
    _at("woke")
    return r
def _p_end(cap):
    _at("end0"); r = _orig_end(cap); _at("end1")
    return r
_mg._MAGICS.on_mesh_async, _mg._MAGICS._prepare, _om._Run.wait_async = _p_async, _p_prepare, _p_wait
_mg._MAGICS.router.end = _p_end
_K = get_ipython().kernel
_orig_er = _K.shell_handlers["execute_request"]
async def _p_er(*a, **k):
    c0 = _t.thread_time()
    try:
        return await _orig_er(*a, **k)
    finally:
        if _TL and "exit" in _TL[-1] and "c_er0" not in _TL[-1]:
            _TL[-1]["c_er0"], _TL[-1]["c_er1"] = c0, _t.thread_time()
_K.shell_handlers["execute_request"] = _p_er
'''


def phases(started: float, replied: float, d: dict) -> dict:
    return {"pre": d["entry"] - started, "prepare": d["sent"] - d["entry"], "fan": d["done"] - d["sent"],
            "wake": d["woke"] - d["done"], "end": d["end1"] - d["end0"], "post": replied - d["exit"],
            "total": replied - started,
            "c_pre": d["c_entry"] - d["c_er0"], "c_prepare": d["c_sent"] - d["c_entry"],
            "c_wait": d["c_woke"] - d["c_sent"], "c_end": d["c_end1"] - d["c_end0"],
            "c_post": d["c_er1"] - d["c_exit"], "c_execute_request": d["c_er1"] - d["c_er0"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--cells", type=int, default=30)
    ap.add_argument("--code", default="%%on_mesh\nx = 1")
    ap.add_argument("--setup", default="")
    a = ap.parse_args()
    from dateutil.parser import isoparse

    t = Tree(str(Path(__file__).resolve().parents[1]), a.n, "t0")
    try:
        for _ in range(5):
            t.k.ok(a.code)
        t.k.ok(WRAP)
        if a.setup:
            t.k.ok(a.setup)
        replies = [t.k.ok(a.code).reply for _ in range(a.cells)]
        marks = json.loads(t.k.ok("import json; print(json.dumps(_TL))").stdout)[-a.cells:]
        rows = []
        for r, d in zip(replies, marks):
            st = r["metadata"]["started"]
            st = (isoparse(st) if isinstance(st, str) else st).timestamp()
            rows.append(phases(st, r["header"]["date"].timestamp(), d))
        print(json.dumps({"n": a.n, "cells": a.cells, "load1": round(os.getloadavg()[0], 1),
                          **{k: round(statistics.median(r[k] for r in rows) * 1e3, 2) for k in rows[0]}}))
    finally:
        t.close()


if __name__ == "__main__":
    main()
