"""A progress line while a cell runs on many ranks, and a one-line summary after.

On 256 ranks a cell that takes a while says nothing until its slowest rank answers; the
progress line (``[on_mesh] 250/256 ranks done, 6 running, 0 failed, 3.2 s``) is one
display, updated in place while the cell runs (``output.CellCapture.poll``), and replaced by
the summary when it ends, so a saved notebook keeps one line. Cells on fewer than
``MONARCH_KERNEL_PROGRESS_RANKS`` (8) ranks show neither: their output already
names every rank.
"""
from __future__ import annotations

import time
import uuid

from monarch_kernel.core.mesh import state_of

SHOW_AFTER_S = 1.0    # a cell quicker than this shows only the summary
EVERY_S = 0.5


class CellProgress:
    def __init__(self, run, router, parent):
        self.run, self.router, self.parent = run, router, parent
        self.display_id: str | None = None
        self.last = 0.0

    def tick(self) -> None:
        now = time.monotonic()
        if now - self.run.started < SHOW_AFTER_S or now - self.last < EVERY_S:
            return
        self.last = now
        done, running, failed = self.counts()
        n = len(self.run.ranks)
        self._show(f"[on_mesh] {done}/{n} ranks done, {running} running, {failed} failed, "
                   f"{now - self.run.started:.1f} s")

    def finish(self) -> None:
        done, running, failed = self.counts()
        n = len(self.run.ranks)
        took = time.monotonic() - self.run.started
        extra = f", {running} did not finish" if running else ""
        self._show(f"[on_mesh] {n} ranks: {done - failed} ok, {failed} failed{extra}, {took:.2f} s")

    def _show(self, text: str) -> None:
        update = self.display_id is not None
        if not update:
            self.display_id = uuid.uuid4().hex
        self.router.publish({"text/plain": text}, {"monarch_kernel": {"progress": True}}, self.parent,
                            self.display_id, update=update)

    def counts(self) -> tuple[int, int, int]:
        """(ranks that answered, ranks still running, ranks that failed: raised or died)."""
        from ..core.errors import ActorError
        from ..core.runtime import runtime
        from ..node.cells import CellFailure
        from .on_mesh import any_failed

        rt = runtime()
        fut, n = self.run.future, len(self.run.ranks)
        answered: list[tuple[bool, object]] | None = None
        if fut.done():
            err = fut.exception(0)
            values = fut.get(0).values() if err is None else (
                err.results.values() if getattr(err, "results", None) is not None else None)
            if values is not None:   # every rank answered: count the failed ones, if any
                failed = sum(1 for v in values if isinstance(v, (CellFailure, ActorError))) \
                    if any_failed(values) else 0
                return n, 0, failed
        else:
            answered = rt.answered_so_far(fut)
        procs = state_of(self.run.procs).procs
        dead = {r for r in self.run.ranks if procs[r].key in rt.dead}
        if answered is None:   # a proc died and took the call's results with it
            return n, 0, len(dead)
        done = sum(1 for a, _ in answered if a)
        failed = sum(1 for a, v in answered if a and isinstance(v, (CellFailure, ActorError)))
        lost = sum(1 for r, (a, _) in zip(self.run.ranks, answered) if not a and r in dead)
        return done + lost, n - done - lost, failed + lost
