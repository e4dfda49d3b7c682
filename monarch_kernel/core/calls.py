"""Calls in flight and procs known dead: the two halves of "a failure is never silent".

A call to N members is one ``PendingCall``; replies (``Calls.on_result``) and deaths
(``Calls.proc_failed``) both answer members of it, so a dead proc fails the futures
waiting on it at once, with the rank, host and why. Failures nobody handled wait in
``unhandled`` and surface at the controller's next interaction. Runs on whichever thread
reads the inbox (see inbox.py); ``proc_failed`` may also be called from any thread.
"""
from __future__ import annotations

import collections
import itertools
import logging
import threading
from itertools import compress, repeat
from operator import sub
from typing import Callable

from .errors import ActorError, MeshFailure, SupervisionError
from .future import Future
from .mesh_tables import ranges
from .values import ValueMesh

log = logging.getLogger("monarch_kernel")
LATE_REPLY_S = 5.0   # a dead proc's reply announced by its agent (fan-in) fails if not here by then


class PendingCall:
    """Collects the replies of one call. ``mode``: 'mesh' -> ValueMesh, 'one' -> value,
    'stream' -> items pushed to ``queue`` as they arrive."""

    __slots__ = ("future", "keys", "index", "results", "failed", "remaining", "extent", "mode",
                 "queue", "what", "answered", "counted", "parts")

    def __init__(self, keys: list[str], extent, mode: str, what: str, index: dict | None = None):
        self.future = Future(what)
        self.keys = keys
        self.index = dict(zip(keys, range(len(keys)))) if index is None else index   # read only
        self.results = [None] * len(keys)
        self.answered = bytearray(len(keys))   # 1 where that member replied (a value may be None)
        self.failed: list[int] = []
        self.remaining = len(keys)
        self.extent = extent
        self.mode = mode
        self.queue = None
        self.what = what
        self.counted = True   # in Calls.outstanding's counter (a big call is counted on demand)
        self.parts: dict | None = None   # a fanned call: each host's first key -> its members' places
        if mode == "stream":
            import queue

            self.queue = queue.SimpleQueue()

    def deliver(self, key: str, ok: bool, value) -> bool:
        """Record one member's reply; True once every member has answered (or died)."""
        i = self.index.get(key)
        if i is None or self.answered[i]:
            return False   # unknown, or already answered (a death after its reply changes nothing)
        self.results[i] = value
        self.answered[i] = 1
        self.remaining -= 1
        if not ok:
            self.failed.append(i)
            if isinstance(value, SupervisionError) and not self.future.done():
                # A dead member fails the whole call now, not when the others finish; their
                # replies are still recorded (a cell keeps their values, see answered_so_far).
                if self.queue is not None:
                    self.queue.put((False, value))
                    self.queue.put(None)
                self.future.set_exception(value)
                return self.remaining <= 0
        if self.future.done():
            return self.remaining <= 0   # failed earlier by a death: only recorded
        if self.queue is not None:
            self.queue.put((ok, value))
        if self.remaining:
            return False
        self._finish()
        return True

    def deliver_many(self, replies: list) -> bool:
        """Record a batch of replies ``(call_id, key, ok, value)`` of this call (one host's
        fan-in batch): the same outcome as ``deliver`` of each in order, with one pass and
        the future resolved (its waiter woken) once. True once every member has answered."""
        index, answered, results, queue = self.index, self.answered, self.results, self.queue
        done = self.future.done()
        n = 0
        for _, key, ok, value in replies:
            i = index.get(key)
            if i is None or answered[i]:
                continue
            results[i] = value
            answered[i] = 1
            n += 1
            if ok:
                if queue is not None and not done:
                    queue.put((True, value))
                continue
            self.failed.append(i)
            if done:
                continue
            if isinstance(value, SupervisionError):
                self.remaining -= n
                n = 0
                if queue is not None:
                    queue.put((False, value))
                    queue.put(None)
                self.future.set_exception(value)
                done = True
            elif queue is not None:
                queue.put((False, value))
        self.remaining -= n
        if self.remaining > 0:
            return False
        if not self.future.done():   # (a death on another thread may have failed it meanwhile)
            self._finish()
        return True

    def deliver_none_run(self, keys: list) -> bool:
        """Replies of ``keys``, every one ok and ``None`` (a fan-in batch's columnar run):
        ``deliver_many``'s outcome with C-level maps instead of a loop per member (results
        start as None). True once every member has answered."""
        answered = self.answered
        try:
            idx = list(map(self.index.__getitem__, keys))
        except KeyError:
            idx = None
        if idx is None or any(map(answered.__getitem__, idx)):   # unknown or repeated: one by one
            return self.deliver_many([(0, k, True, None) for k in keys])
        list(map(answered.__setitem__, idx, repeat(1, len(idx))))
        return self._answered_alike(len(idx), None)

    def _answered_alike(self, count: int, value) -> bool:
        """``count`` more members answered ``value`` (already marked and stored): streamed,
        counted, and the call finished once every member has answered (True then)."""
        self.remaining -= count
        done = self.future.done()
        if self.queue is not None and not done:
            for _ in range(count):
                self.queue.put((True, value))
        if self.remaining > 0:
            return False
        if not done:
            self._finish()
        return True

    def deliver_mask(self, part, mask: bytes, ok: bool, value, values: list | None = None) -> bool:
        """Replies of one host's members, all ``value`` (a fan-in summary, node/fantree.py):
        ``part`` is that host's first place in ``keys`` (its members adjacent) or its keys,
        ``mask`` a byte per member of it, 1 where it answered. The usual case (adjacent,
        none answered yet, a plain value shared by all) is a few C-level steps for any
        number of members; ``values`` (one per answer: not plain, so not shared) and the
        rest go through ``deliver_many``. True once every member has answered."""
        n = len(mask)
        if type(part) is int:
            stop = part + n
            answered = self.answered
            seen, got = int.from_bytes(answered[part:stop], "little"), int.from_bytes(mask, "little")
            if ok and values is None and stop <= len(answered) and not seen & got:
                answered[part:stop] = (seen | got).to_bytes(n, "little")
                count = mask.count(1)
                if value is not None:
                    list(map(self.results.__setitem__, compress(range(part, stop), mask), repeat(value, count)))
                return self._answered_alike(count, value)
            part = self.keys[part:stop]
        return self.deliver_many(list(zip(repeat(0), compress(part, mask), repeat(ok), values or repeat(value))))

    def _finish(self):
        if self.mode == "one":
            if self.failed:
                self.future.set_exception(self.results[0])
            else:
                self.future.set_result(self.results[0])
            return
        mesh = ValueMesh(self.extent, self.results)
        if self.failed:
            first = self.results[min(self.failed)]
            if isinstance(first, ActorError):
                first.results = mesh
            self.future.set_exception(first)
        else:
            self.future.set_result(mesh)
        if self.queue is not None:
            self.queue.put(None)


