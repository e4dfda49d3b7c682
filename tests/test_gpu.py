"""The GPU paths on a real NVIDIA GPU: CUDA tensors through calls, RDMABuffer over CUDA
memory, an NCCL process group and a distributed tensor on CUDA, NVML telemetry per proc.

Every test skips where torch sees no CUDA device (CI has none); they were run on the GPU
machine lent to round 6 (README "GPU paths"). One GPU is enough: NCCL refuses two ranks on
one device, so the NCCL tests use one rank per visible GPU."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import cloudpickle
import pytest
import torch

from monarch_kernel.actor import Actor, current_rank, endpoint, this_host
from monarch_kernel.rdma import RDMABuffer

cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here (CI has no GPU)")
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


class OnGpu(Actor):
    """Keeps CUDA tensors and buffers over them."""

    def __init__(self):
        self.kept: dict = {}

    @endpoint
    def device_of(self, t: torch.Tensor) -> str:
        return str(t.device)

    @endpoint
    def double(self, t: torch.Tensor) -> torch.Tensor:
        return t * 2                              # stays on the GPU it came on

    @endpoint
    def make(self, name: str, numel: int) -> RDMABuffer:
        self.kept[name] = torch.arange(numel, dtype=torch.float32, device="cuda")
        return RDMABuffer(self.kept[name])

    @endpoint
    def read_back(self, buf: RDMABuffer, n: int) -> list:
        from monarch_kernel.rdma import cuda_ipc
        before, dst = cuda_ipc.copies, torch.empty(n, device="cuda")
        buf.read_into(dst).get()
        return [buf.backend if cuda_ipc.copies == before + 1 else "not over cuda_ipc", float(dst.sum())]

    @endpoint
    def tensor(self, name: str) -> torch.Tensor:
        return self.kept[name].cpu()

    @endpoint
    def hold_gpu_memory(self, mb: int) -> int:
        self.kept["ballast"] = torch.empty(mb << 20, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated() >> 20

    @endpoint
    def visible(self) -> tuple:
        import os
        return os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.device_count(), current_rank().rank


class Collective(Actor):
    @endpoint
    def all_reduce(self, n: int) -> list:
        import torch.distributed as dist
        t = torch.full((n,), float(dist.get_rank() + 1), device="cuda")
        dist.all_reduce(t)
        torch.cuda.synchronize()
        return [dist.get_backend(), str(t.device), float(t[0].item())]


@pytest.fixture(scope="module")
def procs():
    pm = this_host().spawn_procs(per_host={"gpus": 2}, name="gpu-tests")
    yield pm
    pm.stop()


def test_each_proc_sees_one_gpu_of_the_host(procs):
    a = procs.spawn("vis", OnGpu)
    got = sorted(a.visible.call().get().values(), key=lambda v: v[2])
    assert [g[1] for g in got] == [1, 1], got                       # one device each
    assert [g[0] for g in got] == [str(r % GPUS) for r in range(2)], got


def test_a_cuda_tensor_argument_arrives_on_the_gpu_and_a_cuda_result_comes_back(procs):
    a = procs.spawn("gpu", OnGpu)
    small = torch.arange(10, dtype=torch.float32, device="cuda")
    big = torch.randn(4 << 20, device="cuda")                          # 16 MiB
    for t in (small, big):
        assert a.slice(gpus=0).device_of.call_one(t).get() == "cuda:0"
        back = a.slice(gpus=1).double.call_one(t).get()
        assert back.device.type == "cuda" and torch.equal(back, t * 2)


class Ipc(Actor):
    @endpoint
    def copies(self) -> int:
        from monarch_kernel.rdma import cuda_ipc
        return cuda_ipc.copies

    @endpoint
    def check(self, ts: list) -> list:
        return [(str(t.device), float(t.sum())) for t in ts]

    @endpoint
    def make(self, n: int) -> torch.Tensor:
        return torch.full((n,), 3.0, device="cuda")


def test_large_cuda_tensors_between_procs_of_one_host_go_over_cuda_ipc(procs):
    """Several tensors from one allocation of the caching allocator in one call, both ways."""
    from monarch_kernel.rdma import cuda_ipc
    a = procs.spawn("ipc", Ipc).slice(gpus=1)
    ts = [torch.full((1 << 19,), float(i + 1), device="cuda") for i in range(3)]   # 2 MiB each
    before = a.copies.call_one().get()
    assert a.check.call_one(ts).get() == [("cuda:0", float((i + 1) << 19)) for i in range(3)]
    assert a.copies.call_one().get() == before + 3, "not over CUDA IPC"
    mine = cuda_ipc.copies
    back = a.make.call_one(1 << 22).get()                                         # 16 MiB back
    assert back.device.type == "cuda" and float(back.sum()) == 3.0 * (1 << 22)
    assert cuda_ipc.copies == mine + 1, "the result did not come over CUDA IPC"


@pytest.mark.parametrize("same_host_handle", [False, True], ids=["pinned-copy", "ipc-handle"])
def test_a_cuda_tensor_reaches_a_process_without_cuda_on_the_cpu(tmp_path, same_host_handle):
    """A notebook on a CPU-only login node gets a GPU rank's CUDA result as a CPU tensor
    (torch's own unpickling would raise there); a same-host receiver that cannot see the GPU
    pulls a handle's bytes over the sender's data socket instead."""
    from monarch_kernel.core import wire
    t = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    frames = wire.dumps(t, local_receivers=1 if same_host_handle else 0)
    for i, f in enumerate(frames):
        (tmp_path / f"f{i}").write_bytes(bytes(f))
    code = ("import sys, torch; from monarch_kernel.core import wire; "
            f"fs = [open(f'{tmp_path}/f{{i}}', 'rb').read() for i in range({len(frames)})]; "
            "x = wire.loads(fs[0], fs[1:]); "
            "assert not torch.cuda.is_available(); "
            "print(x.device, bool(torch.equal(x, torch.arange(1 << 20, dtype=torch.float32))))")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["cpu", "True"], out.stderr[-2000:]


def test_rdma_buffer_over_cuda_memory_reads_and_writes_from_cpu_and_cuda(procs):
    a = procs.spawn("rd", OnGpu)
    n = 1 << 20
    buf = a.slice(gpus=0).make.call_one("w", n).get()
    assert buf.backend == "cuda_ipc"                  # mapped here and copied on the GPU
    want = torch.arange(n, dtype=torch.float32)
    dst = torch.empty(n)
    buf.read_into(dst).get()
    assert torch.equal(dst, want)
    from monarch_kernel.rdma import cuda_ipc
    before = cuda_ipc.copies
    dst_gpu = torch.empty(n, device="cuda")
    buf.read_into(dst_gpu).get()
    assert torch.equal(dst_gpu.cpu(), want)
    assert cuda_ipc.copies == before + 1, "the read went over tcp, not CUDA IPC"
    src = torch.full((n,), 7.0, device="cuda")
    buf.write_from(src).get()
    assert torch.equal(a.slice(gpus=0).tensor.call_one("w").get(), torch.full((n,), 7.0))
    assert a.slice(gpus=1).read_back.call_one(buf, n).get() == ["cuda_ipc", 7.0 * n]   # proc to proc
    buf.drop()
    with pytest.raises(Exception, match="dropped"):
        buf.read_into(dst).get()
    buf2 = a.slice(gpus=0).make.call_one("w2", n).get()   # a new buffer after a drop maps afresh
    buf2.read_into(dst_gpu).get()
    assert torch.equal(dst_gpu.cpu(), want)


def test_nccl_is_chosen_where_procs_have_cuda_and_all_reduce_runs():
    pm = this_host().spawn_procs(per_host={"gpus": GPUS}, name="nccl")
    try:
        pm.init_process_group(timeout=60)                          # backend None -> nccl here
        got = pm.spawn("c", Collective).all_reduce.call(1 << 20).get()
        total = float(sum(range(1, GPUS + 1)))
        assert all(v == ["nccl", "cuda:0", total] for v in got.values()), list(got.values())
    finally:
        pm.stop()


def test_a_distributed_tensor_lives_on_cuda_with_nccl():
    from monarch_kernel.tensor import Shard
    pm = this_host().spawn_procs(per_host={"gpus": GPUS}, name="dtensor-cuda")
    try:
        x = torch.arange(32 * GPUS, dtype=torch.float32).reshape(8 * GPUS, 4)
        dt = pm.distribute(x, placements=[Shard(0)])
        assert dt.device.type == "cuda"
        y = torch.relu(dt @ dt.T - 100) + 1
        assert torch.allclose(y.full_tensor().cpu(), torch.relu(x @ x.T - 100) + 1)
        assert y.sum().item() == pytest.approx(float((torch.relu(x @ x.T - 100) + 1).sum()))
    finally:
        pm.stop()


def test_nvml_telemetry_shows_the_gpu_memory_a_proc_holds():
    pytest.importorskip("pynvml", reason="nvidia-ml-py not installed")
    pm = this_host().spawn_procs(per_host={"gpus": 1}, name="nvml")
    try:
        a = pm.spawn("m", OnGpu)
        assert a.hold_gpu_memory.call_one(512).get() >= 512
        sql = "select max(gpu_mem_mb) from samples where rank = 0"
        deadline, got = time.monotonic() + 20, None
        while time.monotonic() < deadline:
            got = pm.telemetry.query(sql)[0][0]
            if got and got >= 512:
                break
            time.sleep(0.5)
        assert got is not None and got >= 512, got
    finally:
        pm.stop()
