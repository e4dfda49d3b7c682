"""What CurveZMQ costs on the reference workload over tcp (issue 9).

Runs bench_core.py's steady mode twice on one host, both over tcp (same-host ipc and shm
tensors off): once with the MAC only (MONARCH_KERNEL_CURVE=never), once with CURVE on every
link (always), alternating, and prints JSON lines with medians and the ratio.

  PYTHONPATH=../shared/bench python bench/bench_curve.py [--runs 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
METRICS = ("rt_one_p50_us", "pipelined_calls_per_s", "send64MiB_GBps", "recv64MiB_GBps")


def run(mode: str) -> dict:
    env = {**os.environ, "MONARCH_KERNEL_CURVE": mode, "MONARCH_KERNEL_SAME_HOST_IPC": "0",
           "MONARCH_KERNEL_SHM_TENSORS": "0"}
    out = subprocess.run([sys.executable, os.path.join(HERE, "bench_core.py"), "--mode", "steady", "--n", "4"],
                         capture_output=True, text=True, env=env, timeout=600).stdout
    got = {}
    for line in out.splitlines():
        if line.startswith("JSON "):
            rec = json.loads(line[5:])
            if rec["metric"] in METRICS:
                got[rec["metric"]] = rec["value"]
    return got


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=3)
    a = p.parse_args()
    res: dict[str, dict[str, list]] = {"never": {}, "always": {}}
    for _ in range(a.runs):
        for mode in ("never", "always"):
            for k, v in run(mode).items():
                res[mode].setdefault(k, []).append(v)
    for m in METRICS:
        mac = statistics.median(res["never"].get(m, [float("nan")]))
        cur = statistics.median(res["always"].get(m, [float("nan")]))
        print("JSON " + json.dumps({"system": "monarch-kernel", "metric": f"curve_{m}", "mac_only": mac,
                                    "curve": cur, "ratio": round(cur / mac, 2) if mac else None,
                                    "runs": a.runs, "link": "tcp loopback"}))


if __name__ == "__main__":
    main()
