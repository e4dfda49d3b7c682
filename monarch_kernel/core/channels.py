"""Ports and channels (Monarch's low-level messaging): ``Port``, ``PortReceiver``,
``Channel.open()``, and the helpers built on them (``Accumulator``).

A Port is a picklable address a value can be sent to from any thread, actor or process:
either a channel's receiver (``Channel.open()``), or the caller waiting on one member's
reply to a call (what an ``@endpoint(explicit_response_port=True)`` method receives, so
it can answer later, from another thread, or hand the port to another actor). Sending
goes straight to the receiving process's inbox, signed with a key the port carries; the
receiving runtime's ``"port"`` handler (installed here) queues the value for ``recv()``.
"""
from __future__ import annotations

import collections
import itertools
import threading
import weakref
from typing import Any, Callable, Generic, TypeVar

from .future import Future
from .messages import PortMessage, Reply
from .runtime import runtime

R = TypeVar("R")
A = TypeVar("A")

_receivers: dict[int, PortReceiver] = {}
_ids = itertools.count(1)
_lock = threading.Lock()


class Port(Generic[R]):
    """Send values (``send``) or an error (``exception``) to whoever holds the other end.

    ``target`` is ``("ch", port id)`` for a channel, or ``("r", call id, member key)`` for a
    reply to a call (that member's part of it, once)."""

    __slots__ = ("_contact", "_key", "_target", "_used")

    def __init__(self, contact, key: bytes, target: tuple):
        self._contact, self._key, self._target = contact, key, target
        self._used = False

    def __reduce__(self):
        return (Port, (self._contact, self._key, self._target))

    def send(self, obj: R) -> None:
        """Deliver ``obj`` (fire and forget, in order from one sender)."""
        self._post(True, obj)

    def exception(self, obj: BaseException) -> None:
        """Deliver an error: the receiver's ``recv()`` (or the caller's ``get()``) raises it."""
        self._post(False, obj)

    def _post(self, ok: bool, value, rank=None) -> None:
        rt = runtime()
        target = self._target
        if target[0] == "r":
            if self._used:
                raise RuntimeError("this response port was already answered: a call gets one reply per "
                                   "member (open a Channel to send several values)")
            self._used = True
            msg = Reply.make(target[1], target[2], ok, value)
        else:
            msg = PortMessage.make(target[1], ok, value, _sender_rank() if rank is None else rank)
        addr = rt.learn_contact(self._contact)
        try:
            frames = rt.pack(self._key, msg, (addr,))
        except Exception as e:
            raise TypeError(f"the value sent on the port ({type(value).__name__}) cannot be pickled: {e}. "
                            "Send plain data, tensors or picklable objects") from None
        rt.send_frames(addr, frames)

    def __repr__(self):
        kind = "reply" if self._target[0] == "r" else "channel"
        return f"<Port ({kind})>"


def _sender_rank():
    """The sending actor's rank in its mesh (None from the controller or outside actors)."""
    from .context import _CTX

    ctx = _CTX.get()
    return ctx.actor_instance.rank.rank if ctx is not None else None


class PortReceiver(Generic[R]):
    """The receiving end of a channel; ``recv()`` is a Future of the next value (of
    ``(sender's rank, value)`` for a receiver from ``Channel.open_ranked()``)."""

    def __init__(self, port_id: int, ranked: bool = False):
        self._id = port_id
        self._ranked = ranked
        self._items: collections.deque = collections.deque()
        self._waiting: collections.deque = collections.deque()
        self._lock = threading.Lock()

    def recv(self) -> Future[R]:
        fut: Future = Future("channel recv")
        fut.set_waiter(runtime().wait_for)   # a thread blocked in get() reads the inbox itself
        with self._lock:
            if not self._items:
                self._waiting.append(fut)
                return fut
            ok, value = self._items.popleft()
        (fut.set_result if ok else fut.set_exception)(value)
        return fut

    def _deliver(self, ok: bool, value, rank=None) -> None:
        if ok and self._ranked:
            value = (rank, value)
        with self._lock:
            if not self._waiting:
                self._items.append((ok, value))
                return
            fut = self._waiting.popleft()
        (fut.set_result if ok else fut.set_exception)(value)

    def close(self) -> None:
        """Stop receiving (values sent later are dropped)."""
        _receivers.pop(self._id, None)


class Channel(Generic[R]):
    """``port, receiver = Channel.open()``: a Port to hand out, and its receiver here."""

    @staticmethod
    def open(once: bool = False) -> tuple[Port[R], PortReceiver[R]]:
        rt = runtime()
        _install(rt)
        pid = next(_ids)
        recv: PortReceiver = PortReceiver(pid)
        _receivers[pid] = recv
        return Port(rt.contact, _port_key(rt), ("ch", pid)), recv

    @staticmethod
    def open_ranked(once: bool = False) -> tuple[Port[R], PortReceiver]:
        """As ``open()``, but ``recv()`` gives ``(rank, value)``: the rank of the actor that
        sent it (None when the controller did)."""
        port, recv = Channel.open(once)
        recv._ranked = True
        return port, recv


def reply_port(reply_to, key: bytes, call_id, member_key: str) -> Port:
    """The Port an explicit-response endpoint answers its caller with."""
    return Port(reply_to, key, ("r", call_id, member_key))


def _port_key(rt) -> bytes:
    """This process's key for its channels (trusted by its own keyring; senders learn it
    from the Port they hold)."""
    key = _channel_keys.get(rt)
    if key is None:
        with _lock:
            key = _channel_keys.get(rt)
            if key is None:
                import secrets

                key = secrets.token_bytes(32)
                rt.keyring.add(key)
                _channel_keys[rt] = key
    return key


_channel_keys: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # runtime -> its channel key


def _install(rt) -> None:
    rt.on_message(PortMessage.KIND, _on_port)


def _on_port(msg) -> None:
    m = PortMessage.of(msg)
    recv = _receivers.get(m.port_id)
    if recv is not None:
        recv._deliver(m.ok, m.value, m.sender_rank)


def chained(inner: Future, fn: Callable[[Any], Any], what: str) -> Future:
    """A Future of ``fn(inner's value)`` (inner's error passes through)."""
    out: Future = Future(what)

    def done(f: Future):
        try:
            out.set_result(fn(f.get()))
        except BaseException as e:
            out.set_exception(e)

    if inner.waiter is not None:
        out.set_waiter(lambda _f, timeout: inner.waiter(inner, timeout) if not inner.done() else None)
    inner.add_done_callback(done)
    return out


class Accumulator(Generic[R, A]):
    """Fold the replies of every member of an endpoint's mesh:
    ``Accumulator(counters.value, 0, lambda acc, v: acc + v).accumulate()`` is a Future."""

    def __init__(self, endpoint, identity: A, combine: Callable[[A, R], A]):
        self._endpoint, self._identity, self._combine = endpoint, identity, combine

    def accumulate(self, *args, **kwargs) -> Future[A]:
        def fold(values):
            acc = self._identity
            for v in values.values():
                acc = self._combine(acc, v)
            return acc

        return chained(self._endpoint.call(*args, **kwargs), fold, f"accumulate {self._endpoint._name}")

