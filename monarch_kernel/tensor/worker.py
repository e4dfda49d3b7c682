"""Proc side of torch.distributed on the mesh: one ``TensorWorker`` actor per proc.

Runs on the proc's main thread (it is a sync actor), so ops run in the order the
controller sent them, interleaved correctly with ``%%on_mesh`` cells and other actors'
endpoints, and an interrupt lands in them as a KeyboardInterrupt.

It does three things:
  * torchrun's environment and ``init_process_group`` (``init_group``), and the
    DeviceMesh built from the proc mesh's dims;
  * runs batches of tensor ops sent by the controller (``run``), fire and forget. A failed
    op leaves an ``OpFailure`` in place of its results (ops that use them fail the same
    way, without running), and the failure is reported at the next ``fetch``;
  * answers fetches of local shards, full tensors, placements and store sizes.

``STORE`` (tensor id -> local DTensor or other value) is module-global, so an actor
endpoint on this proc that receives a handle gets its local shard (``local_shard``).
"""
from __future__ import annotations

import datetime
import os
import socket

from monarch_kernel import config
from monarch_kernel.core.actors import Actor, endpoint
from monarch_kernel.core.context import current_rank

from .group_worker import GROUP, _bind_address, _gloo_ifname, _tcp_fds, abort_group

STORE: dict[int, object] = {}


class Ref:
    """Stands for a tensor already on the ranks (by id) inside an op's arguments."""

    __slots__ = ("id",)

    def __init__(self, id: int):
        self.id = id

    def __reduce__(self):
        return (Ref, (self.id,))


class Sharded:
    """A local tensor and its DTensor spec, kept unwrapped: the result of an elementwise op
    on same-laid-out DTensors (the fast path). Wrapped into a DTensor when an op needs one."""

    __slots__ = ("local", "spec")

    def __init__(self, local, spec):
        self.local, self.spec = local, spec


def as_dtensor(tid: int):
    """STORE[tid] as a DTensor (wrapping a Sharded in place, once)."""
    v = STORE[tid]
    if type(v) is Sharded:
        from torch.distributed.tensor import DTensor

        v = STORE[tid] = DTensor(v.local, v.spec, requires_grad=False)
    return v


class OpFailure:
    """What a failed op leaves in place of its results on one rank."""

    __slots__ = ("label", "rank", "text", "exc_type")

    def __init__(self, label: str, rank: int, exc_type: str, text: str):
        self.label, self.rank, self.exc_type, self.text = label, rank, exc_type, text

    def __reduce__(self):
        return (OpFailure, (self.label, self.rank, self.exc_type, self.text))


class TensorOpFailed(Exception):
    """Raised by ``fetch`` on a rank; the controller groups these across ranks."""

    def __init__(self, failures: list):
        super().__init__("; ".join(f"{_op_name(f.label)}: {f.exc_type}" for f in failures))
        self.failures = failures

    def __reduce__(self):
        return (TensorOpFailed, (self.failures,))


def _op_name(label) -> str:
    return label if isinstance(label, str) else f"`{label[0]}`"


def local_shard(tid: int):
    """An actor argument that was a handle on the controller: this rank's local tensor."""
    value = STORE.get(tid)
    if type(value) is Sharded:
        return value.local
    if value is None:
        raise LookupError(f"tensor {tid} is not on this rank (it was freed, or created before a respawn)")
    if isinstance(value, OpFailure):
        raise RuntimeError(f"the tensor passed in failed to compute here: {_op_name(value.label)}: {value.text}")
    return getattr(value, "_local_tensor", value)


def _resolve(arg):
    t = type(arg)
    if t is Ref:
        v = STORE[arg.id]
        tv = type(v)
        if tv is OpFailure:
            raise _Poisoned(v)
        if tv is Sharded:
            v = as_dtensor(arg.id)
        return v
    if t is list or t is tuple:
        return t(_resolve(a) for a in arg)
    return arg


class _Poisoned(Exception):
    def __init__(self, failure: OpFailure):
        self.failure = failure


