"""The host agent keeps answering while its zygote falls behind: a spawn of many procs
queues more fork commands than the zygote's stdin pipe holds (64 KB, ~0.6 KB a command); an
agent blocked writing them answered no heartbeat, and the controller declared the host lost
(found spawning 256 procs from a kernel on 2 loaded cores)."""
from __future__ import annotations

import os
import signal
import threading
import time

import psutil

from monarch_kernel.actor import this_host

N = 200


def test_the_agent_answers_while_a_spawn_of_200_procs_waits_on_a_stopped_zygote(monkeypatch):
    monkeypatch.setenv("MONARCH_KERNEL_MAX_PROCS", str(N))     # read by the agent started here
    monkeypatch.setenv("MONARCH_KERNEL_PROC_MEM_MB", "20")     # forked procs share most pages
    hm = this_host("agent-under-load")
    try:
        _check(hm)
    finally:
        hm.shutdown()


def _check(hm):
    agent = psutil.Process(hm._agents[0]["pid"])
    zygote = next(c for c in agent.children() if "zygote" in " ".join(c.cmdline()))
    os.kill(zygote.pid, signal.SIGSTOP)
    try:
        box = {}
        t = threading.Thread(target=lambda: box.setdefault("pm", hm.spawn_procs(per_host={"gpus": N},
                                                                             name="queued")), daemon=True)
        t.start()
        # The agent takes the spawn and queues 200 fork commands (116 KB) for a zygote that
        # reads none: it must go on answering, and show the procs as starting.
        deadline = time.monotonic() + 30
        while True:
            t0 = time.monotonic()
            rows = hm.status()   # an agent request: answered only by a loop that is not stuck
            assert time.monotonic() - t0 < 3.0
            if sum(r["state"] == "starting" for r in rows) == N:
                break
            assert time.monotonic() < deadline, rows[:3]
            time.sleep(0.2)
    finally:
        os.kill(zygote.pid, signal.SIGCONT)
    t.join(180)
    assert not t.is_alive() and len(box["pm"]) == N
