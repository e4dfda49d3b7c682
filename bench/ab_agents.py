"""Two settings of a host agent, measured alternating in one run (a call to all N procs).

    .venv/bin/python bench/ab_agents.py MONARCH_KERNEL_FAN_LINK=0 MONARCH_KERNEL_FAN_LINK=1 \
        [--n 256] [--rounds 8] [--calls 60]

Why: on a shared or virtual machine the speed of the machine itself moves 1.5x within an
hour (issue 11's figures at 256 procs), so two runs one after the other compare the machine,
not the code. Here two local agents ("hosts"), each started with one of the two settings
(any ``VAR=VALUE`` pairs, comma-separated: the agent, its zygote and its procs see them),
each get N procs with the same no-op actor, and rounds of calls to all go to A then B, B then
A, ... in the same minutes. Prints JSON lines: per round and setting, the p50 of a call to
all and the CPU per call (from ``/proc``'s schedstat: the procs' median per proc, the agent's,
the total of controller, agent, zygote and procs); then each setting's medians over rounds.

For a code change rather than a variable: read the variable in the code under test (an
experiment switch in a scratch tree), run this there with PYTHONPATH set to that tree.
Below MONARCH_KERNEL_FANOUT_MIN procs (32) a call to all goes straight to the procs, not
through the agent.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from _home import private_dir

private_dir("MONARCH_KERNEL_HOME", "mk-bench-ab-")
os.environ.setdefault("MONARCH_KERNEL_HOST_TIMEOUT_S", "30")   # 2 x N procs starting on a small machine

import cloudpickle  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import scale_profile  # noqa: E402
from scale_profile import Noop, diff, roles, snapshot  # noqa: E402

cloudpickle.register_pickle_by_value(scale_profile)   # the procs do not have bench/ on their path

from monarch_kernel.core.bootstrap import attach_to_workers  # noqa: E402
from monarch_kernel.launch.local import start_local_agent  # noqa: E402


def emit(**kw) -> None:
    print(json.dumps(kw), flush=True)


def setting(text: str) -> dict:
    """``A=1,B=2`` -> {"A": "1", "B": "2"}; a clear error for anything else."""
    out = {}
    for part in text.split(","):
        name, eq, value = part.partition("=")
        if not eq or not name.strip():
            raise SystemExit(f"ab_agents: {part!r} is not VAR=VALUE (e.g. MONARCH_KERNEL_FAN_LINK=0)")
        out[name.strip()] = value
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("a", help="setting A: VAR=VALUE[,VAR=VALUE...]")
    ap.add_argument("b", help="setting B")
    ap.add_argument("--n", type=int, default=256, help="procs on each agent")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--calls", type=int, default=60, help="calls to all a round")
    a = ap.parse_args()
    settings = {"a": setting(a.a), "b": setting(a.b)}
    emit(what="ab_agents", n=a.n, a=a.a, b=a.b, load=os.getloadavg()[0], cores=os.cpu_count())
    key = os.urandom(32)
    started, meshes, pids_of = [], {}, {}
    try:
        for tag, env in settings.items():
            info, proc = start_local_agent(key, name=f"ab-{tag}", persistent=False, env=env)
            started.append(proc)
            hm = attach_to_workers([info["addr"]], key=key, name=f"ab-{tag}")
            procs = hm.spawn_procs(per_host={"gpus": a.n}, name=f"ab{tag}")
            actors = procs.spawn("noop", Noop)
            actors.noop.call().get(600)
            meshes[tag] = (hm, procs, actors)
            pids_of[tag] = roles([proc.pid])
        for tag in meshes:
            for _ in range(20):
                meshes[tag][2].noop.call().get()
        rows: dict[str, list[dict]] = {"a": [], "b": []}
        for rnd in range(a.rounds):
            for tag in ("a", "b") if rnd % 2 == 0 else ("b", "a"):
                actors = meshes[tag][2]
                for _ in range(5):
                    actors.noop.call().get()
                took = []
                before = snapshot(pids_of[tag])
                for _ in range(a.calls):
                    t0 = time.perf_counter()
                    actors.noop.call().get()
                    took.append(time.perf_counter() - t0)
                cpu = diff(before, snapshot(pids_of[tag]), a.calls)
                row = {"p50_ms": round(statistics.median(took) * 1e3, 2),
                       "proc_cpu_us": cpu["procs"]["cpu_us_per_proc_p50"], "agent_cpu_us": cpu["agent"]["cpu_us"],
                       "total_cpu_us": cpu["total_cpu_us"]}
                rows[tag].append(row)
                emit(what="round", round=rnd, setting=tag, **row)
        for tag, got in rows.items():
            emit(what="median", setting=tag, env=settings[tag], rounds=len(got), n=a.n,
                 **{k: round(statistics.median(r[k] for r in got), 2) for k in got[0]})
    finally:
        for hm, procs, _ in meshes.values():
            procs.stop()
            hm.shutdown()
        for proc in started:
            try:
                proc.wait(15)
            except Exception:
                proc.kill()
                proc.wait()


if __name__ == "__main__":
    main()
