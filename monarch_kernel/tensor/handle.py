"""``DistributedTensor``: the controller's handle to a tensor that lives, as a DTensor, on
every rank of a proc mesh.

Ops on handles (``+``, ``@``, methods, ``torch.*`` through ``__torch_function__``,
in-place ops, ``.to``) are checked on the controller against a *meta* tensor of the
global shape (so a shape mismatch is an error at once, and ``.shape``/``.dtype`` need no
round trip), then queued to the ranks (engine.py) and return new handles without waiting.
Data comes back through ``full_tensor()``, ``fetch_shard`` and ``inspect``.
"""
from __future__ import annotations

import torch

from .dist import ensure_group
from .engine import TensorEngine, TensorOpError, issued_at, label_text
from .layout import layout_html, layout_text, normalize_placements
from .meta import META_CACHE, SAME_META_INPLACE, cache_key, device_move, remember
from .worker import Ref

# Results that depend on the data: computed on the ranks and fetched (a sync point).
_DATA_METHODS = {"item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__", "equal",
                 "allclose", "all", "any"}
_SYNC_FUNCS = {torch.equal, torch.allclose}


def _engine(procs) -> TensorEngine:
    g = ensure_group(procs)
    if g.engine is None:
        g.engine = TensorEngine(g)
        _flush_after_cells()
    return g.engine


class DistributedTensor:
    """A handle to a distributed tensor on a proc mesh (see the module docstring)."""

    __slots__ = ("_engine", "_id", "_meta", "_device", "_gen", "_layout", "__weakref__")

    def __init__(self, engine: TensorEngine, tid: int, meta: torch.Tensor, device: str):
        self._engine, self._id, self._meta, self._device = engine, tid, meta, device
        self._gen = engine.generation
        self._layout = None

    def __del__(self):
        try:
            self._engine.free(self._id)
        except Exception:
            pass

    def __reduce__(self):
        """Passed to an actor endpoint (or pushed to a cell): arrives as the local shard."""
        from .worker import local_shard

        self._engine.check_usable(self._gen, "passing a distributed tensor")
        self._engine.flush()
        return (local_shard, (self._id,))

    # ------------------------------------------------------------ what is known locally
    @property
    def shape(self) -> torch.Size:
        return self._meta.shape

    def size(self, dim: int | None = None):
        return self._meta.size() if dim is None else self._meta.size(dim)

    @property
    def dtype(self) -> torch.dtype:
        return self._meta.dtype

    @property
    def device(self) -> torch.device:
        return torch.device(self._device)

    @property
    def ndim(self) -> int:
        return self._meta.ndim

    def dim(self) -> int:
        return self._meta.dim()

    def numel(self) -> int:
        return self._meta.numel()

    def __len__(self) -> int:
        return len(self._meta)

    @property
    def mesh(self):
        from ..core.mesh import ProcMesh

        return ProcMesh(self._engine.group.state)

    @property
    def placements(self) -> tuple:
        """The DTensor placements, one per mesh dim (asked of rank 0 once)."""
        return self._fetch_layout()[0]

    def _fetch_layout(self):
        if self._layout is None:
            self._engine.check_usable(self._gen, "placements")
            self._layout = self._engine.fetch(self._id, "layout", 0)
        return self._layout

    # ------------------------------------------------------------ data back
    def full_tensor(self) -> torch.Tensor:
        """The whole tensor, gathered on the ranks (a collective) and brought back."""
        self._engine.check_usable(self._gen, "full_tensor()")
        return self._engine.fetch(self._id, "full", 0)

    def local_shards(self) -> list:
        """Every rank's local shard, by rank."""
        self._engine.check_usable(self._gen, "local_shards()")
        return self._engine.fetch(self._id, "local", None)

    # ------------------------------------------------------------ ops
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return apply(func, args, kwargs or {}, getattr(func, "__name__", str(func)))

    def __getattr__(self, name: str):
        if name.startswith("_") and not name.startswith("__"):
            raise AttributeError(name)
        try:
            attr = getattr(self._meta, name)
        except AttributeError:
            raise AttributeError(f"'DistributedTensor' has no attribute {name!r} (torch.Tensor has none "
                                 "either)") from None
        if callable(attr):
            return _Method(self, name)
        if isinstance(attr, torch.Tensor):   # .T, .mT, .real ...
            return apply("getattr", (self, name), {}, name, meta_fn=lambda m, n: getattr(m, n))
        return attr

    def __setitem__(self, index, value):
        apply("__setitem__", (self, index, value), {}, "__setitem__")

    __hash__ = object.__hash__

    def __repr__(self):
        try:
            return layout_text(self)
        except TensorOpError as e:
            return f"<DistributedTensor {tuple(self.shape)} {self.dtype}: failed: {e}>"

    def _repr_html_(self):
        try:
            return layout_html(self)
        except TensorOpError:
            return None


