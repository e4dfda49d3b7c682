"""A proc's main thread serves other actors of its proc while a sync endpoint waits, so
actors can call their neighbours synchronously; messages for an actor already busy on that
thread wait, in order, until it returns."""
from __future__ import annotations

import sys

import cloudpickle
import pytest

from monarch_kernel.actor import Actor, endpoint, this_host, this_proc

cloudpickle.register_pickle_by_value(sys.modules[__name__])   # the workers cannot import tests/


class Helper(Actor):
    def __init__(self):
        self.log: list[int] = []

    @endpoint
    def double(self, x: int) -> int:
        return 2 * x

    @endpoint
    def note(self, i: int) -> None:
        self.log.append(i)

    @endpoint
    def take_log(self) -> list[int]:
        out, self.log = self.log, []
        return out


class Boss(Actor):
    def __init__(self):
        self.helper = this_proc().spawn("helper_of_boss", Helper)   # beside us, on our proc

    @endpoint
    def ask(self, x: int) -> int:
        return self.helper.double.call_one(x).get(timeout=10)

    @endpoint
    def ask_while_self_is_called(self, me, n: int) -> list:
        """Messages to ourselves sent while we wait are kept for after we return."""
        for i in range(n):
            me.record.broadcast(i)
        return self.helper.double.call_one(n).get(timeout=10)

    @endpoint
    def record(self, i: int) -> None:
        self.helper.note.call_one(i).get(timeout=10)

    @endpoint
    def helper_log(self) -> list[int]:
        return self.helper.take_log.call_one().get(timeout=10)


@pytest.fixture(scope="module")
def boss():
    procs = this_host().spawn_procs(per_host={"gpus": 1}, name="nested")
    yield procs.spawn("boss", Boss)
    procs.stop()


def test_sync_endpoint_calls_a_helper_spawned_on_its_own_proc(boss):
    assert boss.ask.call_one(21).get(timeout=20) == 42


def test_calls_to_a_busy_actor_wait_and_keep_their_order(boss):
    assert boss.ask_while_self_is_called.call_one(boss, 20).get(timeout=20) == 40
    # the 20 self-calls ran after ask_while_self_is_called returned, in the order sent
    assert boss.helper_log.call_one().get(timeout=20) == list(range(20))