class TensorWorker(Actor):
    def __init__(self):
        from monarch_kernel.core.runtime import runtime

        self.rank = current_rank().rank
        self.unreported: list[OpFailure] = []
        runtime().on_message("torch_abort", abort_group)

    # ------------------------------------------------------------ process group
    @endpoint
    def host_and_port(self) -> tuple[str, int]:
        """The address this proc binds (reachable by the other hosts, unlike the hostname,
        which may resolve to anything) and a free port there: the rendezvous, on rank 0."""
        host = _bind_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            return host, s.getsockname()[1]

    @endpoint
    def cuda_count(self) -> int:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0

    @endpoint
    def setup_env(self, envs: list[dict]) -> None:
        """torchrun's variables for this rank; gloo pinned to the interface of the address
        this proc binds, unless the user chose one (GLOO_SOCKET_IFNAME)."""
        os.environ.update(envs[current_rank().rank])
        if "GLOO_SOCKET_IFNAME" not in os.environ or config.SET_IFNAME.get():
            ifname = _gloo_ifname(_bind_address())
            if ifname:
                os.environ["GLOO_SOCKET_IFNAME"] = ifname
                os.environ[config.SET_IFNAME.env] = "1"

    @endpoint
    def init_group(self, envs: list[dict], backend: str, timeout_s: float, labels, sizes,
                   generation: int) -> str:
        import torch.distributed as dist

        self.setup_env(envs)
        if dist.is_initialized():
            dist.destroy_process_group()
        STORE.clear()   # tensors of an old group cannot take part in the new one's collectives
        self.unreported.clear()
        GROUP.update(generation=generation, device_mesh=None, backend=backend, labels=labels, sizes=sizes,
                     fds=set())
        before = _tcp_fds()
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
        if backend == "gloo":
            dist.barrier()   # every pair connected: the sockets to shut down if a peer dies
            GROUP["fds"] = _tcp_fds(int(os.environ["MASTER_PORT"])) - before   # gloo's pairs, not the store
        return backend

    def device_mesh(self):
        mesh = GROUP["device_mesh"]
        if mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            device = "cuda" if GROUP["backend"] == "nccl" else "cpu"
            mesh = GROUP["device_mesh"] = init_device_mesh(device, tuple(GROUP["sizes"]),
                                                           mesh_dim_names=tuple(GROUP["labels"]))
        return mesh

    # ------------------------------------------------------------ ops
    @endpoint
    def run(self, ops: list, frees: list) -> None:
        """Execute ``ops`` in order: each ``(out, fn, args, kwargs, label)``. Never raises."""
        store = STORE
        for op in ops:
            out, fn, args, kwargs, label = op
            if fn in _POINTWISE and not kwargs:
                try:
                    value = _fast_pointwise(fn, args)
                except Exception:
                    value = None   # the DTensor path below reports it
                if value is not None:
                    if type(out) is int and value is not _INPLACE:
                        store[out] = value
                    continue
            try:
                args = _resolve(args)
                if kwargs:
                    kwargs = {k: _resolve(v) for k, v in kwargs.items()}
                if type(fn) is str:
                    value = _SPECIAL[fn](self, *args, **kwargs) if fn in _SPECIAL else \
                        getattr(args[0], fn)(*args[1:], **kwargs)
                else:
                    value = fn(*args, **kwargs)
            except _Poisoned as p:
                value = p.failure
            except KeyboardInterrupt:
                value = OpFailure(label, self.rank, "KeyboardInterrupt", "interrupted")
                self.unreported.append(value)
            except BaseException as e:
                value = OpFailure(label, self.rank, type(e).__name__, _short(e))
                self.unreported.append(value)
            if type(out) is int:
                store[out] = value
            elif type(value) is OpFailure:
                for o in out:
                    store[o] = value
            else:
                for o, v in zip(out, value, strict=True):
                    store[o] = v
        for tid in frees:
            store.pop(tid, None)

    def _distribute(self, tensor, placements, src_data_rank):
        from torch.distributed.tensor import distribute_tensor

        if GROUP["backend"] == "nccl":
            tensor = tensor.cuda()
        return distribute_tensor(tensor, self.device_mesh(), placements, src_data_rank=src_data_rank)

    def _factory(self, factory, placements):
        return self._distribute(factory(), placements, 0)

    def _full(self, value):
        return value.full_tensor() if hasattr(value, "full_tensor") else value

    # ------------------------------------------------------------ fetches
    @endpoint
    def fetch(self, tid: int | None, what: str, want_rank: int | None):
        """Every rank is asked: failures come back from all of them (a TensorOpFailed
        value); then, on ``want_rank`` (None: all), the local shard ('local'), the whole
        tensor ('full', a collective every rank joins), the layout, or store stats."""
        failures = list(self.unreported)
        self.unreported.clear()
        value = STORE.get(tid) if tid is not None else None
        if type(value) is Sharded:
            value = as_dtensor(tid)
        if type(value) is OpFailure and value not in failures:
            failures.append(value)
        if failures:
            return TensorOpFailed(failures)
        if tid is not None and tid not in STORE:
            raise LookupError(f"tensor {tid} is not on rank {self.rank}: it was freed, or made before "
                              "a respawn re-formed the process group")
        if what == "full" and hasattr(value, "full_tensor"):
            value = value.full_tensor()
        if want_rank is not None and want_rank != self.rank:
            return None
        if what == "local":
            value = getattr(value, "_local_tensor", value)
        elif what == "layout":
            if not hasattr(value, "placements"):
                return None
            return (tuple(value.placements), tuple(value.shape), value.dtype, value.device.type)
        elif what == "stats":
            return {"tensors": len(STORE)}
        return value.cpu() if hasattr(value, "cpu") else value


