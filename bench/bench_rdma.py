"""RDMA buffers and the same-host tensor path: throughput, peak memory, ratios to the
pyzmq baseline run in the same run. Prints JSON lines (``JSON {...}``).

  python bench/bench_rdma.py [--big] [--no-baseline]

  * read_into / write_from of a 64 MiB buffer between two procs, per backend (shm, tcp),
    timed in the reading proc (destination allocated once, as with a registered buffer);
  * with --big, the same for 1 GiB once, and the reader's and owner's peak RSS growth
    during it, in copies of the buffer (0 = no extra copy);
  * a 64 MiB tensor argument and result through plain ``call_one`` (the shared bench's
    workload e), with the same-host path on and off;
  * the baseline's 64 MiB figures (bench/baseline.sh --mode steady and --mode raw) and
    our ratios to them.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import cloudpickle
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import common  # noqa: E402

from monarch_kernel.actor import Actor, endpoint, this_host  # noqa: E402
from monarch_kernel.rdma import RDMABuffer  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = "MONARCH_KERNEL_RDMA_BACKEND"


def _rss_peak_reset() -> int:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")   # reset VmHWM to the current RSS
    return _status("VmRSS")


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


class Node(Actor):
    def __init__(self):
        self.t = None
        self.buf = None

    @endpoint
    def own(self, nbytes: int) -> RDMABuffer:
        if self.buf is not None:
            self.buf.drop()
        self.t = self.buf = None
        self.t = torch.ones(nbytes, dtype=torch.uint8)
        self.buf = RDMABuffer(self.t)
        return self.buf

    @endpoint
    def peak_reset(self) -> int:
        return _rss_peak_reset()

    @endpoint
    def peak(self) -> int:
        return _status("VmHWM")

    @endpoint
    def transfer(self, buf: RDMABuffer, backend: str, write: bool, iters: int) -> dict:
        os.environ[ENV] = backend
        try:
            dst = torch.ones(buf.size(), dtype=torch.uint8)
            op = buf.write_from if write else buf.read_into
            op(dst, timeout=120).get()   # warm-up (connections, page faults)
            base = _rss_peak_reset()
            times = []
            for _ in range(iters):
                t0 = time.perf_counter()
                op(dst, timeout=120).get()
                times.append(time.perf_counter() - t0)
            return {"times": times, "extra": _status("VmHWM") - base, "used": buf.backend}
        finally:
            os.environ.pop(ENV, None)

    @endpoint
    def tsum(self, t: torch.Tensor) -> float:
        return float(t.sum())

    @endpoint
    def make_big(self, numel: int) -> None:
        self.t = torch.ones(numel, dtype=torch.float32)

    @endpoint
    def get_big(self) -> torch.Tensor:
        return self.t


def bench_buffers(nodes, nbytes: int, iters: int, tag: str, peak: bool):
    owner, reader = nodes.slice(gpus=0), nodes.slice(gpus=1)
    buf = owner.own.call_one(nbytes).get()
    out = {}
    for backend in ("shm", "tcp"):
        for write in (False, True):
            name = f"rdma_{'write_from' if write else 'read_into'}_{tag}_{backend}"
            base = owner.peak_reset.call_one().get()
            r = reader.transfer.call_one(buf, backend, write, iters).get()
            assert r["used"] == backend, r
            med = statistics.median(r["times"])
            gbps = round(nbytes / med / 1e9, 3)
            out[name] = gbps
            common.emit(name + "_GBps", gbps, "GB/s", iters=iters, bytes=nbytes)
            if peak:
                common.emit(name + "_reader_extra_copies", round(r["extra"] / nbytes, 3), "copies",
                            bytes=nbytes)
                common.emit(name + "_owner_extra_copies",
                            round((owner.peak.call_one().get() - base) / nbytes, 3), "copies", bytes=nbytes)
    buf.drop()
    return out


def bench_plain_call(nodes, tag: str):
    actor = nodes.slice(gpus=1)
    t = torch.ones(common.PAYLOAD_NUMEL, dtype=torch.float32)
    out = {}
    for _ in range(common.PAYLOAD_WARMUP):
        actor.tsum.call_one(t).get()
    samples = []
    for _ in range(common.PAYLOAD_ITERS):
        t0 = time.perf_counter()
        assert actor.tsum.call_one(t).get() == float(common.PAYLOAD_NUMEL)
        samples.append(time.perf_counter() - t0)
    common.emit_payload(f"send64MiB{tag}", samples)
    out["send"] = common.PAYLOAD_BYTES / statistics.median(samples) / 1e9
    actor.make_big.call_one(common.PAYLOAD_NUMEL).get()
    for _ in range(common.PAYLOAD_WARMUP):
        actor.get_big.call_one().get()
    samples = []
    for _ in range(common.PAYLOAD_ITERS):
        t0 = time.perf_counter()
        r = actor.get_big.call_one().get()
        samples.append(time.perf_counter() - t0)
        del r
    common.emit_payload(f"recv64MiB{tag}", samples)
    out["recv"] = common.PAYLOAD_BYTES / statistics.median(samples) / 1e9
    return out


def baseline() -> dict:
    got = {}
    for mode in (["--mode", "steady", "--n", "4"], ["--mode", "raw"]):
        res = subprocess.run(["bash", os.path.join(ROOT, "bench", "baseline.sh"), *mode], cwd=ROOT,
                             capture_output=True, text=True, timeout=600)
        for line in res.stdout.splitlines():
            if line.startswith("JSON "):
                rec = json.loads(line[5:])
                if rec["metric"].endswith("_GBps"):
                    got[f"{rec['system']}:{rec['metric']}"] = rec["value"]
    return got


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--big", action="store_true", help="also 1 GiB, once (needs ~3 GiB free)")
    p.add_argument("--no-baseline", action="store_true")
    a = p.parse_args()
    common.CTX.update(bench="rdma")
    pm = this_host().spawn_procs(per_host={"gpus": 2}, name="bench-rdma")
    try:
        nodes = pm.spawn("nodes", Node)
        ours = bench_buffers(nodes, 64 << 20, 5, "64MiB", peak=False)
        plain = bench_plain_call(nodes, "")
        from monarch_kernel.core import wire

        hook, wire.LARGE_TENSOR_HOOK = wire.LARGE_TENSOR_HOOK, None   # our side only: args
        bench_plain_call(nodes, "_socketpath_args")
        wire.LARGE_TENSOR_HOOK = hook
        if a.big:
            ours.update(bench_buffers(nodes, 1 << 30, 1, "1GiB", peak=True))
    finally:
        pm.stop()
    if not a.no_baseline:
        base = baseline()
        for k, v in sorted(base.items()):
            common.emit("baseline_" + k.replace(":", "_"), v, "GB/s")
        b_send = base.get("zmq-ipc:send64MiB_GBps")
        b_recv = base.get("zmq-ipc:recv64MiB_GBps")
        b_raw = base.get("zmq-raw:send64MiB_zerocopy_ipc_GBps")
        if b_send:
            common.emit("ratio_send64MiB_vs_baseline", round(plain["send"] / b_send, 2), "x")
        if b_recv:
            common.emit("ratio_recv64MiB_vs_baseline", round(plain["recv"] / b_recv, 2), "x")
        if b_raw:
            for k, v in ours.items():
                common.emit(f"ratio_{k}_vs_raw_zerocopy_ipc", round(v / b_raw, 2), "x")


if __name__ == "__main__":
    main()
