"""Telemetry's costs and speeds, in one run (JSON lines, the shared record format).

  python bench/bench_telemetry.py [--n 4] [--rounds 6] [--log-gb 1.0] [--skip-logs]

* overhead: the reference workload's call_one p50 and pipelined calls/s on one 4-proc
  mesh, in rounds rotating off, on, off (``sampling(0)``: no samples, no call records;
  on: every second), so both see the same machine load and neither always goes first;
  medians of each, the ratio, and the spread of the "off" rounds (the noise floor).
* death to row: from SIGKILL of a proc to its ``died`` row in ``procs.telemetry`` (what
  the Mesh panel and ``%mesh top`` read), polling every 20 ms.
* logs: ``%mesh logs --grep`` (``procs.telemetry.logs``) over ``--log-gb`` of log files
  written into the agent's log folder (8 ranks), through the agent, end to end.
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import common  # noqa: E402

from monarch_kernel.actor import Actor, endpoint, this_host  # noqa: E402
from monarch_kernel.telemetry.store import store  # noqa: E402

emit = common.emit


class Bench(Actor):
    @endpoint
    def noop(self):
        return None


def round_figures(one) -> tuple[float, float]:
    for _ in range(200):
        one.noop.call_one().get()
    lat = []
    for _ in range(1000):
        t0 = time.perf_counter()
        one.noop.call_one().get()
        lat.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    futs = [one.noop.call_one() for _ in range(5000)]
    for f in futs:
        f.get()
    return statistics.median(lat) * 1e6, 5000 / (time.perf_counter() - t0)


def overhead(procs, rounds: int, n: int) -> None:
    one = procs.spawn("bench", Bench).slice(gpus=0)
    tel = procs.telemetry
    got: dict[bool, list] = {False: [], True: []}
    for i in range(rounds * 3):
        on = i % 3 == 1
        tel.sampling(1.0 if on else 0)
        time.sleep(1.2)   # at least one sample (and pull) inside an "on" round
        got[on].append(round_figures(one))
    tel.sampling(1.0)
    for idx, metric, unit in ((0, "rt_one_p50_us", "us"), (1, "pipelined_calls_per_s", "calls/s")):
        offs = [x[idx] for x in got[False]]
        off = statistics.median(offs)
        on_ = statistics.median(x[idx] for x in got[True])
        slower = (on_ / off - 1) if idx == 0 else (off / on_ - 1)
        q = statistics.quantiles(offs, n=4)
        emit(f"telemetry_{metric}_off", round(off, 1), unit, n=n, rounds=len(offs),
             iqr_pct=round(100 * (q[2] - q[0]) / off, 1))
        emit(f"telemetry_{metric}_on", round(on_, 1), unit, n=n, rounds=rounds)
        emit(f"telemetry_{metric}_slowdown_pct", round(100 * slower, 2), "%", n=n, rounds=rounds)


def death_to_row(procs) -> None:
    tel = procs.telemetry
    victim = procs.procs()[-1]
    tel.refresh()
    t0 = time.perf_counter()
    os.kill(victim.pid, signal.SIGKILL)
    while not tel.query("select 1 from proc_events where event = 'died' and pid = ?", victim.pid):
        time.sleep(0.02)
    emit("telemetry_death_to_row_ms", round((time.perf_counter() - t0) * 1e3, 1), "ms")
    procs.respawn()


def logs_grep(procs, gb: float) -> None:
    tel = procs.telemetry
    tel.refresh()
    agent = next(iter(store().hosts.values()))["agent"]
    from monarch_kernel.telemetry.logs import log_dir

    folder = log_dir(agent)
    ranks = 8
    per_rank = int(gb * 2**30 / ranks)
    line = b"%.3f o step 123456 loss 0.4242 lr 0.0001 grad_norm 1.2345 tokens/s 98765.4 mem 12345 MiB\n"
    block = b"".join(line % (1.7e9 + i) for i in range(12_000))   # about 1 MB
    needle = b"%.3f e NaN detected in layer 17, skipping batch\n"
    paths = []
    t0 = time.perf_counter()
    for r in range(ranks):
        p = folder / f"{procs.name}.rank{r}.log"
        paths.append(p)
        with open(p, "ab") as f:
            written, k = 0, 0
            while written < per_rank:
                f.write(block)
                f.write(needle % (1.8e9 + k))
                written += len(block)
                k += 1
    total = sum(p.stat().st_size for p in paths)
    emit("logs_write_s", round(time.perf_counter() - t0, 2), "s", bytes=total)
    try:
        for pattern, label in (("NaN detected", "literal"), (r"layer \d+, skipping", "regex")):
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                ans = tel.logs(grep=pattern, tail=20)
                times.append(time.perf_counter() - t0)
            emit(f"logs_grep_{label}_s", round(statistics.median(times), 2), "s", gb=round(total / 2**30, 2),
                 matched=ans["matched"], runs=3, GBps=round(total / 2**30 / statistics.median(times), 2))
        t0 = time.perf_counter()
        tel.logs(tail=100)
        emit("logs_tail100_s", round(time.perf_counter() - t0, 2), "s", gb=round(total / 2**30, 2))
    finally:
        for p in paths:
            p.unlink(missing_ok=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--log-gb", type=float, default=1.0)
    p.add_argument("--skip-logs", action="store_true")
    a = p.parse_args()
    host = this_host()
    try:
        procs = host.spawn_procs(per_host={"gpus": a.n})
        overhead(procs, a.rounds, a.n)
        death_to_row(procs)
        if not a.skip_logs:
            logs_grep(procs, a.log_gb)
    finally:
        host.shutdown()


if __name__ == "__main__":
    main()