_INPLACE = object()
_NO_PARTIAL = [None]   # the last spec seen to have no Partial placement (checking costs more than an add)
_SCALARS = (int, float, bool)
_POINTWISE: set = {
    "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__",
    "__neg__", "__abs__", "__pow__", "add", "sub", "mul", "div", "neg", "abs", "exp", "log", "sqrt",
    "sin", "cos", "tanh", "sigmoid", "relu",
}
_POINTWISE_INPLACE = {"__iadd__", "__isub__", "__imul__", "__itruediv__", "add_", "sub_", "mul_", "div_",
                      "relu_", "neg_", "abs_", "exp_", "sqrt_"}
_POINTWISE |= _POINTWISE_INPLACE


def _fast_pointwise(fn: str, args):
    """An elementwise op whose tensor operands share one layout (Shard/Replicate, no
    Partial, no autograd) runs on the local tensors, without DTensor's dispatch (several
    times faster); anything else returns None and takes the DTensor path."""
    store = STORE
    spec = None
    local_args = []
    for a in args:
        ta = type(a)
        if ta is Ref:
            v = store.get(a.id)
            tv = type(v)
            if tv is Sharded:
                s, local = v.spec, v.local
            elif tv.__name__ == "DTensor":
                s, local = v._spec, v._local_tensor
                if local.requires_grad:
                    return None
            else:
                return None
            if spec is None:
                spec = s
                if s is not _NO_PARTIAL[0]:
                    if any(p.is_partial() for p in s.placements):
                        return None
                    _NO_PARTIAL[0] = s
            elif s is not spec and s != spec:
                return None
            local_args.append(local)
        elif ta in _SCALARS:
            local_args.append(a)
        else:
            return None
    if spec is None or type(args[0]) is not Ref:
        return None
    out = getattr(local_args[0], fn)(*local_args[1:])
    if fn in _POINTWISE_INPLACE:
        return _INPLACE
    if out.dtype != local_args[0].dtype or out.shape != local_args[0].shape:
        return None   # type promotion or broadcasting: let DTensor work out the spec
    return Sharded(out, spec)


def _short(e: BaseException) -> str:
    """The error's message, cut to a few lines (DTensor's can run long)."""
    lines = (str(e).strip() or repr(e)).splitlines()
    return "\n".join(lines[:6] + (["..."] if len(lines) > 6 else []))


_SPECIAL = {
    "distribute": TensorWorker._distribute,
    "factory": TensorWorker._factory,
    "full_tensor": TensorWorker._full,
    "getattr": lambda self, obj, name: getattr(obj, name),
    "data": lambda self, fn, *args, **kwargs: _on_whole(fn, args, kwargs),
}


def _on_whole(fn, args, kwargs):
    """A data-dependent result (``item()``, ``torch.equal``): computed on whole tensors
    (a Partial sum's ``item()`` would otherwise be this rank's part)."""
    args = [a.full_tensor() if hasattr(a, "full_tensor") else a for a in args]
    return getattr(args[0], fn)(*args[1:], **kwargs) if type(fn) is str else fn(*args, **kwargs)
