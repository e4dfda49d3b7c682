"""A proc's work loop (node/proc.py ``_serve_linked``) waits on its fan link and its work
inbox with one poll(2) over the link's socket and the inbox's ZMQ_FD. That FD is
edge-triggered: once a nested wait inside an endpoint has read the inbox, work left in it
does not signal again, and the loop must read the inbox until empty on its own."""
from __future__ import annotations

import sys
import time

import cloudpickle

from monarch_kernel.actor import Actor, endpoint, this_host

cloudpickle.register_pickle_by_value(sys.modules[__name__])   # the workers cannot import tests/


class Napper(Actor):
    @endpoint
    def nap(self, s: float) -> str:
        time.sleep(s)
        return "rested"


class Waiter(Actor):
    @endpoint
    def wait_on(self, napper) -> str:
        return napper.nap.call_one(0.3).get(timeout=10)   # a nested wait: this proc serves its inbox


class Worker(Actor):
    @endpoint
    def slow(self, s: float) -> str:
        time.sleep(s)
        return "slow done"

    @endpoint
    def quick(self) -> str:
        return "quick done"


def test_a_call_that_reached_a_proc_during_a_nested_wait_runs_after_it(monkeypatch):
    monkeypatch.setenv("MONARCH_KERNEL_FANOUT_MIN", "1")   # a call to all goes through the agent
    procs = this_host().spawn_procs(per_host={"gpus": 3}, name="loop")
    try:
        napper = procs.slice(gpus=2).spawn("napper", Napper)
        here = procs.slice(gpus=slice(0, 2))
        waiter, worker = here.spawn("waiter", Waiter), here.spawn("worker", Worker)
        worker0 = worker.slice(gpus=0)
        assert worker0.quick.call_one().get(timeout=10) == "quick done"
        waiting = waiter.wait_on.call(napper)      # fanned (2 procs): it comes on their fan links
        time.sleep(0.1)                            # procs 0 and 1 wait on the napper, serving their inboxes
        slow = worker0.slow.call_one(0.8)          # runs inside proc 0's wait
        time.sleep(0.2)
        quick = worker0.quick.call_one()           # comes while slow runs: the wait ends first
        assert list(waiting.get(timeout=10).values()) == ["rested", "rested"]
        assert slow.get(timeout=10) == "slow done"
        t0 = time.monotonic()
        assert quick.get(timeout=5) == "quick done"
        assert time.monotonic() - t0 < 1.0, "the call waited in the work inbox after the nested wait ended"
    finally:
        procs.stop()
