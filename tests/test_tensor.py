"""Distributed tensors driven from the controller, against a real 4-proc mesh with a real
gloo process group: results equal the local computation, data comes back by shard or
whole, errors name the op and the ranks, and the mesh stays usable after each."""
from __future__ import annotations

import sys

import cloudpickle
import pytest
import torch

from monarch_kernel.actor import Actor, endpoint, this_host
from monarch_kernel.tensor import DistributedTensor, Replicate, Shard, TensorOpError, fetch_shard, inspect

cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def procs():
    pm = this_host().spawn_procs(per_host={"gpus": 4}, name="tensor-tests")
    pm.init_process_group(timeout=20)
    yield pm
    pm.stop()


def _x():
    return torch.arange(32, dtype=torch.float32).reshape(8, 4)


def test_matmul_of_a_sharded_tensor_equals_the_local_result(procs):
    x = _x()
    dt = procs.distribute(x, placements=[Shard(0)])
    assert isinstance(dt, DistributedTensor)
    assert dt.shape == (8, 4) and dt.dtype == torch.float32 and dt.device.type == "cpu"
    y = dt @ dt.T
    assert y.shape == (8, 8)
    assert torch.equal(y.full_tensor(), x @ x.T)
    assert torch.equal(inspect(dt), x)


def test_each_rank_holds_its_slice_and_fetch_shard_brings_one_back(procs):
    x = _x()
    dt = procs.distribute(x, placements=[Shard(0)])
    for r in range(4):
        assert torch.equal(fetch_shard(dt, gpus=r).get(), x[2 * r:2 * r + 2])
    assert torch.equal(inspect(dt, gpus=3), x[6:8])
    assert dt.placements == (Shard(0),)
    text = repr(dt)
    assert "shape=(8, 4)" in text and "placements=[Shard(0)]" in text and "rank 3: [6:8, :]" in text
    html = dt._repr_html_()
    assert "rank 2" in html and "[4:6, :]" in html and "<table" in html


def test_elementwise_inplace_reductions_torch_functions_and_to(procs):
    x = _x()
    dt = procs.distribute(x, placements=[Shard(0)])
    z = torch.relu(dt * 2 - 20)
    assert torch.equal(z.full_tensor(), torch.relu(x * 2 - 20))
    s = dt.sum()
    assert s.full_tensor().item() == x.sum().item()
    assert s.item() == x.sum().item()
    m = dt.mean(dim=0)
    assert torch.allclose(m.full_tensor(), x.mean(dim=0))
    dt.add_(1)
    dt += 1
    assert torch.equal(dt.full_tensor(), x + 2)
    d64 = dt.to(torch.float64)
    assert d64.dtype == torch.float64 and d64.full_tensor().dtype == torch.float64
    rep = procs.distribute(x, placements=[Replicate()])
    assert torch.equal((rep + dt).full_tensor(), x + x + 2)


def test_tensor_made_on_the_ranks_is_rank_zeros_values_laid_out(procs):
    r = procs.tensor(lambda: torch.randn(8, 8), placements=[Shard(1)])
    assert r.shape == (8, 8) and r.placements == (Shard(1),)
    full = r.full_tensor()
    shards = r.local_shards()
    assert torch.equal(torch.cat(shards, dim=1), full)


def test_an_op_error_surfaces_at_the_next_fetch_naming_the_op_and_ranks(procs):
    a = procs.distribute(torch.zeros(4, 4), placements=[Shard(0)])
    bad = torch.linalg.inv(a)        # passes the controller's shape check; singular on the ranks
    worse = bad + 1                  # queued behind it; fails the same way without running
    with pytest.raises(TensorOpError) as e:
        worse.full_tensor()
    msg = str(e.value)
    assert "`linalg_inv`" in msg and "test_tensor.py" in msg and "ranks 0-3" in msg
    assert "the mesh is still usable" in msg
    with pytest.raises(TensorOpError, match="linalg_inv"):
        bad.full_tensor()            # the failed handle keeps failing, with the same op named
    assert torch.equal((a + 3).full_tensor(), torch.full((4, 4), 3.0))


def test_bad_input_is_a_clear_error_and_the_mesh_stays_usable(procs):
    x = _x()
    with pytest.raises(ValueError, match="unknown mesh dims .'hosts'.*gpus=4"):
        procs.distribute(x, placements={"hosts": Shard(0)})
    with pytest.raises(ValueError, match="2 placements for a mesh of 1 dims"):
        procs.distribute(x, placements=[Shard(0), Shard(1)])
    with pytest.raises(ValueError, match=r"Shard\(2\).*2 dims"):
        procs.distribute(x, placements=[Shard(2)])
    with pytest.raises(TypeError, match="torch.Tensor"):
        procs.distribute([1, 2, 3])
    dt = procs.distribute(x, placements=[Shard(0)])
    with pytest.raises(RuntimeError, match="__matmul__.*nothing was sent"):
        dt @ torch.zeros(3, 3)
    with pytest.raises(ValueError, match="say which shard: give a coordinate for gpus"):
        fetch_shard(dt)
    with pytest.raises(IndexError, match="gpus=7 is out of range"):
        fetch_shard(dt, gpus=7)
    assert torch.equal((dt + 1).full_tensor(), x + 1)


