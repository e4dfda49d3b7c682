"""A controller process for the persistence tests (tests/test_core_persistence.py).

  persist_controller.py start NAME LEASE exit|detach   start a named mesh with state, then leave
  persist_controller.py attach NAME                    attach, report and bump the state, detach
  persist_controller.py private                        a private mesh; then wait to be killed

Each prints one line ``RESULT <json>`` (agent pid, proc pids, actor state).
"""
import json
import os
import sys
import time

from monarch_kernel.actor import Actor, attach, endpoint, this_host


class Keeper(Actor):
    def __init__(self, start):
        self.total = start

    @endpoint
    def add(self, n):
        self.total += n
        return self.total

    @endpoint
    def state(self):
        return {"total": self.total, "pid": os.getpid()}


def report(hm, pm, keeper, **extra):
    print("RESULT " + json.dumps({"agent_pid": hm._agents[0]["pid"], "pids": [r.pid for r in pm.procs()],
                                  "state": keeper.state.call().get(30).values(), **extra}), flush=True)


def main():
    mode = sys.argv[1]
    if mode == "start":
        name, lease, how = sys.argv[2], float(sys.argv[3]), sys.argv[4]
        hm = this_host(name, lease=lease)
        pm = hm.spawn_procs(per_host={"gpus": 2})
        keeper = pm.spawn("keeper", Keeper, 100)
        keeper.add.call(5).get(30)
        report(hm, pm, keeper)
        if how == "detach":
            hm.detach()
    elif mode == "attach":
        hm = attach(sys.argv[2])
        pm = hm.proc_mesh("procs")
        keeper = pm.actor_mesh("keeper")
        before = keeper.state.call().get(30).values()
        keeper.add.call(1).get(30)
        report(hm, pm, keeper, before=before)
        hm.detach()
    elif mode == "private":
        hm = this_host()
        pm = hm.spawn_procs(per_host={"gpus": 2})
        keeper = pm.spawn("keeper", Keeper, 0)
        report(hm, pm, keeper)
        time.sleep(120)


if __name__ == "__main__":
    main()
