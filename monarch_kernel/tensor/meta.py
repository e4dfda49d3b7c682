"""What an op on handles returns (shape, dtype, device), known on the controller without
asking the ranks: a cache of meta-tensor results, and the device of ``.to``/``.cuda``/``.cpu``."""
from __future__ import annotations

import torch

# Meta kernels of even ``a + 1`` run through Python refs (about 1 ms): the result's shape and
# dtype are remembered per (op, operand shapes/dtypes, other arguments). For elementwise
# ops a Python scalar counts by its type only (its value cannot change shape or dtype).
META_CACHE: dict = {}
CACHE_MAX = 4096
_ELEMENTWISE = {f"__{n}__" for n in ("add", "radd", "sub", "rsub", "mul", "rmul", "truediv", "rtruediv",
                                      "iadd", "isub", "imul", "itruediv", "pow", "rpow", "neg", "abs")} | {
    "add", "sub", "mul", "div", "add_", "sub_", "mul_", "div_", "relu", "exp", "log", "sqrt", "tanh",
    "sigmoid", "sin", "cos", "neg", "abs", "relu_", "clamp"}
SAME_META_INPLACE = {"__iadd__", "__isub__", "__imul__", "__itruediv__", "add_", "sub_", "mul_", "div_",
                      "relu_", "zero_", "fill_", "copy_", "clamp_", "normal_", "uniform_"}


def cache_key(fn, name, args, kwargs, handle_type):
    elementwise = name in _ELEMENTWISE
    parts = [fn]
    for a in (*args, *kwargs.items()):
        t = type(a)
        if t is handle_type:
            m = a._meta
            parts.append((m.shape, m.dtype))
        elif t in (int, float, bool, complex):
            parts.append(t if elementwise else (t, a))
        elif t is tuple and kwargs and a in kwargs.items():
            k, v = a
            if type(v) is handle_type:
                parts.append((k, v._meta.shape, v._meta.dtype))
            elif v is None or type(v) in (int, float, bool, str, torch.dtype):
                parts.append(a)
            else:
                return None
        elif a is None or t in (str, torch.dtype) or (t is tuple and all(type(x) is int for x in a)):
            parts.append((t, a))
        elif t is slice and all(x is None or type(x) is int for x in (a.start, a.stop, a.step)):
            parts.append((a.start, a.stop, a.step))
        else:
            return None
    try:
        return tuple(parts)
    except TypeError:
        return None


def remember(key, value) -> None:
    if len(META_CACHE) >= CACHE_MAX:
        META_CACHE.clear()
    META_CACHE[key] = value


def device_move(name, device, margs, mkwargs):
    """``.to(device/dtype)``, ``.cuda()``, ``.cpu()``: the device is tracked here, the meta
    tensor only sees the dtype."""
    if name == "cuda":
        return "cuda", margs[:1], {}
    if name == "cpu":
        return "cpu", margs[:1], {}
    rest = [margs[0]]
    for a in margs[1:]:
        if isinstance(a, (str, torch.device)):
            device = torch.device(a).type
        elif isinstance(a, torch.Tensor):
            rest.append(a.dtype)
        else:
            rest.append(a)
    kw = dict(mkwargs)
    if "device" in kw:
        device = torch.device(kw.pop("device")).type
    return device, tuple(rest), kw