class ShardReader(Actor):
    @endpoint
    def local(self, t) -> tuple:
        from monarch_kernel.actor import current_rank

        return current_rank().rank, type(t).__name__, t.tolist()


def test_a_handle_passed_to_an_actor_arrives_as_the_local_shard(procs):
    x = _x()
    dt = procs.distribute(x, placements=[Shard(0)])
    y = dt * 10   # queued, not yet sent: passing it flushes first
    readers = procs.spawn("readers", ShardReader)
    got = readers.local.call(y).get().values()
    for rank, kind, rows in got:
        assert kind == "Tensor" and rows == (x[2 * rank:2 * rank + 2] * 10).tolist()


def test_freed_handles_free_remote_memory_over_ten_thousand_ops(procs):
    h = procs.distribute(torch.ones(8, 4), placements=[Shard(0)])
    for _ in range(10_000):
        h = h + 1
    assert h.full_tensor()[0, 0].item() == 10_001
    counts = [s["tensors"] for s in h._engine.fetch(None, "stats", None)]
    assert max(counts) < 300, counts


def test_mixing_meshes_a_dead_rank_and_a_stopped_mesh_are_clear_errors(procs):
    import os
    import signal
    import time

    other = this_host().spawn_procs(per_host={"gpus": 2}, name="tensor-other")
    try:
        theirs = other.distribute(torch.ones(4), placements=[Shard(0)])
        ours = procs.distribute(torch.ones(4), placements=[Shard(0)])
        with pytest.raises(ValueError, match="different meshes .'tensor-tests' and 'tensor-other'"):
            ours + theirs
        os.kill(other.procs()[1].pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not other.dead_ranks() and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(TensorOpError, match="rank 1 of mesh 'tensor-other' died.*respawn"):
            theirs + 1
        other.respawn()   # a new group for the whole mesh; the old handles say they are gone
        with pytest.raises(TensorOpError, match="made before mesh 'tensor-other' formed a new process group"):
            theirs + 1
        again = other.distribute(torch.ones(4), placements=[Shard(0)])
        assert (again * 2).full_tensor().tolist() == [2.0] * 4
    finally:
        other.stop()
    with pytest.raises(Exception, match="'tensor-other' was stopped"):
        again + 1
    assert (ours + 1).full_tensor().tolist() == [2.0] * 4


class EnvReader(Actor):
    @endpoint
    def env(self) -> dict:
        import os

        return {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                                               "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME")}


def test_setup_torch_elastic_env_sets_torchruns_variables_on_every_proc(procs):
    from monarch_kernel.spmd import setup_torch_elastic_env

    setup_torch_elastic_env(procs, master_port=29123)
    envs = procs.spawn("env-reader", EnvReader).env.call().get().values()
    for rank, env in enumerate(envs):
        assert env == {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29123", "RANK": str(rank), "WORLD_SIZE": "4",
                       "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "0",
                       "ROLE_RANK": str(rank), "ROLE_NAME": "default"}
    with pytest.raises(ValueError, match="spans the whole proc mesh"):
        setup_torch_elastic_env(procs.slice(gpus=slice(0, 2)))


class Napper(Actor):
    @endpoint
    def nap(self, seconds: float) -> None:
        import time

        time.sleep(seconds)


def test_a_group_that_does_not_form_says_which_ranks_were_busy_and_where():
    """Rank 1 is busy when the group is formed: rank 0 waits for it at the rendezvous and
    fails naming a store key only. The error now says which ranks were still busy and at
    which Python line (what round 21's CI could not tell of a rank that never joined)."""
    import time

    pm = this_host().spawn_procs(per_host={"gpus": 2}, name="tensor-not-formed")
    try:
        naps = pm.spawn("napper", Napper)
        busy = naps.slice(gpus=1).nap.call(4.5)   # (outlasts rank 0's 3 s at the rendezvous)
        time.sleep(0.3)   # (rank 1 is in its nap)
        with pytest.raises(Exception) as err:
            pm.init_process_group(timeout=2)
        notes = "\n".join(getattr(err.value, "__notes__", []))
        assert "ranks still busy when the group failed to form: rank 1: in napper.nap, at " in notes, (err.value, notes)
        assert "test_tensor.py:" in notes and " nap" in notes, notes
        busy.get(30)
    finally:
        pm.stop()
