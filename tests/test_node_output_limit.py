"""A proc's output limit over batches of lines (node/output_limit.py), on a clock of our own."""
from __future__ import annotations

import pytest

from monarch_kernel.node import output_limit
from monarch_kernel.node.output_limit import OutputLimit


class Clock:
    def __init__(self):
        self.t = 1000.0

    def monotonic(self) -> float:
        return self.t


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(output_limit, "time", c)
    return c


def test_a_batch_is_cut_where_the_tokens_end_and_the_rest_is_counted(clock):
    limit = OutputLimit(rate=50, burst=500)
    assert limit.admit(300, "cell 1") == 300
    assert limit.admit(300, "cell 1") == 200      # not all 300: no debt for the next cell
    assert limit.take_skipped() == 100


def test_a_flood_resumes_with_a_seconds_worth_of_lines_not_one_a_batch(clock):
    """Past its burst a flooding proc sends one message a second (50 lines), not one every
    20 ms batch with the one line it earned: 256 such procs sent their agent 12,800 messages
    a second and it fell silent for 27 s on 2 cores."""
    limit = OutputLimit(rate=50, burst=500)
    assert limit.admit(1000, "cell 1") == 500
    sent = []
    for _ in range(150):          # three seconds of 20 ms batches of 40 lines
        clock.t += 0.02
        n = limit.admit(40, "cell 1")
        if n:
            sent.append(n)
    assert len(sent) <= 6, sent   # a second's worth (a batch and the rest of one) a second
    assert sum(sent) >= 100, sent  # and the rate's lines still go


def test_the_next_call_prints_at_once_after_a_flood(clock):
    limit = OutputLimit(rate=50, burst=500)
    assert limit.admit(1000, "cell 1") == 500
    clock.t += 0.1                # 5 tokens back: not enough to resume the flood ...
    assert limit.admit(10, "cell 1") == 0
    assert limit.admit(1, "cell 2") == 1    # ... but the next cell's first lines go
    assert limit.admit(40, "cell 3") == 10  # (10 of them, even with no tokens left)


def test_a_rate_of_zero_turns_the_limit_off(clock):
    assert OutputLimit(rate=0, burst=0).admit(10**6, None) == 10**6
