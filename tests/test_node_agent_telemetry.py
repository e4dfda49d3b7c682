"""The host agent's telemetry sampler on a host of many procs (issue 11): what a sample
costs must not come in one burst while the user's first calls run."""
from __future__ import annotations

import subprocess
import types

import psutil

from monarch_kernel.telemetry import sampler
from monarch_kernel.telemetry.sampler import GpuProbe, ProcSampler


def test_a_host_of_many_procs_has_their_uss_read_a_few_a_sample_oldest_first_not_all_at_once(monkeypatch):
    procs = [subprocess.Popen(["sleep", "60"]) for _ in range(24)]
    reads: list[int] = []
    full = psutil.Process.memory_full_info

    def counted(self):
        reads.append(self.pid)
        return full(self)

    monkeypatch.setattr(psutil.Process, "memory_full_info", counted)
    try:
        s = ProcSampler("h", GpuProbe(nvml=types.SimpleNamespace()))
        listed = [("m", i, p.pid) for i, p in enumerate(procs)]
        rows = s.sample(listed)
        # the first sample (right after a spawn) reads USS_PER_SAMPLE smaps files, not 24
        assert len(reads) == sampler.USS_PER_SAMPLE == 8
        assert sum(r.uss_mb is not None for r in rows) == 8 and all(r.rss_mb > 0 for r in rows)
        s.sample(listed)
        s.sample(listed)
        assert sorted(reads) == sorted(p.pid for p in procs)   # each once, in three samples
        rows = s.sample(listed)
        assert all(r.uss_mb is not None and r.uss_mb > 0 for r in rows)
        for _ in range(sampler.USS_EVERY - 4):   # samples 5 to 10
            s.sample(listed)
        assert len(reads) == 24   # nobody is read again before USS_EVERY samples
        s.sample(listed)
        assert reads[24:] == reads[:8]   # then the oldest first
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _telemetry(monkeypatch, max_rows: int = 200_000):
    from monarch_kernel.telemetry import agent as tel

    monkeypatch.setattr(tel, "MAX_ROWS", max_rows)
    answers: list = []
    a = types.SimpleNamespace(host="h1", name="agent-x", procs={"k1": types.SimpleNamespace(mesh_id="mid-1")},
                              spawns={}, lease=None, controller=None, controller_seen=0.0, persistent=True,
                              controller_addr=None, reply=lambda ident, req, ok, value: answers.append(value))
    a.procs = {}
    t = tel.AgentTelemetry(a)
    a.procs = {"k1": types.SimpleNamespace(mesh_id="mid-1", key="k1", mesh_name="m", rank=3, pid=1, state="alive")}
    return t, answers


def test_call_records_a_proc_pulled_come_back_row_by_row_after_any_cursor(monkeypatch):
    t, answers = _telemetry(monkeypatch)
    calls = [(100.0 + i, "m", 3, "Actor", "step", 0.001 * i, i != 2) for i in range(5)]
    t._add("proc_events", (99.0, "h1", "m", 3, 1, "spawned", "k1"), "mid-1")
    t.op_tel_calls(b"", 0, calls, [(101.5, "m", 3, "cell-1", 0.2, True)], "k1", {"state": "idle"})
    t._add("samples", (102.0, "h1", "m", 3, 1, 1.0, 50.0, None, 3, 9, None, None), "mid-1")
    t.op_tel_since(b"", 0, 0)
    got = answers[-1]
    assert got["cursor"] == 8
    assert got["rows"]["calls"] == [(100.0 + i, "h1", "m", 3, "Actor", "step", 0.001 * i, i != 2, "mid-1")
                                    for i in range(5)]
    assert got["rows"]["cells"] == [(101.5, "h1", "m", 3, "cell-1", 0.2, True, "mid-1")]
    assert got["rows"]["proc_events"] == [(99.0, "h1", "m", 3, 1, "spawned", "k1", "mid-1")]
    assert len(got["rows"]["samples"]) == 1
    t.op_tel_since(b"", 0, 4)   # rows 5 to 8: the last two calls, the cell, the sample
    got = answers[-1]
    assert [r[0] for r in got["rows"]["calls"]] == [103.0, 104.0]
    assert len(got["rows"]["cells"]) == 1 and got["rows"]["proc_events"] == []
    t.op_tel_since(b"", 0, 8)
    assert all(rows == [] for rows in answers[-1]["rows"].values()) and answers[-1]["cursor"] == 8
    t.op_tel_calls(b"", 0, [("not", "a"), "row"], [], "k1", None)   # a malformed pull is dropped whole
    t.op_tel_since(b"", 0, 8)
    assert answers[-1]["rows"]["calls"] == []


def test_the_agents_history_keeps_its_last_rows_and_forgets_what_is_too_old(monkeypatch):
    t, answers = _telemetry(monkeypatch, max_rows=6)
    for k in range(3):   # three pulls of four records: the table keeps the last six rows
        t.op_tel_calls(b"", 0, [(10.0 * k + i, "m", 3, "A", "e", 0.0, True) for i in range(4)], [], "k1", None)
    t.op_tel_since(b"", 0, 0)
    assert [r[0] for r in answers[-1]["rows"]["calls"]] == [12.0, 13.0, 20.0, 21.0, 22.0, 23.0]
    t._expire(21.0)
    t.op_tel_since(b"", 0, 0)
    assert [r[0] for r in answers[-1]["rows"]["calls"]] == [21.0, 22.0, 23.0]
    assert answers[-1]["cursor"] == 12
