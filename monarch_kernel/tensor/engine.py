"""The controller's tensor engine of one proc mesh: ids, the op pipeline, fetches, frees.

Ops are not waited for. They queue here and go to every rank in batches (one message per
rank per batch), from the thread that issues them, on the same sockets as every other
call to those procs, so each rank runs them in issue order, before any later call or cell.
A batch leaves when it is full, when ops have waited ``BATCH_AGE_S``, and at every sync
point (a fetch, a handle passed to an actor, the end of a notebook cell: ``flush``).

Failures stay on the ranks until the next fetch, which asks every rank, so the error
names the op that raised and all the ranks it raised on (``TensorOpError``).
"""
from __future__ import annotations

import itertools
import os
import sys
import time

from ..core.errors import MeshGoneError, MonarchError, SupervisionError
from ..core.future import Future
from ..core.runtime import runtime

BATCH_OPS = 256
BATCH_AGE_S = 0.002


class TensorOpError(MonarchError):
    """A tensor op failed on some ranks; raised at the fetch that follows it."""


class TensorEngine:
    def __init__(self, group):
        self.group = group
        self.pending: list = []
        self.freed: list[int] = []
        self.first_at = 0.0
        self.generation = group.generation
        # ids unique across kernel restarts that re-attach the same procs
        self._ids = itertools.count(int.from_bytes(os.urandom(3), "little") << 32)

    @property
    def name(self) -> str:
        return self.group.state.name

    def new_id(self) -> int:
        return next(self._ids)

    def reset(self, generation: int) -> None:
        """A new process group: the ranks dropped every tensor of the old one."""
        self.pending.clear()
        self.freed.clear()
        self.generation = generation

    def check_usable(self, generation: int, what: str) -> None:
        st = self.group.state
        if st.stopped:
            raise MeshGoneError(f"{what}: proc mesh '{st.name}' was stopped, and its tensors with it; "
                                "make the tensor again on a live mesh")
        if generation != self.generation:
            raise TensorOpError(f"{what}: this tensor was made before mesh '{st.name}' formed a new process "
                                "group (a respawn); its shards are gone. Make it again")
        if self.group.broken:
            raise TensorOpError(f"{what}: {self.group.broken}")

    # ---------------------------------------------------------------- the pipeline
    def submit(self, out, fn, args, kwargs, label: str) -> None:
        pending = self.pending
        if not pending:
            self.first_at = time.monotonic()
        pending.append((out, fn, args, kwargs, label))
        if len(pending) >= BATCH_OPS or time.monotonic() - self.first_at > BATCH_AGE_S:
            self.flush()

    def free(self, tid: int) -> None:
        """From a handle's __del__ (any thread): list.append is atomic; sent with a batch."""
        self.freed.append(tid)

    def flush(self) -> None:
        if not self.pending and len(self.freed) < 64:
            return
        ops, self.pending = self.pending, []
        freed, self.freed = self.freed, []
        st = self.group.state
        if st.stopped:
            return
        try:
            self.group.workers.run.broadcast(ops, freed)
        except (SupervisionError, MeshGoneError) as e:
            raise TensorOpError(f"tensor ops on mesh '{st.name}' cannot run: {_first_line(e)}. Tensor ops need "
                                "every rank: mesh.respawn() forms a new group, then make the tensors again") from None

    # ---------------------------------------------------------------- fetching
    def fetch_future(self, tid: int | None, what: str, rank: int | None) -> Future:
        """Ask every rank (so failures anywhere surface), keep the answer of ``rank``
        (None: every rank's answer, as a list by rank)."""
        self.flush()
        rt = runtime()
        inner = self.group.workers.fetch.call(tid, what, rank)
        out: Future = Future(f"fetch from mesh '{self.name}'")
        out.set_waiter(rt.wait_for)

        def done(f: Future):
            try:
                values = list(f.get().values())
            except SupervisionError as e:
                out.set_exception(TensorOpError(f"fetch from mesh '{self.name}': {_first_line(e)}"))
                return
            except BaseException as e:
                out.set_exception(e)
                return
            err = failure_error(values)
            if err is not None:
                out.set_exception(err)
            else:
                out.set_result(values if rank is None else values[rank])

        inner.add_done_callback(done)
        return out

    def fetch(self, tid: int | None, what: str, rank: int | None = 0, timeout: float | None = None):
        fut = self.fetch_future(tid, what, rank)
        return fut.get(timeout if timeout is not None else self.group.timeout_s + 30)


def failure_error(values: list) -> TensorOpError | None:
    """The grouped error of failed ops in a fetch's answers (worker.TensorOpFailed), or None."""
    from .worker import TensorOpFailed

    groups: dict[tuple, list[int]] = {}
    for rank, v in enumerate(values):
        if isinstance(v, TensorOpFailed):
            for f in v.failures:
                groups.setdefault((f.label, f.exc_type, f.text), []).append(rank)
    if not groups:
        return None
    parts = []
    for (label, exc_type, text), ranks in groups.items():
        parts.append(f"{label_text(label)} failed on {_ranks(ranks)}: {exc_type}: {text}")
    return TensorOpError("\n".join(parts) + "\nTensors computed from it fail the same way; the mesh is still usable")


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ",".join(map(str, ranks))


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def issued_at() -> tuple:
    """Where the user issued an op: (file, line) of the first frame outside this package.
    Kept raw (formatting costs more than the op's dispatch); see ``label_text``."""
    f = sys._getframe(2)
    while f is not None and f.f_globals.get("__name__", "").startswith("monarch_kernel.tensor"):
        f = f.f_back
    return ("", 0) if f is None else (f.f_code.co_filename, f.f_lineno)


def label_text(label) -> str:
    """``(op name, file, line)`` -> "`matmul` (train.py:12)" / "(line 3 of a notebook cell)"."""
    if isinstance(label, str):
        return label
    name, filename, line = label
    if not filename:
        return f"`{name}`"
    if filename.startswith("<ipython-input-") or "/ipykernel_" in filename:
        return f"`{name}` (line {line} of a notebook cell)"
    return f"`{name}` ({os.path.basename(filename)}:{line})"
