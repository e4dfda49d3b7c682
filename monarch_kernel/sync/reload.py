"""The procs' side of code sync: synced folders on sys.path and as cwd; reload what changed.

Runs on a proc's main thread (``SyncActor.apply`` is a sync endpoint), between the user's
calls and cells, so a reload never races user code.

What a reload does to live objects (the approach of IPython's autoreload): the module is
re-executed, then every *old* class and function it defined is updated in place (function
code, defaults; class attributes and methods). So a live actor whose class was defined in
a reloaded module runs the new method bodies on its next call and keeps its state
(``self.__dict__``); a function a cell imported with ``from mod import f`` runs the new
code too. A function whose closure changed shape cannot be patched: old references keep the
old code (new lookups get the new). Endpoints added by the new code are not callable
through ActorMesh handles made before (their endpoint list is fixed at spawn): spawn again.
Compiled extensions (.so) cannot be reloaded; they are reported as needing a restart.
Standard-library modules are never reloaded, nor the runtime's own (``monarch_kernel``,
``workers``): the proc is running them (a sync of a checkout of monarch-kernel reloaded its
proc loop mid-call and the procs died); they are reported as needing a new mesh.
"""
from __future__ import annotations

import importlib
import os
import sys
import traceback
import types

from monarch_kernel.core.actors import Actor, endpoint

ACTOR_NAME = "monarch_sync"
RUNTIME = ("monarch_kernel", "workers")   # top-level packages a sync never reloads in a proc


def _runtime_dirs() -> tuple[str, ...]:
    """The folders the runtime's own modules load from (``__main__`` of a proc is one)."""
    dirs = []
    for top in RUNTIME:
        mod = sys.modules.get(top)
        f = getattr(mod, "__file__", None)
        if isinstance(f, str):
            dirs.append(os.path.dirname(os.path.realpath(f)) + os.sep)
    return tuple(dirs)


def setup_proc(setup: dict | None) -> None:
    """Put the synced roots first on sys.path and chdir to the workspace copy."""
    if not setup:
        return
    for p in reversed(setup.get("sys_path") or []):
        while p in sys.path:
            sys.path.remove(p)
        sys.path.insert(0, p)
    cwd = setup.get("cwd")
    if cwd and os.path.isdir(cwd):
        os.chdir(cwd)
    importlib.invalidate_caches()


def _patch(old, new, depth: int = 0) -> bool:
    """Make ``old`` behave like ``new`` in place; False when it cannot."""
    if depth > 3 or old is new:
        return old is new
    if isinstance(old, types.FunctionType) and isinstance(new, types.FunctionType):
        try:
            old.__code__ = new.__code__
        except ValueError:      # different free variables
            return False
        old.__defaults__, old.__kwdefaults__ = new.__defaults__, new.__kwdefaults__
        old.__doc__, old.__annotations__ = new.__doc__, new.__annotations__
        old.__dict__.update(new.__dict__)
        return True
    if isinstance(old, (classmethod, staticmethod)) and type(old) is type(new):
        return _patch(old.__func__, new.__func__, depth + 1)
    if isinstance(old, property) and isinstance(new, property):
        pairs = ((old.fget, new.fget), (old.fset, new.fset), (old.fdel, new.fdel))
        return all(_patch(a, b, depth + 1) for a, b in pairs if a is not None or b is not None)
    if isinstance(old, type) and isinstance(new, type):
        skip = {"__dict__", "__weakref__"}
        for key in list(old.__dict__):
            if key in skip:
                continue
            if key not in new.__dict__:
                try:
                    delattr(old, key)
                except (AttributeError, TypeError):
                    pass
            elif not _patch(old.__dict__[key], new.__dict__[key], depth + 1):
                try:
                    setattr(old, key, new.__dict__[key])
                except (AttributeError, TypeError):
                    pass
        for key, value in new.__dict__.items():
            if key not in skip and key not in old.__dict__:
                try:
                    setattr(old, key, value)
                except (AttributeError, TypeError):
                    pass
        return True
    return False


