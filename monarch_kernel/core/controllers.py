"""``get_or_spawn_controller``: named singleton actors, reachable from the controller and
from any actor on any proc.

The registry lives in the controller process. An actor asks for one through its proc's
sink (the controller's inbox) with a ``"getctl"`` message; the controller spawns it (once,
on ``this_proc()``, the client's proc) on a helper thread, since spawning may start a
proc and the I/O thread must not block, and answers with the ActorMesh handle.
"""
from __future__ import annotations

import threading

from .future import Future
from .messages import GetController, Reply
from .runtime import runtime

_registry: dict[str, object] = {}
_lock = threading.Lock()
CONTROLLER_KEY = "controller"   # the pseudo member key of a reply from the controller


def get_or_spawn_local(name: str, cls, args: tuple, kwargs: dict):
    """On the controller: the ActorMesh registered as ``name``, spawned on first use."""
    from .local_proc import this_proc

    with _lock:
        mesh = _registry.get(name)
        if mesh is None or mesh._state.stopped:
            mesh = _registry[name] = this_proc().spawn(name, cls, *args, **kwargs)
        return mesh


def get_or_spawn_controller(name: str, cls, *args, **kwargs) -> Future:
    """A Future of the ActorMesh (one member) registered under ``name``: spawned with
    ``cls(*args, **kwargs)`` on first use, the same handle for every later caller."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"get_or_spawn_controller() takes the controller's name first (a str), got {name!r}")
    rt = runtime()
    if rt.role != "proc":
        fut: Future = Future(f"controller {name!r}")
        try:
            fut.set_result(get_or_spawn_local(name, cls, args, kwargs))
        except BaseException as e:
            fut.set_exception(e)
        return fut
    from .context import proc_worker

    w = proc_worker()
    if w is None or w.sink is None:
        raise RuntimeError("get_or_spawn_controller() needs a controller attached to this mesh")
    call_id, pending = rt.new_call([CONTROLLER_KEY], None, "one", f"controller {name!r}")
    rt.send(w.sink[0], w.sink[1], GetController.make(name, cls, args, kwargs, rt.contact, call_id, w.proc_key))
    return pending.future


def install(rt) -> None:
    """Answer actors' requests (controller side)."""
    rt.on_message(GetController.KIND, _on_request)


def _on_request(msg) -> None:
    _, name, cls, args, kwargs, contact, call_id, proc_key = GetController.of(msg)
    rt = runtime()

    def work():
        try:
            value, ok = get_or_spawn_local(name, cls, args, kwargs), True
        except Exception as e:
            value, ok = e, False
        known = rt.procs.get(proc_key)
        if known is None:
            return
        rt.send(rt.learn_contact(contact), known[1], Reply.make(call_id, CONTROLLER_KEY, ok, value))

    threading.Thread(target=work, name="monarch-controller-spawn", daemon=True).start()
