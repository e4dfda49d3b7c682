"""A small program written the way Monarch's docs write them, through
``import monarch_kernel.actor as monarch_actor`` (only the import differs from Monarch).
Used by tests/test_monarch_compat.py; prints ALL DONE at the end."""
import asyncio

import monarch_kernel.actor as monarch_actor
from monarch_kernel.actor import Actor, Channel, MeshFailure, Port, endpoint, send, this_host, this_proc

failures: list = []


def my_unhandled_fault_hook(failure: MeshFailure) -> None:
    failures.append(failure)


monarch_actor.unhandled_fault_hook = my_unhandled_fault_hook


class Counter(Actor):
    def __init__(self, initial_value: int):
        self.value = initial_value

    @endpoint
    def increment(self) -> None:
        self.value += 1

    @endpoint
    def get_value(self) -> int:
        return self.value


class Doubler(Actor):
    @endpoint(explicit_response_port=True)
    def double(self, port: Port[int], x: int) -> None:
        port.send(2 * x)

    @endpoint
    def crash(self) -> None:
        raise RuntimeError("crash under broadcast")


class Pinger(Actor):
    def __init__(self, peers):
        self.peers = peers

    @endpoint
    async def ping(self) -> str:
        me = monarch_actor.current_rank().rank
        other = self.peers.slice(gpus=1 - me)
        return await other.pong.call_one(me)

    @endpoint
    async def pong(self, who: int) -> str:
        return f"pong from {monarch_actor.current_rank().rank} to {who}"


async def main_async(pingers) -> list:
    return [await f for f in pingers.ping.stream()]


def main() -> None:
    counter = this_proc().spawn("counter", Counter, initial_value=0)
    counter.increment.call_one().get()
    assert counter.get_value.call_one().get() == 1

    procs = this_host().spawn_procs(per_host={"gpus": 2})
    counters = procs.spawn("counters", Counter, 0)
    counters.increment.broadcast()
    counters.slice(gpus=slice(0, 1)).increment.broadcast()
    assert counters.get_value.call().get().values() == [2, 1]

    doublers = procs.spawn("doublers", Doubler)
    assert doublers.double.call(21).get().values() == [42, 42]
    port, recv = Channel.open()
    send(doublers.double, (5,), {}, port=port)
    assert sorted([recv.recv().get(), recv.recv().get()]) == [10, 10]

    pingers = procs.spawn("pingers", Pinger, None)
    pingers.stop().get()
    pingers = procs.spawn("pingers", Pinger, procs.spawn("peers", Pinger, None))
    assert sorted(asyncio.run(main_async(pingers))) == ["pong from 0 to 1", "pong from 1 to 0"]

    doublers.crash.broadcast()
    for _ in range(200):
        if len(failures) == 2:
            break
        asyncio.run(asyncio.sleep(0.05))
    assert len(failures) == 2 and all("crash under broadcast" in str(f) for f in failures), failures

    procs.logging_option(stream_to_client=True, aggregate_window_sec=3).get()
    counters.stop().get()
    procs.stop().get()
    print("ALL DONE")


if __name__ == "__main__":
    main()
