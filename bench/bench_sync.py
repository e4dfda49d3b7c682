"""Code sync speed: a generated tree of 10,000 files (about 100 MB) to 4 procs of one host.

  python bench/bench_sync.py [--files 10000] [--mb 100] [--procs 4]

Figures (one JSON line each, the shared record format): first sync time and MB/s, the
no-op resync (target <= 0.5 s), one changed file resync including the procs' reload
(target <= 0.2 s). The tree lives under /tmp and is deleted at the end.
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import common  # noqa: E402

from monarch_kernel.actor import this_host  # noqa: E402
from monarch_kernel.sync import sync_workspace  # noqa: E402

emit = common.emit


def make_tree(root: str, files: int, total_mb: float) -> int:
    """Python-like text files in nested packages (compressible, like real code), plus
    a few incompressible blobs for a fifth of the bytes."""
    rng = random.Random(0)
    words = [f"name_{i}" for i in range(2000)]
    blobs = max(1, files // 1000)
    text_bytes = int(total_mb * 1e6 * 0.8) // (files - blobs)
    blob_bytes = int(total_mb * 1e6 * 0.2) // blobs
    total = 0
    for i in range(files - blobs):
        d = os.path.join(root, f"pkg{i % 20}", f"sub{i % 7}")
        os.makedirs(d, exist_ok=True)
        lines, n = [], 0
        while n < text_bytes:
            line = f"def {rng.choice(words)}_{i}(x, y={rng.randint(0, 999)}):  # {rng.getrandbits(64):x}\n"
            lines.append(line)
            n += len(line)
        data = "".join(lines)[:text_bytes]
        with open(os.path.join(d, f"mod{i}.py"), "w") as f:
            f.write(data)
        total += len(data)
    os.makedirs(os.path.join(root, "blobs"), exist_ok=True)
    for i in range(blobs):
        with open(os.path.join(root, "blobs", f"b{i}.bin"), "wb") as f:
            f.write(os.urandom(blob_bytes))
        total += blob_bytes
    with open(os.path.join(root, "hot.py"), "w") as f:
        f.write("def value():\n    return 0\n")
    return total


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--files", type=int, default=10_000)
    p.add_argument("--mb", type=float, default=100.0)
    p.add_argument("--procs", type=int, default=4)
    p.add_argument("--repeat", type=int, default=5)
    a = p.parse_args(argv)
    common.CTX.update(procs=a.procs, files=a.files)
    tmp = tempfile.mkdtemp(prefix="mk-bench-sync-", dir="/tmp")
    procs = None
    try:
        t0 = time.perf_counter()
        nbytes = make_tree(tmp, a.files, a.mb)
        emit("sync_tree_generate_s", round(time.perf_counter() - t0, 2), "s", bytes=nbytes)
        os.chdir(tmp)
        sys.path.insert(0, tmp)
        procs = this_host().spawn_procs(per_host={"gpus": a.procs})

        t0 = time.perf_counter()
        first = sync_workspace(procs)
        dt = time.perf_counter() - t0
        emit("sync_first_s", round(dt, 3), "s", files_sent=first.files_sent, bytes=nbytes,
             wire_bytes=first.bytes_sent, hashed_bytes=first.hashed_bytes)
        emit("sync_first_MBps", round(nbytes / 1e6 / dt, 1), "MB/s")

        # the procs import the module we will edit, so the one-file resync includes a reload
        from monarch_kernel.sync.reload import ACTOR_NAME

        sync_actor = procs.actor_mesh(ACTOR_NAME)
        _ = sync_actor  # spawned by the first sync
        probe = _probe(procs)
        probe.ev.call("__import__('hot').value()").get()

        noop = []
        for _ in range(a.repeat):
            t0 = time.perf_counter()
            r = sync_workspace(procs)
            noop.append(time.perf_counter() - t0)
            assert r.files_sent == 0, r
        emit("sync_noop_s", round(statistics.median(noop), 4), "s", min=round(min(noop), 4),
             target=0.5, iters=len(noop))

        one = []
        for i in range(a.repeat):
            with open("hot.py", "w") as f:
                f.write(f"def value():\n    return {i + 1}\n")
            t0 = time.perf_counter()
            r = sync_workspace(procs)
            one.append(time.perf_counter() - t0)
            assert r.files_sent == 1, r
            assert probe.ev.call("__import__('hot').value()").get().values() == [i + 1] * a.procs
        emit("sync_one_file_s", round(statistics.median(one), 4), "s", min=round(min(one), 4),
             target=0.2, iters=len(one), includes="walk+hash check, transfer, reload on every proc")
    finally:
        if procs is not None:
            procs.stop()
        os.chdir("/")
        shutil.rmtree(tmp, ignore_errors=True)


def _probe(procs):
    import cloudpickle

    from monarch_kernel.actor import Actor, endpoint

    class Probe(Actor):
        @endpoint
        def ev(self, expr: str):
            return eval(expr)

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    return procs.spawn("probe", Probe)


if __name__ == "__main__":
    main()
