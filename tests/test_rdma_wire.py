"""Large tensors in plain calls on one host travel as handles the receiver pulls
(monarch_kernel/rdma/wirepath.py): values arrive intact both ways, nothing stays pinned."""
from __future__ import annotations

import sys
import time

import cloudpickle
import pytest
import torch

from monarch_kernel.actor import Actor, endpoint, this_host
from monarch_kernel.core import wire
from monarch_kernel.core.runtime import is_local
from monarch_kernel.rdma import owner

cloudpickle.register_pickle_by_value(sys.modules[__name__])


class Echo(Actor):
    @endpoint
    def echo_plus_one(self, t: torch.Tensor) -> torch.Tensor:
        return t + 1

    @endpoint
    def pinned(self) -> int:
        r = owner.existing_registry()
        return len(r.entries) if r else 0


@pytest.fixture(scope="module")
def echo():
    pm = this_host().spawn_procs(per_host={"gpus": 2}, name="rdma-wire")
    yield pm.spawn("echo", Echo)
    pm.stop()


def _pins_settle(echo) -> tuple:
    deadline = time.monotonic() + 5
    while True:
        mine = len(owner.existing_registry().entries) if owner.existing_registry() else 0
        theirs = echo.pinned.call().get().values()
        if (mine == 0 and not any(theirs)) or time.monotonic() > deadline:
            return mine, theirs
        time.sleep(0.1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int16])
def test_large_tensor_argument_and_result_on_one_host_arrive_intact_and_unpinned(echo, dtype):
    assert wire.LARGE_TENSOR_HOOK is not None
    t = torch.arange(3 << 20).reshape(1024, -1).to(dtype)   # above the 1 MiB threshold
    out = echo.echo_plus_one.call(t).get().values()          # fan-out: two receivers of one pin
    for o in out:
        assert o.shape == t.shape and o.dtype == dtype and torch.equal(o, t + 1)
        o += 1   # the received tensor is ours and writable
    assert _pins_settle(echo) == (0, [0, 0])


def test_non_contiguous_and_small_tensors_still_work(echo):
    t = torch.randn(2048, 1024).t()
    assert torch.equal(echo.slice(gpus=0).echo_plus_one.call_one(t).get(), t + 1)
    s = torch.ones(10)
    assert torch.equal(echo.slice(gpus=0).echo_plus_one.call_one(s).get(), s + 1)


def test_only_same_host_addresses_take_the_handle_path():
    assert is_local("tcp://127.0.0.1:5555") and is_local("ipc:///tmp/x")
    assert not is_local("tcp://10.254.253.252:5555")


def test_received_memory_is_reused_only_after_every_view_of_it_is_freed(echo):
    """Receive buffers are recycled (their pages are already faulted in): a tensor still
    alive, or a view of it, keeps its bytes while later tensors of the same size arrive."""
    one = echo.slice(gpus=0)
    n = 2 << 20                                    # 8 MiB of float32, above the threshold
    kept = one.echo_plus_one.call_one(torch.zeros(n)).get()
    view = one.echo_plus_one.call_one(torch.full((n,), 10.0)).get()[5:9]
    for i in range(4):                             # same size: would reuse a freed buffer
        got = one.echo_plus_one.call_one(torch.full((n,), float(100 + i))).get()
        assert torch.equal(got, torch.full((n,), float(101 + i)))
        del got                                    # freed: its memory may serve the next one
    assert torch.equal(kept, torch.ones(n))
    assert torch.equal(view, torch.full((4,), 11.0))
