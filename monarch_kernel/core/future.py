"""Future: the result of a call to the mesh, resolved by the runtime's I/O thread.

From sync code: ``fut.get()`` (or ``fut.get(timeout=5)``; a timeout leaves the call
running and a later ``get`` still returns). From async code: ``await fut``; waiting never
blocks the event loop (the I/O thread wakes it with ``call_soon_threadsafe``).
"""
from __future__ import annotations

import asyncio
import threading
from typing import Any, Callable, Generic, NamedTuple, TypeVar, Union

T = TypeVar("T")


class _Pending(NamedTuple):
    pass


class _Complete(NamedTuple):
    value: Any


class _Failed(NamedTuple):
    error: BaseException


_State = Union[_Pending, _Complete, _Failed]
_PENDING = _Pending()
_new_state = tuple.__new__
_Lock = threading.Lock


# What a timed-out future still waits for, in words (``"; rank 1 of mesh 'm' has not answered
# ..."``): core/runtime.py installs it (the words are core/calls.py's, which knows a call's
# members); a future that is not a call gets none. Called only when a CallTimeout is read.
_waiting_for = None


def describe_waits_with(fn) -> None:
    """``fn(future) -> str``, appended to a TimeoutError's message (or None: nothing)."""
    global _waiting_for
    _waiting_for = fn


class CallTimeout(TimeoutError):
    """``get(timeout)`` ran out. Its words (which members a call still waits for) are made
    when it is first read, not when it is raised: code that polls with short timeouts (a
    cell's wait, ``states()``) raises and catches many and reads none."""

    def __init__(self, fut: Future, timeout):
        super().__init__(self._words(fut, timeout, ""))
        self._fut, self._timeout, self._text = fut, timeout, None

    @staticmethod
    def _words(fut: Future, timeout, waiting: str) -> str:
        return f"{fut.what} did not finish within {timeout} s{waiting}; it is still running: get() again to wait more"

    def __str__(self) -> str:
        if self._text is None:
            waiting = ""
            if _waiting_for is not None:
                try:
                    waiting = _waiting_for(self._fut)
                except Exception:   # (words for a message: never what fails)
                    waiting = ""
            self._text = self._words(self._fut, self._timeout, waiting)
            self._fut = None   # (read once: the future need not live as long as the error)
        return self._text

    def __reduce__(self):   # sent from an actor to its caller: a TimeoutError with these words
        return TimeoutError, (str(self),)


class Future(Generic[T]):
    __slots__ = ("_state", "_lock", "_cond", "_callbacks", "_what", "_waiter")

    def __init__(self, what: str = "call", waiter: Callable[[Future, float | None], None] | None = None):
        self._state: _State = _PENDING
        self._lock = _Lock()
        self._cond: threading.Condition | None = None
        self._callbacks: list | None = None
        self._what = what
        # Set by the runtime: lets a thread blocked in get() receive its own replies
        # instead of being woken by the I/O thread (one thread hop less per call).
        self._waiter = waiter

    # -- resolving (runtime side) -------------------------------------------------------
    def _resolve(self, state: _State) -> bool:
        with self._lock:
            if self._state is not _PENDING:
                return False
            self._state = state
            cond, callbacks = self._cond, self._callbacks
            if callbacks is not None:
                self._callbacks = None
            if cond is not None:
                with cond:
                    cond.notify_all()
        if callbacks is not None:
            for cb in callbacks:
                cb(self)
        return True

    def set_result(self, value) -> bool:
        return self._resolve(_new_state(_Complete, (value,)))   # _Complete(value), without its Python __new__

    def set_exception(self, error: BaseException) -> bool:
        return self._resolve(_new_state(_Failed, (error,)))

    # -- waiting (user side) --------------------------------------------------------------
    def done(self) -> bool:
        return self._state is not _PENDING

    def get(self, timeout: float | None = None) -> T:
        """Block until the result is in (or ``timeout`` seconds pass: TimeoutError)."""
        state = self._state
        if state is _PENDING and self._waiter is not None:
            self._waiter(self, timeout)
            state = self._state
        if state is _PENDING:
            with self._lock:
                if self._state is _PENDING:
                    if self._cond is None:
                        self._cond = threading.Condition(threading.Lock())
                    cond = self._cond
                    cond.acquire()
                else:
                    cond = None
            if cond is not None:
                try:
                    while self._state is _PENDING:
                        if not cond.wait(timeout):
                            raise self.timeout_error(timeout)
                finally:
                    cond.release()
            state = self._state
        if type(state) is _Complete:
            return state.value
        raise state.error

    result = get

    # -------------------------------------------------------------- for the runtime (core)
    @property
    def what(self) -> str:
        """What this future is of (``call of trainers.step``), for messages."""
        return self._what

    @property
    def waiter(self):
        return self._waiter

    def set_waiter(self, waiter) -> None:
        """``waiter(future, timeout)``: what ``get`` calls on a pending future first (the
        runtime reads its inbox there, see core/inbox.py)."""
        self._waiter = waiter

    def timeout_error(self, timeout) -> TimeoutError:
        return CallTimeout(self, timeout)

    def wait_briefly(self, seconds: float) -> None:
        """Block up to ``seconds`` for a resolution by another thread."""
        with self._lock:
            if self._state is not _PENDING:
                return
            if self._cond is None:
                self._cond = threading.Condition(threading.Lock())
            cond = self._cond
            cond.acquire()
        try:
            if self._state is _PENDING:
                cond.wait(seconds)
        finally:
            cond.release()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        try:
            self.get(timeout)
        except TimeoutError:
            raise
        except BaseException as e:
            return e
        return None

    def add_done_callback(self, fn: Callable[[Future], None]) -> None:
        """``fn(fut)`` runs once resolved (on the I/O thread: keep it short)."""
        with self._lock:
            if self._state is _PENDING:
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(fn)
                return
        fn(self)

    def __await__(self):
        if self._state is _PENDING:
            loop = asyncio.get_running_loop()
            af = loop.create_future()

            def wake(_):
                loop.call_soon_threadsafe(lambda: af.done() or af.set_result(None))

            self.add_done_callback(wake)
            yield from af.__await__()
        return self.get()

    def __repr__(self):
        s = self._state
        if s is _PENDING:
            return f"<Future {self._what}: pending>"
        if type(s) is _Complete:
            return f"<Future {self._what}: done, {_short(s.value)}>"
        return f"<Future {self._what}: failed, {type(s.error).__name__}>"

    def _repr_html_(self):
        import html

        return f"<code>{html.escape(repr(self))}</code>"


def _short(v, n=60):
    r = repr(v)
    return r if len(r) <= n else r[: n - 3] + "..."