class _Method:
    __slots__ = ("handle", "name")

    def __init__(self, handle, name):
        self.handle, self.name = handle, name

    def __call__(self, *args, **kwargs):
        return apply(self.name, (self.handle, *args), kwargs, self.name)


def _dunder(name: str, method: str | None = None):
    def op(self, *args):
        return apply(method or name, (self, *args), {}, method or name)

    op.__name__ = name
    return op


for _n in ("add", "sub", "mul", "matmul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor",
           "lshift", "rshift"):
    setattr(DistributedTensor, f"__{_n}__", _dunder(f"__{_n}__"))
    setattr(DistributedTensor, f"__r{_n}__", _dunder(f"__r{_n}__"))
    setattr(DistributedTensor, f"__i{_n}__", _dunder(f"__i{_n}__"))
for _n in ("neg", "pos", "abs", "invert", "lt", "le", "gt", "ge", "eq", "ne", "getitem"):
    setattr(DistributedTensor, f"__{_n}__", _dunder(f"__{_n}__"))
for _n in _DATA_METHODS - {"equal", "allclose", "all", "any", "item", "tolist", "numpy"}:
    setattr(DistributedTensor, _n, _dunder(_n))


# ---------------------------------------------------------------- issuing an op
def _handles(args, kwargs) -> list[DistributedTensor]:
    found = []
    for a in (*args, *kwargs.values()):
        if type(a) is DistributedTensor:
            found.append(a)
        elif type(a) in (list, tuple):
            found.extend(x for x in a if type(x) is DistributedTensor)
    return found


def _swap(a, to):
    t = type(a)
    if t is DistributedTensor:
        return to(a)
    if t is list or t is tuple:
        return t(_swap(x, to) for x in a)
    return a


def _ref(h):
    return Ref(h._id)


def _meta_of(h):
    return h._meta


def apply(fn, args: tuple, kwargs: dict, name: str, meta_fn=None):
    """Check ``fn(*args, **kwargs)`` on meta tensors, queue it on the ranks, and return
    handles to its results (or, for data-dependent results, fetch them)."""
    handles = _handles(args, kwargs)
    if not handles:
        return NotImplemented
    engine = handles[0]._engine
    for h in handles[1:]:
        if h._engine is not engine:
            raise ValueError(f"`{name}` mixes distributed tensors of different meshes ('{engine.name}' and "
                             f"'{h._engine.name}'); move one with .full_tensor() and mesh.distribute(...)")
    label = (name, *issued_at())   # formatted only if the op fails (engine.label_text)
    for h in handles:
        if h._gen != engine.generation or engine.group.broken or engine.group.state.stopped:
            engine.check_usable(h._gen, label_text(label))
    if name in _DATA_METHODS or fn in _SYNC_FUNCS:
        return _run_and_fetch(engine, fn, args, kwargs, label)
    device = handles[0]._device
    margs, mkwargs = _swap(args, _meta_of), {k: _swap(v, _meta_of) for k, v in kwargs.items()}
    if name in ("to", "cuda", "cpu"):
        device, margs, mkwargs = device_move(name, device, margs, mkwargs)
        if name != "to":
            fn, name = "to", "to"
    key = cache_key(fn, name, args, kwargs, DistributedTensor) if meta_fn is None else None
    hit = META_CACHE.get(key) if key is not None else None
    if hit is not None:
        return _issue_cached(engine, hit, fn, args, kwargs, handles, device, label)
    try:
        if meta_fn is not None:
            result = meta_fn(*margs, **mkwargs)
        elif type(fn) is str:
            result = getattr(margs[0], fn)(*margs[1:], **mkwargs) if name != "to" or len(margs) > 1 or mkwargs \
                else margs[0]
        else:
            result = fn(*margs, **mkwargs)
    except Exception as e:
        raise type(e)(f"{label_text(label)}: {e} (checked on the controller against the global shapes; nothing "
                      "was sent to the ranks)") if _rebuildable(e) else e from None
    rargs, rkwargs = _swap(args, _ref), {k: _swap(v, _ref) for k, v in kwargs.items()}
    if result is None and name == "__setitem__":
        engine.submit(handles[0]._id, fn, rargs, rkwargs, label)
        return None
    if isinstance(result, torch.Tensor):
        same = next((h for h in handles if h._meta is result), None)
        if same is not None:   # in-place: the same handle, the same tensor on the ranks
            if key is not None and name in SAME_META_INPLACE:
                remember(key, ("inplace", handles.index(same)))
            engine.submit(same._id, fn, rargs, rkwargs, label)
            return same
        if key is not None:
            remember(key, ("new", result.shape, result.dtype))
        out = DistributedTensor(engine, engine.new_id(), result, device)
        engine.submit(out._id, fn, rargs, rkwargs, label)
        return out
    if isinstance(result, (tuple, list)) and result and all(isinstance(r, torch.Tensor) for r in result):
        outs = [DistributedTensor(engine, engine.new_id(), r, device) for r in result]
        engine.submit(tuple(o._id for o in outs), fn, rargs, rkwargs, label)
        return type(result)(outs) if type(result) in (tuple, list) else tuple(outs)
    return result   # shape arithmetic the meta tensor answers (size(), dim(), ...)


