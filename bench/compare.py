"""Run our core benchmark and the pyzmq+cloudpickle baseline alternately, in one run, and
print medians and ratios (JSON lines, then a markdown table for the README).

  python bench/compare.py [--runs 3] [--n 4]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PY = os.path.join(ROOT, ".venv", "bin", "python")

# metric -> (label, "lower"/"higher" is better)
METRICS = {
    "cold_start_torch_s": ("cold start, 4 procs with torch (s)", "lower"),
    "rt_one_p50_us": ("call_one p50 (us)", "lower"),
    "bcast_p50_us": ("call to all 4 p50 (us)", "lower"),
    "pipelined_calls_per_s": ("pipelined calls/s", "higher"),
    "send64MiB_GBps": ("64 MiB to actor (GB/s)", "higher"),
    "recv64MiB_GBps": ("64 MiB back (GB/s)", "higher"),
    "second_spawn_procs_s": ("second spawn_procs of 4 (s)", "lower"),
}


def run(cmd: list[str]) -> dict[str, float]:
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600).stdout
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
    p.add_argument("--n", type=int, default=4)
    a = p.parse_args()
    ours: dict[str, list] = {}
    base: dict[str, list] = {}
    for _ in range(a.runs):
        for mode in (["--mode", "cold", "--torch"], ["--mode", "steady"]):
            for store, cmd in ((ours, [PY, os.path.join(HERE, "bench_core.py")]),
                               (base, ["bash", os.path.join(HERE, "baseline.sh")])):
                for k, v in run(cmd + mode + ["--n", str(a.n)]).items():
                    store.setdefault(k, []).append(v)
    machine = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    rows = []
    for metric, (label, better) in METRICS.items():
        o = statistics.median(ours[metric]) if metric in ours else None
        b = statistics.median(base[metric]) if metric in base else None
        ratio = round(o / b, 2) if o is not None and b else None
        print("JSON " + json.dumps({"system": "monarch-kernel", "metric": metric, "value": o, "baseline": b,
                                    "ratio_to_baseline": ratio, "better": better, "runs": a.runs,
                                    "machine": machine}))
        rows.append((label, o, b, ratio))
    print(f"\n| figure ({machine}, medians of {a.runs} runs) | monarch-kernel | baseline | ratio |")
    print("|---|---|---|---|")
    for label, o, b, r in rows:
        print(f"| {label} | {o} | {b if b is not None else '-'} | {r if r is not None else '-'} |")


if __name__ == "__main__":
    sys.exit(main())