class OneCall(Future):
    """A call to a single member (``call_one``, ``choose``): PendingCall's behaviour for one
    key without its per-member tables, and its own Future (the hot path of the reference
    workload: one object a call). The tables are there, made on demand, for the rare reader
    (answered_so_far, a death)."""

    __slots__ = ("key", "replied", "value", "ok")
    mode = "one"
    counted = True
    queue = None
    extent = None

    def __init__(self, key: str, what: str, waiter):
        super().__init__(what, waiter)
        self.key = key
        self.replied = False
        self.value = None
        self.ok = True

    @property
    def future(self) -> Future:
        return self

    def deliver(self, key: str, ok: bool, value) -> bool:
        """Record the member's reply (or death); True once answered (the first answer wins)."""
        if self.replied or key != self.key:
            return False
        self.replied, self.value, self.ok = True, value, ok
        if ok:
            self.set_result(value)
        else:
            self.set_exception(value)
        return True

    def deliver_many(self, replies: list) -> bool:
        for _, key, ok, value in replies:
            self.deliver(key, ok, value)
        return self.replied

    @property
    def keys(self) -> list:
        return [self.key]

    @property
    def index(self) -> dict:
        return {self.key: 0}

    @property
    def results(self) -> list:
        return [self.value]

    @property
    def answered(self) -> bytearray:
        return bytearray((1 if self.replied else 0,))

    @property
    def failed(self) -> list:
        return [] if self.ok else [0]

    @property
    def remaining(self) -> int:
        return 0 if self.replied else 1


