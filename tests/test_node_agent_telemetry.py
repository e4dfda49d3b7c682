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
