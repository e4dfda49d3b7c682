"""The warm zygote: imports torch once, then forks procs on the agent's request.

It is single-threaded and creates no zmq context, so fork is safe. Protocol: JSON lines
on stdin (``{"op": "fork", "cfg": {...}}``, ``{"op": "import", "req": N, "modules": [...]}``)
and stdout (``ready``, ``forked``, ``imported``, ``exit``). What it imports (torch, the runtime,
``MONARCH_KERNEL_PRELOAD``'s modules and those of ``HostMesh.preload``) every proc forked after
has loaded already: imported once a host, not once a rank, and its memory shared.
It reaps its children and reports each exit status, which is how the agent learns of a
proc's death at once. It dies with the agent, and its procs die with it.
"""
from __future__ import annotations

import json
import os
import select
import signal
import sys
import time

from monarch_kernel import config
from monarch_kernel.node.zygote_memory import HugePages, freeze_objects

# The first fork of a spawn of this many procs on this host waits for the huge pages first:
# 0.25-0.75 s once (load), then ~4 ms less per fork (zygote_memory.py): about even at 50-60
# forks. A smaller spawn forks at once.
# Memory is collapsed only while no proc of ours lives: a page a child still shares would be
# copied into the huge page, and the child left sole owner of the old one (a lone proc's
# USS went 6 -> 125 MB, the host's memory +130 MB).
FORKS_WORTH_WAITING = 48


def _preload() -> tuple[float, dict]:
    """Import what every proc needs (and MONARCH_KERNEL_PRELOAD's modules): (seconds, what failed)."""
    t0 = time.perf_counter()
    if not config.NO_TORCH.get():
        try:
            import torch  # noqa: F401
        except ImportError:
            pass
    # zmq, cloudpickle, the runtime; and what every proc would otherwise import (and, without
    # .pyc files, compile) on its own: the Actor base class with its first actor, its rich output.
    import monarch_kernel.core.actors  # noqa: F401
    import monarch_kernel.node.proc  # noqa: F401
    import monarch_kernel.node.rich_output  # noqa: F401
    try:   # ~0.1 s: a rank's display() uses IPython's formatters (node/rich_output.py)
        import IPython.display  # noqa: F401
    except ImportError:
        pass
    failed = import_modules(config.PRELOAD.get())["failed"]
    return time.perf_counter() - t0, failed


def import_modules(modules: list[str]) -> dict:
    """Import ``modules`` here, for every proc forked after: {"seconds", "failed": {module:
    why}}. A module that fails is named and the rest still load; the zygote goes on."""
    import importlib

    t0 = time.perf_counter()
    failed = {}
    for name in modules:
        try:
            importlib.import_module(name)
        except (Exception, SystemExit) as e:
            failed[name] = f"{type(e).__name__}: {e}"
    return {"seconds": round(time.perf_counter() - t0, 3), "failed": failed}


def main() -> None:
    from monarch_kernel.node.linux import die_with_parent

    die_with_parent(config.AGENT_PID.get() or None)
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints go to the agent's log, not the protocol pipe
    preload_s, failed = _preload()
    freeze_objects()
    huge = HugePages() if config.ZYGOTE_HUGE_PAGES.get() else None
    sig_r, sig_w = os.pipe()
    os.set_blocking(sig_r, False)
    os.set_blocking(sig_w, False)
    signal.set_wakeup_fd(sig_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    me = os.getpid()
    out.write(json.dumps({"op": "ready", "preload_s": round(preload_s, 3), "failed": failed}) + "\n")
    buf = b""
    live: set[int] = set()   # our procs not reaped yet
    while True:
        idle_work = huge is not None and not huge.done and not live
        try:
            ready, _, _ = select.select([0, sig_r], [], [], 0 if idle_work else None)
        except InterruptedError:
            ready = [sig_r]
        if not ready and idle_work:
            huge.step()   # nothing asked of us: a few ms of making forks cheaper
            _said_huge(huge)
            continue
        if sig_r in ready:
            try:
                os.read(sig_r, 4096)
            except BlockingIOError:
                pass
            _reap(out, live)
        if 0 in ready:
            chunk = os.read(0, 65536)
            if not chunk:
                return  # the agent is gone
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                cmd = json.loads(line)
                if cmd["op"] == "fork":
                    if huge is not None and not huge.done and not live and \
                            _procs_here(cmd["cfg"]) >= FORKS_WORTH_WAITING:
                        huge.finish()   # the first fork of a big spawn: the rest are cheaper
                        _said_huge(huge)
                    pid = os.fork()
                    if pid == 0:
                        _child(cmd["cfg"], me, out, sig_r, sig_w)
                    live.add(pid)
                    out.write(json.dumps({"op": "forked", "key": cmd["cfg"]["proc_key"], "pid": pid}) + "\n")
                elif cmd["op"] == "import":
                    from monarch_kernel.sync.reload import setup_proc

                    # the host's synced folders (`%mesh sync`, `--env`), as each proc gets them
                    setup_proc({"sys_path": cmd.get("sys_path") or []})
                    done = import_modules(cmd["modules"])
                    freeze_objects()
                    out.write(json.dumps({"op": "imported", "req": cmd["req"], **done}) + "\n")
                elif cmd["op"] == "exit":
                    return
        _reap(out, live)


def _procs_here(cfg: dict) -> int:
    """How many procs the spawn this fork belongs to puts on this host: its mesh's sizes,
    less the hosts dimension (1 when the config does not say: a respawn)."""
    sizes, labels = cfg.get("sizes") or (), cfg.get("labels") or ()
    n = 1
    for label, size in zip(labels, sizes):
        if label != "hosts" and isinstance(size, int):
            n *= size
    return n


def _said_huge(huge: HugePages) -> None:
    if huge.done:   # once: the agent's log says what forks will cost
        print(f"zygote: {huge.collapsed} x 2 MB of its memory in huge pages", file=sys.stderr, flush=True)


def _reap(out, live: set) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        live.discard(pid)
        code = os.waitstatus_to_exitcode(status)
        out.write(json.dumps({"op": "exit", "pid": pid, "code": code}) + "\n")


def _child(cfg: dict, zygote_pid: int, out, sig_r: int, sig_w: int) -> None:
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        out.close()
        for fd in (sig_r, sig_w):
            os.close(fd)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        from monarch_kernel.node.linux import die_with_parent

        die_with_parent(zygote_pid)
        from monarch_kernel.node import proc

        code = proc.main(cfg)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except Exception:
            pass
        os._exit(code or 0)


if __name__ == "__main__":
    main()
