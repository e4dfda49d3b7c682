"""Wire messages are named in one module (core/messages.py) and still travel as plain tuples."""
from __future__ import annotations

import importlib
import pickle
from typing import NamedTuple

import pytest

from monarch_kernel.core import messages, wire
from monarch_kernel.core.messages import KINDS, Call, Reply, StopActor, Unhandled


def _sample(cls):
    required = [n for n in cls._fields[1:] if n not in cls._field_defaults]
    return {n: f"<{n}>" for n in required}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_message_is_a_plain_tuple_on_the_wire_and_reads_back_by_name(kind):
    cls = KINDS[kind]
    fields = _sample(cls)
    msg = cls.make(**fields)
    assert type(msg) is tuple and msg[0] == kind
    back = pickle.loads(wire.dumps(msg)[0])
    assert type(back) is tuple and back == msg           # receivers check type(msg) is tuple
    named = cls.of(back)
    for name, value in fields.items():
        assert getattr(named, name) == value
    # The same bytes as the literal tuple it replaced: naming costs nothing on the wire.
    assert wire.dumps(msg)[0] == wire.dumps(tuple(msg))[0]


def test_a_message_from_a_peer_without_the_newest_fields_reads_with_their_defaults():
    old = ("unhandled", ValueError("x"))                  # a proc that sends no seen / mesh_id
    m = Unhandled.of(old)
    assert (m.seen, m.mesh_id) == (False, None) and isinstance(m.error, ValueError)
    m = StopActor.of(("stop_actor", "a1"))
    assert (m.actor_id, m.reason, m.call_id) == ("a1", "stopped", 0)
    assert Reply.of(("r", 1, "k", True, None, "a field from a newer peer")).value is None
    with pytest.raises(ValueError, match="'r' message needs at least 5 fields"):
        Reply.of(("r", 1))


def test_adding_a_field_is_one_declaration():
    @messages.message("test_grown")
    class Grown(NamedTuple):
        kind: str
        a: int
        b: str = "new"     # the field added later, with its default

    try:
        assert Grown.make(1) == ("test_grown", 1, "new")
        assert Grown.of(Grown.make(1, b="x")).b == "x"
        assert Grown.of(("test_grown", 1)).b == "new"
        with pytest.raises(ValueError, match="declared twice"):
            messages.message("test_grown")(Grown)
    finally:
        KINDS.pop("test_grown")


def test_the_hot_paths_unpack_call_and_reply_in_this_field_order():
    # endpoint.py (_send) builds Call as a literal and node/proc.py (do_call) unpacks it;
    # node/proc.py (_reply) builds Reply as a literal and core/calls.py (on_result) unpacks
    # it: no call per message on the path every call takes. Change them with these fields.
    assert Call._fields == ("kind", "actor_id", "method", "args", "kwargs", "reply_to", "call_id", "sources")
    assert Reply._fields == ("kind", "call_id", "key", "ok", "value")


def test_every_kind_names_a_handler_that_exists():
    assert set(messages.HANDLERS) == set(KINDS)
    for kind, where in messages.HANDLERS.items():
        module, _, qual = where.partition(":")
        obj = importlib.import_module(module)
        for part in qual.split("."):
            obj = getattr(obj, part)   # AttributeError names the stale entry
        assert callable(obj), kind