class Calls:
    """Pending calls by id, how many calls each proc owes (``outstanding``, for choose()),
    the dead procs and their errors, and the failures still to surface."""

    def __init__(self, waiter: Callable, wake_reader: Callable[[], None]):
        self._pending: dict[int, PendingCall] = {}
        self._ids = itertools.count(1)
        self._waiter = waiter            # Future.get waits through it (Inbox.wait_for)
        self._wake_reader = wake_reader  # a thread blocked on the inbox must re-check its future
        self.outstanding = Outstanding(self)
        self._big: dict[int, PendingCall] = {}   # calls of BIG members or more: not in the counter
        self._indexes: dict[tuple, tuple] = {}   # recent big calls' members -> their index (shared)
        self._parts: tuple | None = None   # the last set_parts (hosts, keys, parts): a loop of calls shares it
        self.dead: dict[str, SupervisionError] = {}
        self.death_listeners: list[Callable[[str, SupervisionError], None]] = []
        self.replied_before_death: dict[str, set] = {}   # proc -> calls whose reply is on its way
        self._unhandled: list[BaseException] = []
        self._unhandled_lock = threading.Lock()   # queue (I/O thread) vs consume (user thread)

    def new_call(self, keys: list[str], extent, mode: str, what: str) -> tuple[int, PendingCall]:
        call_id = next(self._ids)
        index = None
        if len(keys) >= BIG:   # the same members as a recent call: share its index (256: ~25 µs to build)
            known = self._indexes.get((len(keys), keys[0], keys[-1]))
            if known is not None and known[0] == keys:
                index = known[1]
        p = PendingCall(keys, extent, mode, what, index)
        if index is None and len(keys) >= BIG:
            if len(self._indexes) >= 64:
                self._indexes.clear()
            self._indexes[(len(keys), keys[0], keys[-1])] = (keys, p.index)
        p.future.set_waiter(self._waiter)
        self._pending[call_id] = p
        if len(keys) >= BIG:
            # Counted when choose() asks (Outstanding), not +1 and -1 per member per call: at 256
            # members that was ~0.1 ms of the controller's CPU a call to all.
            p.counted = False
            big = self._big
            if len(big) >= 64:
                for old in [i for i in big if i not in self._pending]:
                    del big[old]
            big[call_id] = p
            return call_id, p
        out = self.outstanding.counter
        for k in keys:
            out[k] += 1
        return call_id, p

    def new_one(self, key: str, what: str) -> tuple[int, OneCall]:
        """``new_call([key], ..., "one", what)`` for a single member, with less to set up."""
        call_id = next(self._ids)
        p = self._pending[call_id] = OneCall(key, what, self._waiter)
        self.outstanding.counter[key] += 1
        return call_id, p

    def pending_count(self) -> int:
        """How many calls still wait for a member (tests check nothing is left behind)."""
        return len(self._pending)

    def pending_of(self, fut: Future) -> PendingCall | None:
        """The PendingCall behind a call's future (while it has members to hear from)."""
        for p in list(self._pending.values()):
            if p.future is fut:
                return p
        return None

    def waiting_for(self, fut: Future, where: Callable[[set], dict]) -> str:
        """For a timed-out call: the members it still waits for, as ranks of their meshes
        (``where(keys)``: key -> (mesh name, rank)), or "" when it is not a call."""
        p = self.pending_of(fut)
        if p is None:
            return ""
        keys, answered = p.keys, p.answered
        missing = {k for k, a in zip(keys, answered) if not a}
        if not missing:
            return ""
        by_mesh: dict[str, list[int]] = {}
        for mesh, rank in where(missing).values():
            by_mesh.setdefault(mesh, []).append(rank)
        if not by_mesh:
            return ""
        parts = [f"{'rank' if len(r) == 1 else 'ranks'} {ranges(r)} of mesh '{mesh}'" for mesh, r in by_mesh.items()]
        n = len(missing)
        return (f"; {' and '.join(parts)} {'has' if n == 1 else 'have'} not answered ({len(keys) - n} of "
                f"{len(keys)} have; the ProcMesh's `states()` says what each is doing, or why it does not answer)")

    def answered_so_far(self, fut: Future) -> list | None:
        """For a call still pending: per member, (True, value) if it replied, else (False,
        None). Lets a caller that gives up keep what the members that did answer returned."""
        p = self.pending_of(fut)
        return None if p is None else [(bool(a), v) for a, v in zip(p.answered, p.results)]

    def abandon(self, call_id: int) -> None:
        p = self._pending.pop(call_id, None)
        if p is not None and p.counted:
            out = self.outstanding.counter
            for k in p.keys:
                out[k] -= 1

    def on_result(self, msg) -> None:
        _, call_id, key, ok, value = msg   # messages.Reply, in field order (the hot path of every call)
        p = self._pending.get(call_id)
        if p is None:
            return
        if p.counted:
            self.outstanding.counter[key] -= 1
        if p.deliver(key, ok, value):
            self._pending.pop(call_id, None)

    def on_replies(self, msg) -> None:
        """messages.Replies: one proc's answers to several calls, in the order they ran."""
        _, key, items = msg
        pending, answered = self._pending, 0
        it = iter(items)
        for call_id, ok, value in zip(it, it, it):
            p = pending.get(call_id)
            if p is not None:
                if p.counted:   # (a big call is counted on demand: Outstanding)
                    answered += 1
                if p.deliver(key, ok, value):
                    pending.pop(call_id, None)
        if answered:
            self.outstanding.counter[key] -= answered

    def on_results(self, replies: list) -> None:
        """Replies ``(call_id, key, ok, value)`` of one fan-in batch, in arrival order: one
        lookup and one delivery per call rather than per member (core/fanout.py)."""
        pending, out = self._pending, self.outstanding.counter
        start, n = 0, len(replies)
        while start < n:
            call_id = replies[start][0]
            end = start + 1
            while end < n and replies[end][0] == call_id:
                end += 1
            p = pending.get(call_id)
            if p is not None:
                run = replies[start:end] if start or end < n else replies
                if p.counted:
                    for r in run:
                        out[r[1]] -= 1
                if p.deliver_many(run):
                    pending.pop(call_id, None)
            start = end

    def on_none_run(self, call_id: int, keys: list) -> None:
        """A run of one call's replies, all ok and None (core/fanout.py): see deliver_none_run."""
        p = self._pending.get(call_id)
        if p is None:
            return
        if p.counted:
            out = self.outstanding.counter   # out[k] -= 1 for each key, in C (a run's keys are distinct)
            dict.update(out, zip(keys, map(sub, map(out.__getitem__, keys), repeat(1))))
        if p.deliver_none_run(keys):
            self._pending.pop(call_id, None)

    def set_parts(self, call_id: int, hosts: list) -> None:
        """A fanned call's hosts, ``[(their first place in the call or -1, their keys)]``: kept
        per first key as the place (where the keys are there, adjacent) or the keys, for the
        hosts' summaries (``on_summary``)."""
        p = self._pending.get(call_id)
        if p is None or type(p) is not PendingCall:
            return
        keys = p.keys
        kept = self._parts
        if kept is not None and kept[0] is hosts and kept[1] is keys:   # the same send as the last one
            p.parts = kept[2]   # (read only)
        else:
            p.parts = {ks[0]: at if at >= 0 and keys[at:at + len(ks)] == ks else ks for at, ks in hosts}
            self._parts = (hosts, keys, p.parts)

    def on_summary(self, call_id: int, first: str, mask: bytes, ok: bool, value, values=None) -> None:
        """One host's members of a call answered ``value`` (or ``values``, one each), where
        ``mask`` says (core/fanout.py, node/fantree.py ``summarise``)."""
        p = self._pending.get(call_id)
        if p is None:
            return
        part = p.parts.get(first) if type(p) is PendingCall and p.parts else None
        if part is None:
            log.error("a summary of replies to %s from the host of %s, which it was not sent to: dropped",
                      p.what, first)
            return
        if p.counted:   # (small calls only: a big call is counted on demand)
            out = self.outstanding.counter
            for k in compress(p.keys[part:part + len(mask)] if type(part) is int else part, mask):
                out[k] -= 1
        if p.deliver_mask(part, mask, ok, value, values):
            self._pending.pop(call_id, None)

    def summary_replies(self, call_id: int, first: str, mask: bytes, ok: bool, value, values=None) -> list:
        """A summary as replies ``(call_id, key, ok, value)`` (a batch sent again: see unanswered)."""
        p = self._pending.get(call_id)
        part = p.parts.get(first) if type(p) is PendingCall and p.parts else None
        if part is None:
            return []
        keys = p.keys[part:part + len(mask)] if type(part) is int else part
        return list(zip(repeat(call_id), compress(keys, mask), repeat(ok), values or repeat(value)))

    def is_pending(self, call_id: int) -> bool:
        return call_id in self._pending

    def unanswered(self, replies: list) -> list:
        """Of replies ``(call_id, key, ...)`` sent again (a lost relay, core/fanout.py), those
        of pending calls not yet answered by that member."""
        out = []
        for r in replies:
            p = self._pending.get(r[0])
            i = p.index.get(r[1]) if p is not None else None
            if i is not None and not p.answered[i]:
                out.append(r)
        return out

    def whats_pending(self) -> dict[int, str]:
        """id(call) -> what, of every pending call (to report what a lost host failed)."""
        return {id(p): p.what for p in self._pending.values()}

    # ---------------------------------------------------------------- deaths
    def proc_failed(self, key: str, failure: MeshFailure, hint: str = "") -> None:
        """A proc is gone: fail every future waiting on it (any thread)."""
        if key in self.dead:
            return
        err = SupervisionError(failure, hint or "Call respawn() on its ProcMesh to replace it; "
                                                "the other ranks keep their state")
        self.dead[key] = err
        late = self.replied_before_death.pop(key, None)
        for call_id, p in list(self._pending.items()):
            if late and call_id in late:
                continue   # it replied before dying: the reply is on its way through the agents
            if key in p.index and p.deliver(key, False, err):
                self._pending.pop(call_id, None)
        if late:   # ... unless it never comes (lost with its host): then it fails after all
            t = threading.Timer(LATE_REPLY_S, self._fail_late, (key, err, late))
            t.daemon = True
            t.start()
        for fn in list(self.death_listeners):
            try:
                fn(key, err)
            except Exception:
                log.exception("death listener failed")
        self._wake_reader()

    def _fail_late(self, key: str, err: SupervisionError, call_ids: set) -> None:
        for call_id in call_ids:
            p = self._pending.get(call_id)
            if p is not None and key in p.index and p.deliver(key, False, err):
                self._pending.pop(call_id, None)
        self._wake_reader()

    # ---------------------------------------------------------------- unhandled failures
    def raise_unhandled(self) -> None:
        """Unhandled supervision failures surface on the next interaction, once."""
        if self._unhandled:
            with self._unhandled_lock:
                if not self._unhandled:
                    return
                err = self._unhandled.pop(0)
                _mark_surfaced(err)
            raise err

    def has_unhandled(self) -> bool:
        return bool(self._unhandled)

    def unhandled(self) -> list[BaseException]:
        """The failures still to surface (a copy)."""
        return list(self._unhandled)

    def queue_unhandled(self, err: BaseException) -> None:
        """Queue ``err`` for the next interaction, unless the user already saw it: the I/O
        thread may report a failed spawn just after the cell that waited on it showed it."""
        with self._unhandled_lock:
            if not already_surfaced(err):
                self._unhandled.append(err)

    def consume_unhandled(self, err: BaseException) -> None:
        """``err`` is raised to the user now: don't raise it again at the next interaction,
        even if it is queued only after this."""
        with self._unhandled_lock:
            _mark_surfaced(err)
            try:
                self._unhandled.remove(err)
            except ValueError:
                pass


BIG = 16   # members of a call from which it is counted in ``outstanding`` on demand


class Outstanding:
    """How many of our calls each proc has not answered yet (``choose()`` picks the least
    busy): a counter for calls of fewer than BIG members, and the big calls' unanswered
    members counted when asked. Read as a mapping: ``outstanding[key]``, ``.get(key, 0)``."""

    def __init__(self, calls: Calls):
        self.counter: collections.Counter = collections.Counter()
        self._calls = calls

    def get(self, key: str, default: int = 0) -> int:
        n = self.counter.get(key, default)
        calls = self._calls
        pending = calls._pending
        for call_id, p in list(calls._big.items()):
            if call_id not in pending:
                continue
            i = p.index.get(key)
            if i is not None and not p.answered[i]:   # (a death marks its member answered)
                n += 1
        return n

    __getitem__ = get


_SURFACED = "_monarch_kernel_surfaced"


def _mark_surfaced(err: BaseException) -> None:
    try:
        setattr(err, _SURFACED, True)
    except AttributeError:   # an exception type with __slots__: it may be raised twice
        pass


def already_surfaced(err: BaseException | None) -> bool:
    """The user was shown ``err`` already (raised to them, or shown under a cell)."""
    return err is not None and getattr(err, _SURFACED, False)