def _issue_cached(engine, hit, fn, args, kwargs, handles, device, label):
    rargs, rkwargs = _swap(args, _ref), {k: _swap(v, _ref) for k, v in kwargs.items()}
    if hit[0] == "inplace":
        same = handles[hit[1]]
        engine.submit(same._id, fn, rargs, rkwargs, label)
        return same
    out = DistributedTensor(engine, engine.new_id(), torch.empty(hit[1], dtype=hit[2], device="meta"), device)
    engine.submit(out._id, fn, rargs, rkwargs, label)
    return out


def _rebuildable(e: Exception) -> bool:
    try:
        type(e)("x")
        return True
    except Exception:
        return False


def _run_and_fetch(engine: TensorEngine, fn, args, kwargs, label):
    tid = engine.new_id()
    rargs, rkwargs = _swap(args, _ref), {k: _swap(v, _ref) for k, v in kwargs.items()}
    engine.submit(tid, "data", (fn, *rargs), rkwargs, label)
    try:
        return engine.fetch(tid, "value", 0)
    finally:
        engine.free(tid)


# ---------------------------------------------------------------- making handles
def distribute(procs, tensor, placements=None) -> DistributedTensor:
    if isinstance(tensor, DistributedTensor):
        raise TypeError("distribute() takes a local torch.Tensor; this is already a distributed tensor")
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"distribute() takes a torch.Tensor, got {type(tensor).__name__}; for a tensor made "
                        "on the ranks use mesh.tensor(lambda: ...)")
    engine = _engine(procs)
    st = engine.group.state
    places = normalize_placements(st.labels, st.sizes, placements, tensor.ndim, "distribute()")
    meta = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
    out = DistributedTensor(engine, engine.new_id(), meta, _group_device(engine))
    engine.submit(out._id, "distribute", (tensor.detach().cpu(), places, None), {}, ("distribute", *issued_at()))
    engine.flush()
    return out


def from_factory(procs, factory, placements=None) -> DistributedTensor:
    if not callable(factory):
        raise TypeError(f"mesh.tensor() takes a function that makes the tensor on each rank, e.g. "
                        f"mesh.tensor(lambda: torch.randn(8, 8)); got {type(factory).__name__}")
    engine = _engine(procs)
    st = engine.group.state
    try:
        with torch.device("meta"):
            meta = factory()
    except Exception:
        meta = None
    if not isinstance(meta, torch.Tensor):
        raise TypeError("mesh.tensor(factory): factory() must return a torch.Tensor made by torch functions "
                        "(torch.randn, torch.arange, ...); it is tried on the controller's meta device for the "
                        f"shape, and gave {type(meta).__name__}")
    meta = torch.empty(meta.shape, dtype=meta.dtype, device="meta")
    places = normalize_placements(st.labels, st.sizes, placements, meta.ndim, "mesh.tensor()")
    out = DistributedTensor(engine, engine.new_id(), meta, _group_device(engine))
    engine.submit(out._id, "factory", (factory, places), {}, ("tensor", *issued_at()))
    engine.flush()
    return out


def _group_device(engine: TensorEngine) -> str:
    return "cuda" if engine.group.backend == "nccl" else "cpu"


# ---------------------------------------------------------------- notebook cells flush
_hooked = False


def _flush_after_cells() -> None:
    """In IPython: send what is queued at the end of every cell (ops do not wait for a
    later cell to start running)."""
    global _hooked
    if _hooked:
        return
    _hooked = True
    try:
        from IPython import get_ipython
    except ImportError:
        return
    ip = get_ipython()
    if ip is not None:
        ip.events.register("post_run_cell", lambda *_: flush_all())


def flush_all() -> None:
    from .dist import _GROUPS

    for g in list(_GROUPS.values()):
        if g.engine is not None and not g.state.stopped:
            try:
                g.engine.flush()
            except TensorOpError as e:
                print(f"distributed tensor ops not sent: {e}")
