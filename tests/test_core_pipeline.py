"""Pipelined calls (many ``call_one`` futures in flight, then ``get``): a proc groups the
replies of quick calls that were waiting in its inbox into one signed message, and a user
still gets every answer, in order with its output, and never behind a slow call."""
from __future__ import annotations

import sys
import time

import cloudpickle
import pytest

from monarch_kernel.actor import Actor, endpoint, this_host
from monarch_kernel.core.errors import ActorError
from monarch_kernel.core.runtime import runtime

cloudpickle.register_pickle_by_value(sys.modules[__name__])


class Pipe(Actor):
    @endpoint
    def echo(self, x):
        return x

    @endpoint
    def slow(self, seconds: float) -> str:
        time.sleep(seconds)
        return "slow"

    @endpoint
    def say(self, x: int) -> int:
        print(f"line {x}")
        return x

    @endpoint
    def fail_on(self, x: int, bad: int) -> int:
        if x == bad:
            raise ValueError(f"bad {x}")
        return x


@pytest.fixture(scope="module")
def pipe():
    pm = this_host().spawn_procs(per_host={"gpus": 1}, name="pipeline")
    yield pm.spawn("pipe", Pipe).slice(gpus=0)
    pm.stop()


def _spy(kind: str):
    """Wrap the controller's handler of ``kind``; returns (messages seen, restore)."""
    rt = runtime()
    seen: list = []
    orig = rt.handlers[kind]

    def spy(msg):
        seen.append(msg)
        orig(msg)

    rt.handlers[kind] = spy
    return seen, lambda: rt.handlers.__setitem__(kind, orig)


def test_a_pipeline_of_call_one_gets_every_answer_with_replies_grouped(pipe):
    pipe.echo.call_one(0).get(30)   # known quick from now on
    grouped, restore = _spy("rs")
    try:
        # Calls queue at the proc behind a slow one, so their replies are grouped after it.
        first = pipe.slow.call_one(0.3)
        futs = [pipe.echo.call_one(i) for i in range(2000)]
        assert first.get(30) == "slow"
        assert [f.get(30) for f in futs] == list(range(2000))
    finally:
        restore()
    assert grouped, "no grouped replies came back"
    assert max(len(m[2]) // 3 for m in grouped) > 1


def test_an_error_in_a_pipeline_fails_only_its_own_call(pipe):
    futs = [pipe.fail_on.call_one(i, 150) for i in range(300)]
    for i, f in enumerate(futs):
        if i == 150:
            with pytest.raises(ActorError, match="bad 150"):
                f.get(30)
        else:
            assert f.get(30) == i


def test_a_held_reply_does_not_wait_for_a_slow_call_after_it(pipe):
    pipe.echo.call_one(0).get(30)
    futs = [pipe.echo.call_one(i) for i in range(300)]
    slow = pipe.slow.call_one(4.0)   # never ran yet: not known to be quick
    t0 = time.monotonic()
    assert futs[-1].get(30) == 299
    assert time.monotonic() - t0 < 3.0, "the pipeline's last reply waited for the slow call"
    assert not slow.done()
    assert slow.get(30) == "slow"


def test_held_replies_do_not_wait_for_a_call_that_was_quick_last_time_and_is_slow_now(pipe):
    """The main thread holds quick calls' replies while the next, known-quick call runs; when
    that one turns slow, the flusher sends what is held within a few ms, not after it."""
    pipe.slow.call_one(0).get(30)   # known quick from now on
    for _ in range(5):
        futs = [pipe.echo.call_one(i) for i in range(300)]
        slow = pipe.slow.call_one(3.0)
        t0 = time.monotonic()
        assert [f.get(30) for f in futs] == list(range(300))
        waited = time.monotonic() - t0
        if not slow.done():
            break
    assert waited < 2.0, f"the pipeline's replies waited {waited:.1f} s for the slow call"
    assert not slow.done()
    assert slow.get(30) == "slow"


def test_output_of_a_pipelined_call_arrives_before_its_reply(pipe):
    rt = runtime()
    events: list = []
    orig = rt.output, rt.handlers["r"], rt.handlers["rs"]
    rt.output = lambda rank, stream, text: events.extend(("out", int(line.split()[1])) for line in text.splitlines())

    def one(msg):
        events.append(("reply", msg[4]))
        orig[1](msg)

    def grouped(msg):
        events.extend(("reply", v) for v in msg[2][2::3])
        orig[2](msg)

    rt.handlers["r"], rt.handlers["rs"] = one, grouped
    try:
        pipe.say.call_one(-1).get(30)
        futs = [pipe.say.call_one(i) for i in range(300)]
        assert [f.get(30) for f in futs] == list(range(300))
    finally:
        rt.output, rt.handlers["r"], rt.handlers["rs"] = orig
    for i in range(300):
        assert events.index(("out", i)) < events.index(("reply", i))