_KEEP = ("__name__", "__loader__", "__spec__", "__file__", "__path__", "__package__", "__cached__",
         "__builtins__")


def reload_in_place(mod) -> None:
    """Re-execute ``mod`` in a fresh namespace, then patch the objects it had defined."""
    before = dict(mod.__dict__)
    for k in list(mod.__dict__):
        if k not in _KEEP:
            del mod.__dict__[k]
    try:
        importlib.reload(mod)
    except BaseException:
        mod.__dict__.update(before)
        raise
    name = mod.__name__
    for key, old in before.items():
        new = mod.__dict__.get(key)
        if new is None or new is old or getattr(old, "__module__", None) != name:
            continue
        _patch(old, new)


def reload_changed(changes: list[dict]) -> dict:
    """Reload the loaded modules whose source file is one of ``changes`` (per root:
    ``src`` and ``dest`` folders, ``modified`` and ``deleted`` relative paths)."""
    importlib.invalidate_caches()
    bases, names = [], set()
    for ch in changes:
        modified, deleted = set(ch.get("modified", ())), set(ch.get("deleted", ()))
        names.update(rel.rsplit("/", 1)[-1] for rel in modified | deleted)
        for base in {ch["dest"], ch.get("src")} - {None}:
            bases.append((os.path.realpath(base) + os.sep, modified, deleted))
    reloaded, failed, restart, left, runtime = [], {}, [], [], []
    if not names:
        return {"reloaded": reloaded, "failed": failed, "needs_restart": restart, "deleted_loaded": left,
                "runtime": runtime}
    stdlib = sys.stdlib_module_names
    todo = []
    for name, mod in list(sys.modules.items()):
        f = getattr(mod, "__file__", None)
        if not isinstance(f, str) or os.path.basename(f) not in names:
            continue
        if name.partition(".")[0] in stdlib:
            continue
        real = os.path.realpath(f)
        for prefix, modified, deleted in bases:
            if not real.startswith(prefix):
                continue
            rel = real[len(prefix):].replace(os.sep, "/")
            if rel in deleted:
                left.append(name)
            elif rel in modified and (name.partition(".")[0] in RUNTIME or real.startswith(_runtime_dirs())):
                runtime.append(name)   # (its __main__ too: the zygote's module, which forked the proc)
            elif rel in modified and f.endswith(".py"):
                todo.append((name, mod))
            elif rel in modified:
                restart.append(name)    # a compiled extension: cannot be reloaded
            else:
                continue
            break
    for name, mod in todo:   # sys.modules order: import order, dependencies first
        try:
            reload_in_place(mod)
            reloaded.append(name)
        except BaseException as e:
            if isinstance(e, KeyboardInterrupt):
                raise
            failed[name] = "".join(traceback.format_exception_only(type(e), e)).strip()
    return {"reloaded": reloaded, "failed": failed, "needs_restart": restart, "deleted_loaded": left,
            "runtime": runtime}


class SyncActor(Actor):
    """Spawned once per proc mesh by the controller (named ``monarch_sync``)."""

    @endpoint
    def apply(self, by_agent: dict, reload: bool = True) -> dict:
        import monarch_kernel.node.proc as proc_mod

        worker = proc_mod.WORKER
        info = by_agent.get(worker.agent) if worker is not None else None
        if info is None:
            return {"skipped": "nothing was synced to this proc's host"}
        setup_proc(info.get("setup"))
        if not reload:
            return {"reloaded": [], "failed": {}, "needs_restart": [], "deleted_loaded": [],
                    "not_reloaded": True}
        out = reload_changed(info.get("changes") or [])
        if out["reloaded"]:
            for slot in worker.actors.values():   # a method may have become async
                slot.code_changed()
        return out

    @endpoint
    def where(self) -> dict:
        return {"cwd": os.getcwd(), "sys_path": sys.path[:4]}
