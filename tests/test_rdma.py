"""RDMABuffer across real procs: round trips on each backend, sizes and dtypes, drop,
concurrent readers, timeouts, owner death, status and reprs. The ibverbs tests run on a
fake verbs layer (no RDMA device here) and say so in their names."""
from __future__ import annotations

import os
import signal
import sys
import threading
import time

import cloudpickle
import pytest
import torch

from monarch_kernel.actor import Actor, ActorError, current_rank, endpoint, this_host
from monarch_kernel.rdma import RDMABuffer, RDMAError, get_rdma_backend

cloudpickle.register_pickle_by_value(sys.modules[__name__])
ENV = "MONARCH_KERNEL_RDMA_BACKEND"
ActorErrorLike = ActorError   # an RDMAError raised on a proc reaches us inside an ActorError


def pattern(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (numel,), generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(numel, generator=g).to(dtype)
    return torch.randint(-100, 100, (numel,), generator=g).to(dtype)


class Node(Actor):
    """Owns tensors and buffers; reads and writes other nodes' buffers."""

    def __init__(self):
        self.tensors: dict = {}
        self.bufs: dict = {}

    @endpoint
    def own(self, name: str, numel: int, dtype: torch.dtype, seed: int) -> RDMABuffer:
        self.tensors[name] = pattern(numel, dtype, seed)
        self.bufs[name] = RDMABuffer(self.tensors[name])
        return self.bufs[name]

    @endpoint
    def tensor(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    @endpoint
    def drop(self, name: str) -> None:
        self.bufs[name].drop()

    @endpoint
    def read(self, buf: RDMABuffer, numel: int, dtype: torch.dtype, backend: str = "auto",
             timeout: float = 60.0) -> tuple:
        os.environ[ENV] = backend
        try:
            used = buf.backend
            dst = torch.empty(numel, dtype=dtype)
            n = buf.read_into(dst, timeout=timeout).get()
            return dst, n, used
        finally:
            os.environ.pop(ENV, None)

    @endpoint
    def write(self, buf: RDMABuffer, src: torch.Tensor, backend: str = "auto") -> str:
        os.environ[ENV] = backend
        try:
            used = buf.backend
            buf.write_from(src).get()
            return used
        finally:
            os.environ.pop(ENV, None)

    @endpoint
    def read_until_error(self, buf: RDMABuffer, backend: str) -> tuple:
        """Reads again and again; returns (successful reads, the error that stopped it)."""
        os.environ[ENV] = backend
        dst = torch.empty(buf.size(), dtype=torch.uint8)
        ok = 0
        t_end = time.monotonic() + 20
        try:
            while time.monotonic() < t_end:
                try:
                    buf.read_into(dst, timeout=10).get()
                    ok += 1
                except RDMAError as e:
                    return ok, str(e)
            return ok, "no error"
        finally:
            os.environ.pop(ENV, None)

    @endpoint
    def gib_round_trip(self, buf: RDMABuffer) -> list:
        """Read 1 GiB, check it, add one to every byte, write it back."""
        os.environ[ENV] = "shm"
        try:
            dst = torch.empty(buf.size(), dtype=torch.uint8)
            buf.read_into(dst).get()
            out = [int(dst[123_456_789]), int(dst[-1]), int(dst[0]), buf.backend]
            dst += 1
            buf.write_from(dst).get()
            return out
        finally:
            os.environ.pop(ENV, None)

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def use_fake_verbs(self, fabric: str) -> str:
        """Swap in the fake verbs layer (this machine has no RDMA device)."""
        from monarch_kernel.rdma import ibverbs

        if fabric:
            os.environ["MONARCH_KERNEL_FAKE_VERBS_DIR"] = fabric
            os.environ[ibverbs.ENV] = "monarch_kernel.rdma.fake_verbs:FakeVerbs"
        else:
            os.environ.pop(ibverbs.ENV, None)
        ibverbs._layer_pid = 0
        return ibverbs.available()[1]

    @endpoint
    def rank(self) -> int:
        return current_rank().rank


@pytest.fixture(scope="module")
def procs():
    pm = this_host().spawn_procs(per_host={"gpus": 3}, name="rdma")
    yield pm
    pm.stop()


@pytest.fixture(scope="module")
def nodes(procs):
    return procs.spawn("nodes", Node)


def one(nodes, r):
    return nodes.slice(gpus=r)


# ---------------------------------------------------------------- round trips
@pytest.mark.parametrize("backend", ["shm", "tcp"])
@pytest.mark.parametrize("numel,dtype", [(1, torch.uint8),
                                         (4097, torch.float32), (3 * 2**20 + 7, torch.bfloat16),
                                         (1000, torch.int64), (777, torch.bool), (12345, torch.float64)])
def test_read_and_write_round_trip_between_procs(nodes, backend, numel, dtype):
    seed = numel % 97
    buf = one(nodes, 0).own.call_one(f"rt{numel}", numel, dtype, seed).get()
    assert buf.size() == numel * torch.empty(0, dtype=dtype).element_size()
    got, n, used = one(nodes, 1).read.call_one(buf, numel, dtype, backend).get()
    assert used == backend and n == buf.size()
    assert torch.equal(got, pattern(numel, dtype, seed))
    new = pattern(numel, dtype, seed + 1)
    assert one(nodes, 2).write.call_one(buf, new, backend).get() == backend
    assert torch.equal(one(nodes, 0).tensor.call_one(f"rt{numel}").get(), new)


def test_controller_reads_and_writes_a_proc_buffer_and_procs_read_a_controller_buffer(nodes):
    buf = one(nodes, 0).own.call_one("ctl", 5000, torch.float32, 3).get()
    dst = torch.zeros(5000)
    assert buf.read_into(dst).get() == 20000 and torch.equal(dst, pattern(5000, torch.float32, 3))
    buf.write_from(torch.ones(5000)).get()
    assert torch.equal(one(nodes, 0).tensor.call_one("ctl").get(), torch.ones(5000))
    mine = torch.arange(100, dtype=torch.int32)
    cbuf = RDMABuffer(memoryview(mine.numpy()))
    got, _, used = one(nodes, 1).read.call_one(cbuf, 100, torch.int32).get()
    assert used == "shm" and torch.equal(got, mine)
    cbuf.drop()


def test_one_gib_buffer_read_and_written_by_a_proc_over_shm(nodes):
    big = torch.full((1 << 30,), 7, dtype=torch.uint8)
    big[123_456_789], big[-1] = 1, 3
    gbuf = RDMABuffer(big)
    try:
        assert one(nodes, 1).gib_round_trip.call_one(gbuf).get() == [1, 3, 7, "shm"]
        assert big[0] == 8 and big[123_456_789] == 2 and big[-1] == 4
    finally:
        gbuf.drop()


def test_buffers_show_in_proc_states_and_leave_them_when_dropped(procs, nodes):
    one(nodes, 2).own.call_one("listed", 256, torch.float16, 1).get()
    st = procs.states().values()[2]
    assert {"size": 512, "dtype": "float16", "device": "cpu", "backend": "shm"} in st["buffers"]
    one(nodes, 2).drop.call_one("listed").get()
    left = procs.states().values()[2]["buffers"]
    assert not any(b["size"] == 512 and b["dtype"] == "float16" for b in left)


def test_repr_and_html_show_owner_size_dtype_device_backend(nodes):
    buf = one(nodes, 1).own.call_one("repr", 1024, torch.float32, 0).get()
    text, page = repr(buf), buf._repr_html_()
    for needle in ("rank 1", "4.0 KiB", "float32", "cpu", "shm"):
        assert needle in text and needle in page
    assert buf.owner.rank == 1 and buf.owner.pid == one(nodes, 1).pid.call_one().get()


# ---------------------------------------------------------------- errors
def test_bad_registrations_and_size_mismatches_are_clear_errors(nodes):
    with pytest.raises(ValueError, match="empty"):
        RDMABuffer(torch.empty(0))
    with pytest.raises(ValueError, match="not contiguous"):
        RDMABuffer(torch.ones(4, 4).t())
    with pytest.raises(TypeError, match="torch.Tensor or a buffer"):
        RDMABuffer("abc")
    buf = one(nodes, 0).own.call_one("mm", 10, torch.float32, 0).get()
    with pytest.raises(ValueError, match="size mismatch: the destination has 36 bytes, the buffer 40"):
        buf.read_into(torch.empty(9))
    with pytest.raises(ValueError, match="size mismatch: the source has 44 bytes"):
        buf.write_from(torch.empty(11))
    with pytest.raises(ValueError, match="read-only"):
        buf.read_into(bytes(40))
    ro = RDMABuffer(memoryview(b"x" * 40))
    with pytest.raises(ActorErrorLike, match="read-only"):
        one(nodes, 1).write.call_one(ro, torch.zeros(10), "tcp").get()
    ro.drop()
    os.environ[ENV] = "carrier-pigeon"
    try:
        with pytest.raises(RDMAError, match="not a backend"):
            buf.read_into(torch.empty(10)).get()
    finally:
        del os.environ[ENV]


@pytest.mark.parametrize("backend", ["shm", "tcp"])
def test_drop_then_use_fails_for_every_holder(nodes, backend):
    buf = one(nodes, 0).own.call_one(f"drop-{backend}", 1000, torch.float32, 0).get()
    one(nodes, 0).drop.call_one(f"drop-{backend}").get()
    with pytest.raises(ActorErrorLike, match="dropped by its owner .rank 0"):
        one(nodes, 1).read.call_one(buf, 1000, torch.float32, backend).get()
    os.environ[ENV] = backend
    try:
        with pytest.raises(RDMAError, match="dropped by its owner"):
            buf.read_into(torch.empty(1000)).get()
    finally:
        del os.environ[ENV]


def test_a_holder_can_drop_and_then_its_handle_refuses(nodes, procs):
    buf = one(nodes, 0).own.call_one("holder-drop", 64, torch.uint8, 0).get()
    buf.drop()
    with pytest.raises(RDMAError, match="was dropped"):
        buf.read_into(torch.empty(64, dtype=torch.uint8))
    with pytest.raises(ActorErrorLike, match="dropped by its owner"):
        one(nodes, 1).read.call_one(buf, 64, torch.uint8).get()


@pytest.mark.parametrize("backend", ["shm", "tcp"])
def test_timeouts_fail_the_transfer_and_the_buffer_stays_usable(nodes, backend):
    numel = 64 << 20
    buf = one(nodes, 0).own.call_one(f"slow-{backend}", numel, torch.uint8, 0).get()
    with pytest.raises(ActorErrorLike, match="did not finish within 1e-06 s"):
        one(nodes, 1).read.call_one(buf, numel, torch.uint8, backend, 1e-6).get()
    got, _, _ = one(nodes, 1).read.call_one(buf, numel, torch.uint8, backend).get()
    assert torch.equal(got, pattern(numel, torch.uint8, 0))
    one(nodes, 0).drop.call_one(f"slow-{backend}").get()


def test_concurrent_readers_on_procs_and_controller_all_get_the_bytes(nodes):
    numel = 4 << 20
    buf = one(nodes, 0).own.call_one("conc", numel, torch.float32, 5).get()
    want = pattern(numel, torch.float32, 5)
    futs = [one(nodes, 1).read.call_one(buf, numel, torch.float32, "shm"),
            one(nodes, 2).read.call_one(buf, numel, torch.float32, "tcp")]
    mine = [torch.empty(numel) for _ in range(4)]
    local = [buf.read_into(d) for d in mine]
    for f in local:
        f.get()
    for d in mine:
        assert torch.equal(d, want)
    for f in futs:
        assert torch.equal(f.get()[0], want)


@pytest.mark.parametrize("backend", ["shm", "tcp"])
def test_owner_death_during_transfers_fails_with_the_owners_rank(backend):
    pm = this_host().spawn_procs(per_host={"gpus": 2}, name=f"rdma-death-{backend}")
    try:
        ns = pm.spawn("nodes", Node)
        buf = ns.slice(gpus=0).own.call_one("big", 64 << 20, torch.uint8, 0).get()
        pid = ns.slice(gpus=0).pid.call_one().get()
        loop = ns.slice(gpus=1).read_until_error.call_one(buf, backend)
        threading.Timer(0.5, os.kill, (pid, signal.SIGKILL)).start()
        ok, msg = loop.get(30)
        assert ok >= 1 and "rank 0" in msg and "died" in msg, msg
        with pytest.raises(RDMAError, match="owner of this buffer .rank 0 .* died"):
            buf.read_into(torch.empty(64 << 20, dtype=torch.uint8)).get()
    finally:
        pm.stop()


# ---------------------------------------------------------------- backends
def test_get_rdma_backend_reports_shm_and_tcp_usable_and_ibverbs_absent_here():
    rep = get_rdma_backend()
    assert rep.default == "shm" and rep.usable["shm"][0] and rep.usable["tcp"][0]
    assert rep.usable["ibverbs"][0] is False and "no RDMA device" in rep.usable["ibverbs"][1]
    assert "shm" in repr(rep) and "<table>" in rep._repr_html_()


def test_forcing_shm_for_a_buffer_it_cannot_reach_is_a_clear_error(nodes):
    buf = one(nodes, 0).own.call_one("force", 8, torch.uint8, 0).get()
    fake = buf.__reduce__()
    args = list(fake[1])
    args[0] = args[0]._replace(host_id="another-host/1")
    remote = fake[0](*args)
    os.environ[ENV] = "shm"
    try:
        with pytest.raises(RDMAError, match="owner is on another host"):
            remote.read_into(torch.empty(8, dtype=torch.uint8)).get()
    finally:
        del os.environ[ENV]
    assert remote.backend == "tcp"
    got = torch.empty(8, dtype=torch.uint8)
    remote.read_into(got).get()   # a buffer on "another host" still reads, over tcp
    assert torch.equal(got, pattern(8, torch.uint8, 0))


def test_ibverbs_path_on_a_fake_verbs_layer_reads_writes_and_sees_drops(nodes, tmp_path):
    for r in (0, 1):
        assert "fake_mlx5_0" in one(nodes, r).use_fake_verbs.call_one(str(tmp_path)).get()
    buf = one(nodes, 0).own.call_one("verbs", 3000, torch.float32, 9).get()
    assert buf._verbs is not None and list(tmp_path.glob("mr-*.json"))
    got, _, used = one(nodes, 1).read.call_one(buf, 3000, torch.float32).get()
    assert used == "ibverbs" and torch.equal(got, pattern(3000, torch.float32, 9))
    assert one(nodes, 1).write.call_one(buf, torch.ones(3000)).get() == "ibverbs"
    assert torch.equal(one(nodes, 0).tensor.call_one("verbs").get(), torch.ones(3000))
    one(nodes, 0).drop.call_one("verbs").get()
    assert not list(tmp_path.glob("mr-*.json"))
    with pytest.raises(ActorErrorLike, match="dropped by its owner"):
        one(nodes, 1).read.call_one(buf, 3000, torch.float32).get()
    for r in (0, 1):
        one(nodes, r).use_fake_verbs.call_one("").get()


def test_buffers_still_serve_over_tcp_after_the_runtimes_address_vanished(monkeypatch):
    """A job's interface torn down after kill() left the controller's runtime on an address
    no longer on this machine; registering a buffer then failed with EADDRNOTAVAIL."""
    from monarch_kernel.core.runtime import runtime
    from monarch_kernel.rdma import tcp

    monkeypatch.setattr(runtime(), "bind_host", "192.0.2.1")   # TEST-NET-1: never assigned here
    server = tcp.DataServer(registry=None)
    try:
        assert server.address.startswith("127.0.0.1:")
    finally:
        server.sock.close()
