"""Soak: random calls, kills, freezes and respawns on a 4-proc mesh (issue 9).

For ``MONARCH_KERNEL_SOAK_S`` seconds (30 by default, a few minutes at most in CI) a seeded
random schedule calls the ranks, SIGKILLs a rank then respawns it, freezes a rank
(SIGSTOP/SIGCONT) and freezes the host agent itself past the host timeout (the host is
declared lost, then comes back). Every update a caller saw acknowledged must still be on
its rank at the end unless that rank was killed; updates whose calls failed (host lost
meanwhile) may or may not have landed. Ends with no leaked fd in the controller and no
extra process under the agent, and prints the counts.
"""
from __future__ import annotations

import os
import random
import signal
import sys
import time

import cloudpickle
import psutil

from monarch_kernel.actor import Actor, ActorError, SupervisionError, endpoint, this_host
from monarch_kernel.core.errors import MeshGoneError

cloudpickle.register_pickle_by_value(sys.modules[__name__])

SOAK_S = float(os.environ.get("MONARCH_KERNEL_SOAK_S", "30"))


class Ledger(Actor):
    def __init__(self):
        self.seen: set[int] = set()

    @endpoint
    def add(self, seq: int) -> int:
        self.seen.add(seq)
        return len(self.seen)

    @endpoint
    def ledger(self) -> list:
        return sorted(self.seen)

    @endpoint
    def pid(self) -> int:
        return os.getpid()


def test_soak_random_calls_kills_freezes_and_respawns_lose_no_acknowledged_state():
    rng = random.Random(int(os.environ.get("MONARCH_KERNEL_SOAK_SEED", "9")))
    hm = this_host("soak-test", lease=120)
    counts = {"calls_ok": 0, "calls_failed": 0, "kills": 0, "respawns": 0, "proc_freezes": 0,
              "agent_freezes": 0, "hosts_back": 0}
    try:
        pm = hm.spawn_procs(per_host={"gpus": 4}, name="soak")
        led = pm.spawn("ledger", Ledger)
        led.pid.call().get(30)
        agent = psutil.Process(hm._agents[0]["pid"])
        me = psutil.Process()
        # Warm-up: the first respawn makes a second thread's sockets to the live procs (once).
        os.kill(pm.procs()[0].pid, signal.SIGKILL)
        _wait(lambda: 0 in pm.dead_ranks(), 5)
        pm.respawn()
        led.pid.call().get(30)
        time.sleep(0.5)
        fds0 = me.num_fds()
        acked: dict[int, set] = {r: set() for r in range(4)}
        maybe: dict[int, set] = {r: set() for r in range(4)}
        seq = 0
        end = time.monotonic() + SOAK_S
        while time.monotonic() < end:
            action = rng.choices(["call", "kill", "freeze_proc", "freeze_agent"], [92, 4, 3, 1])[0]
            if action == "call":
                ranks = sorted(rng.sample(range(4), rng.randint(1, 4)))
                seq += 1
                for r in ranks:
                    maybe[r].add(seq)
                try:
                    view = led if len(ranks) == 4 else led.slice(gpus=slice(ranks[0], ranks[-1] + 1))
                    got = view.add.call(seq).get(30)
                    for r in range(ranks[0], ranks[-1] + 1):
                        acked[r].add(seq)
                        maybe[r].discard(seq)
                    counts["calls_ok"] += 1
                    assert len(got) == ranks[-1] - ranks[0] + 1
                except (SupervisionError, ActorError, MeshGoneError):
                    counts["calls_failed"] += 1
                    for r in range(ranks[0], ranks[-1] + 1):
                        maybe[r].add(seq)
                    _recover(pm, counts)
            elif action == "kill":
                r = rng.randrange(4)
                os.kill(pm.procs()[r].pid, signal.SIGKILL)
                counts["kills"] += 1
                _wait(lambda r=r: r in pm.dead_ranks(), 5)
                pm.respawn()
                counts["respawns"] += 1
                acked[r], maybe[r] = set(), set()          # a new proc: its state starts empty
            elif action == "freeze_proc":
                r = rng.randrange(4)
                pid = pm.procs()[r].pid
                os.kill(pid, signal.SIGSTOP)
                pending = led.add.call(seq := seq + 1)
                for x in range(4):
                    maybe[x].add(seq)
                time.sleep(rng.uniform(0.2, 1.5))
                os.kill(pid, signal.SIGCONT)
                pending.get(30)                            # a frozen rank is slow, not dead
                for x in range(4):
                    acked[x].add(seq)
                    maybe[x].discard(seq)
                counts["proc_freezes"] += 1
            else:
                agent.suspend()
                until = time.monotonic() + rng.uniform(3.5, 4.5)   # past the 3 s host timeout
                while time.monotonic() < until:           # calls go on: procs answer, then fail fast
                    seq += 1
                    for r in range(4):
                        maybe[r].add(seq)
                    try:
                        led.add.call(seq).get(2)
                        for r in range(4):
                            acked[r].add(seq)
                            maybe[r].discard(seq)
                        counts["calls_ok"] += 1
                    except (SupervisionError, TimeoutError):
                        counts["calls_failed"] += 1
                    time.sleep(0.2)
                agent.resume()
                counts["agent_freezes"] += 1
                _recover(pm, counts)
        ledgers = led.ledger.call().get(30).values()
        for r in range(4):
            lost = acked[r] - set(ledgers[r])
            assert not lost, f"rank {r} lost {len(lost)} acknowledged updates"
            assert set(ledgers[r]) <= acked[r] | maybe[r], f"rank {r} holds updates nobody sent"
        time.sleep(0.5)
        procs = [c for c in agent.children(recursive=True)]
        assert len(procs) == 5, f"agent has {len(procs)} processes under it, expected 4 procs + the zygote"
        fds = me.num_fds()
        assert fds - fds0 <= 4, f"the controller's fds grew from {fds0} to {fds}"
        print(f"\nSOAK {SOAK_S:.0f} s: " + ", ".join(f"{k} {v}" for k, v in counts.items())
              + f"; acknowledged updates kept {sum(len(a) for a in acked.values())}; controller fds {fds0} -> "
              f"{fds}; processes under the agent {len(procs)}")
    finally:
        hm.shutdown()


def _wait(cond, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def _recover(pm, counts) -> None:
    """After a failure: wait for a lost host to come back; respawn ranks that really died."""
    from monarch_kernel.core.runtime import runtime

    before = len(runtime().outages)
    _wait(lambda: not pm.dead_ranks() or len(runtime().outages) > before, 10)
    if len(runtime().outages) > before:
        counts["hosts_back"] += 1
    _wait(lambda: not pm.dead_ranks(), 3)
    if pm.dead_ranks():
        pm.respawn()
        counts["respawns"] += 1
