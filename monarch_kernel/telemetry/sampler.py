"""Per-proc resource samples, taken on the host agent (agent side; no zmq here).

psutil gives CPU %, memory and counts. One ``psutil.Process`` is kept per pid between
samples because its ``cpu_percent(None)`` is measured since the previous call on the same
object (a fresh object always says 0.0). USS needs ``memory_full_info()``, which reads
``/proc/PID/smaps`` (about 4 ms for a proc that imported torch, against 0.1 ms for the rest),
so a proc's is refreshed only every ``USS_EVERY`` samples and the last value is repeated
between. Those reads are spread over the samples: at most ``USS_PER_SAMPLE`` or a
``USS_EVERY``-th of the procs a sample, the oldest first; a proc not read yet has no USS
(None). Reading all of them at once, as the first sample after 256 procs spawned did, cost
the agent ~1 s of CPU while the user's first calls ran (issue 11).

GPU figures come from NVML (``nvidia-ml-py``) when a GPU is there: memory per process from
the running compute processes, utilisation per process where the driver reports it, else
the device's utilisation for every proc using that device. With no GPU (or no NVML) the GPU
fields are ``None``: absent, never a misleading 0.
"""
from __future__ import annotations

import logging
import time
from typing import NamedTuple

import psutil

log = logging.getLogger("monarch_kernel.telemetry")

USS_EVERY = 10        # samples between two USS reads of one proc
USS_PER_SAMPLE = 8    # USS reads a sample: this many, or a USS_EVERY-th of the procs if more
MB = 1024 * 1024


class Sample(NamedTuple):
    """One row of the ``samples`` table (as the agent keeps and ships it)."""
    time: float
    host: str
    mesh: str
    rank: int
    pid: int
    cpu_percent: float
    rss_mb: float
    uss_mb: float | None
    threads: int
    fds: int
    gpu_util: float | None
    gpu_mem_mb: float | None


class GpuProbe:
    """NVML, opened once. ``available`` is False on a host without a GPU or without NVML."""

    def __init__(self, nvml=None):
        self.available = False
        self._nvml = None
        self._handles: list = []
        self._last_seen = 0
        try:
            if nvml is None:
                import pynvml as nvml
            nvml.nvmlInit()
            self._handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        except Exception as e:   # ImportError, NVMLError_LibraryNotFound, NVMLError_DriverNotLoaded...
            log.debug("no GPU telemetry: %s", e)
            return
        self._nvml = nvml
        self.available = bool(self._handles)

    def per_pid(self) -> dict[int, tuple[float | None, float | None]]:
        """pid -> (utilisation %, memory MB) for every process NVML sees on any device."""
        if not self.available:
            return {}
        nv, out = self._nvml, {}
        for h in self._handles:
            try:
                procs = nv.nvmlDeviceGetComputeRunningProcesses(h)
            except Exception:
                continue
            util_by_pid: dict[int, float] = {}
            try:
                for u in nv.nvmlDeviceGetProcessUtilization(h, self._last_seen):
                    util_by_pid[u.pid] = float(u.smUtil)
            except Exception:   # not supported on this device/driver: fall back to the device's figure
                try:
                    dev = float(nv.nvmlDeviceGetUtilizationRates(h).gpu)
                except Exception:
                    dev = None
                util_by_pid = {p.pid: dev for p in procs}
            for p in procs:
                mem = p.usedGpuMemory
                out[p.pid] = (util_by_pid.get(p.pid), None if mem is None else mem / MB)
        self._last_seen = int(time.time() * 1e6)
        return out


class ProcSampler:
    """Samples the procs of one host; forgets a pid when its proc is gone."""

    def __init__(self, host: str, gpu: GpuProbe | None = None):
        self.host = host
        self.gpu = gpu if gpu is not None else GpuProbe()
        self._ps: dict[int, psutil.Process] = {}
        self._uss: dict[int, float] = {}
        self._uss_at: dict[int, int] = {}   # pid -> the sample that read its USS
        self.os_state: dict[int, str] = {}  # pid -> psutil's status at the last sample
        self._count = 0

    def forget(self, pid: int) -> None:
        self._ps.pop(pid, None)
        self._uss.pop(pid, None)
        self._uss_at.pop(pid, None)
        self.os_state.pop(pid, None)

    def _uss_due(self, procs: list) -> set:
        """The pids whose USS this sample reads (see the module docstring)."""
        at, now = self._uss_at, self._count
        due = [pid for _, _, pid in procs if now - at.get(pid, -USS_EVERY) >= USS_EVERY]
        most = max(USS_PER_SAMPLE, -(-len(procs) // USS_EVERY))
        if len(due) > most:
            due.sort(key=lambda pid: at.get(pid, -USS_EVERY))   # never read, then the oldest
            del due[most:]
        return set(due)

    def sample(self, procs: list[tuple[str, int, int]]) -> list[Sample]:
        """``procs``: (mesh name, rank, pid) of each live proc. A proc that vanished between
        the agent's bookkeeping and this call is skipped (its death event says the rest)."""
        now = time.time()
        self._count += 1
        uss_due = self._uss_due(procs)
        gpu = self.gpu.per_pid() if self.gpu.available else {}
        rows = []
        for mesh, rank, pid in procs:
            ps = self._ps.get(pid)
            try:
                if ps is None:
                    ps = self._ps[pid] = psutil.Process(pid)
                    ps.cpu_percent(None)   # primes the counter; the next sample is the real one
                with ps.oneshot():
                    cpu = ps.cpu_percent(None)
                    rss = ps.memory_info().rss / MB
                    threads = ps.num_threads()
                    fds = ps.num_fds()
                    self.os_state[pid] = ps.status()   # (the same stat read: stopped, traced, in I/O)
                if pid in uss_due:
                    self._uss[pid] = ps.memory_full_info().uss / MB
                    self._uss_at[pid] = self._count
            except psutil.Error:
                self.forget(pid)
                continue
            g_util, g_mem = gpu.get(pid, (None, None)) if self.gpu.available else (None, None)
            if self.gpu.available and pid not in gpu:
                g_util, g_mem = 0.0, 0.0   # a GPU host, and this proc uses none of it: a true zero
            uss = self._uss.get(pid)
            rows.append(Sample(now, self.host, mesh, rank, pid, cpu, round(rss, 2),
                               None if uss is None else round(uss, 2), threads, fds, g_util, g_mem))
        for pid in set(self._ps) - {p for _, _, p in procs}:
            self.forget(pid)
        return rows
