"""Every wire message by name: its fields, who sends it, and who handles it.

On the wire a message is a plain tuple ``(kind, field, ...)``: it pickles as cheaply as
the literal tuples it replaced, and a receiver checks ``type(msg) is tuple`` before
anything else. The classes below name the fields; both ends use them:

    frames = rt.pack(key, Reply.make(call_id=7, key=proc_key, ok=True, value=v))  # a plain tuple
    m = Reply.of(msg)            # the same tuple, with names: m.call_id, m.value
    _, call_id, key, ok, value = msg    # unpacking in field order is fine on hot paths

Adding a field is one edit: declare it here, at the end and with a default, so a message
from a peer that does not send it yet still reads (``of`` fills in the default); senders
that build with ``make(name=...)`` and readers that use ``of(msg).name`` pick it up.
``KINDS`` maps each kind to its class; ``HANDLERS`` says which function handles each kind
(tests/test_messages.py checks that every entry exists), so a message can be followed from
its sender to its handler in one look.

Where each kind arrives:
  * a runtime's *inbox* (any process; core/inbox.py): dispatched by ``Runtime.handlers``
    (core kinds below, a role's kinds with ``Runtime.on_message``, features' kinds with
    ``extensions.register_message_kind``);
  * a proc's *work inbox* (its main thread, node/proc.py): ``ProcWorker.do_<kind>``;
  * an agent's ROUTER (node/agent.py): ``Req``, answered with ``Rep``; agent events to a
    controller or proc travel as ``Ev`` and are dispatched by ``Runtime.on_agent_event``.
"""
from __future__ import annotations

from typing import Any, NamedTuple

KINDS: dict[str, type] = {}


def message(kind: str):
    """Register a NamedTuple whose first field is ``kind`` as the message ``kind``, and give
    it ``make`` (fields -> the plain wire tuple) and ``of`` (wire tuple -> named)."""
    return lambda cls: _register(kind, cls)


def _register(kind: str, cls):
    fields = cls._fields
    if fields[0] != "kind":
        raise TypeError(f"{cls.__name__}: the first field of a message is 'kind'")
    if kind in KINDS:
        raise ValueError(f"message kind {kind!r} is declared twice ({KINDS[kind].__name__}, {cls.__name__})")
    names = fields[1:]
    defaults = cls._field_defaults
    required = [n for n in names if n not in defaults]
    if any(n not in defaults for n in names[len(required):]):
        raise TypeError(f"{cls.__name__}: fields with defaults come last")
    params = ", ".join([*required, *(f"{n}=_d_{n}" for n in names[len(required):])])
    ns = {f"_d_{n}": defaults[n] for n in names if n in defaults}
    # A generated function, as collections.namedtuple does: a literal tuple, no loop.
    exec(f"def make({params}):\n    return ({kind!r}, {''.join(n + ', ' for n in names)})", ns)  # noqa: S102
    make = ns["make"]
    make.__qualname__ = f"{cls.__name__}.make"
    make.__doc__ = f"The wire tuple of a {cls.__name__}."
    full = len(fields)
    tail = tuple(defaults.get(n) for n in fields)   # defaults by position (None where required)
    new = tuple.__new__

    def of(msg) -> cls:
        """``msg`` (a wire tuple of this kind) with names; missing trailing fields get their
        defaults (a peer that predates them)."""
        n = len(msg)
        if n == full:
            return new(cls, msg)
        if n < 1 + len(required):
            raise ValueError(f"a {kind!r} message needs at least {1 + len(required)} fields, got {n}")
        return new(cls, msg[:full] + tail[n:])

    cls.make = staticmethod(make)
    cls.of = staticmethod(of)
    cls.KIND = kind
    KINDS[kind] = cls
    return cls


# ============================================================================ to an inbox
@message("r")
class Reply(NamedTuple):
    """A member's answer to a call (proc, or the controller for get_or_spawn_controller ->
    the caller's inbox). ``key``: the member's proc key."""
    kind: str
    call_id: int
    key: str
    ok: bool
    value: Any


@message("rs")
class Replies(NamedTuple):
    """One member's answers to several calls of one caller, in one signed message (proc ->
    the caller's inbox): a proc's main thread holds the plain-value replies of quick calls
    while more calls wait in its work inbox (node/proc.py, ``ProcWorker._hold_reply``).
    ``items``: ``[call_id, ok, value, call_id, ok, value, ...]`` in the order the calls ran."""
    kind: str
    key: str
    items: list


@message("out")
class Output(NamedTuple):
    """Lines a proc printed (proc -> its controller's inbox, its sink)."""
    kind: str
    rank: int
    stream: str   # stdout | stderr | the output limit's "skipped" marker
    text: str


@message("died")
class Died(NamedTuple):
    """A proc died (its agent -> the controller, or a peer's notice -> a proc)."""
    kind: str
    key: str
    failure: Any   # MeshFailure


@message("replaced")
class Replaced(NamedTuple):
    """A dead proc was replaced by respawn() (controller -> every live proc of the mesh)."""
    kind: str
    old_key: str
    ref: Any   # the new ProcRef
    mesh_key: bytes


@message("unhandled")
class Unhandled(NamedTuple):
    """A supervision failure no actor handled (proc -> controller)."""
    kind: str
    error: Any
    seen: bool = False         # an owner already saw it
    mesh_id: str | None = None


@message("wake")
class Wake(NamedTuple):
    """Nothing: makes a thread blocked on the inbox re-check its future (runtime -> itself)."""
    kind: str


@message("port")
class PortMessage(NamedTuple):
    """A value sent to a Port of a Channel (any sender -> the receiver's inbox)."""
    kind: str
    port_id: int
    ok: bool
    value: Any
    sender_rank: Any = None


@message("getctl")
class GetController(NamedTuple):
    """An actor asks for a named singleton (proc -> controller, get_or_spawn_controller)."""
    kind: str
    name: str
    cls: Any
    args: tuple
    kwargs: dict
    contact: Any
    call_id: int
    proc_key: str


@message("interrupt")
class Interrupt(NamedTuple):
    """Stop what the main thread runs (controller -> a proc's runtime inbox)."""
    kind: str
    call: Any   # the (reply_to, call_id) to interrupt, or None for whatever runs


@message("query")
class Query(NamedTuple):
    """What are you doing? (controller -> proc; answered with a Reply)."""
    kind: str
    reply_to: str
    call_id: int


@message("logopt")
class LoggingOption(NamedTuple):
    """ProcMesh.logging_option (controller -> proc; answered with a Reply)."""
    kind: str
    stream_to_client: bool
    aggregate_window_sec: float | None
    level: int
    reply_to: str
    call_id: int


# ============================================================================ to a work inbox
@message("call")
class Call(NamedTuple):
    """Call an endpoint (caller -> each member proc's work inbox; answered with Replies)."""
    kind: str
    actor_id: str
    method: str   # EXPLICIT_PORT_MARK + name for an explicit-response endpoint
    args: tuple
    kwargs: dict
    reply_to: str
    call_id: int   # 0: no reply wanted; a Port: replies go to that port
    sources: Any = None    # cell sources for tracebacks (wire.SOURCES)


@message("spawn")
class Spawn(NamedTuple):
    """Create an actor on each member proc (spawner -> work inbox; answered with Replies)."""
    kind: str
    actor_id: str
    name: str
    body: bytes   # the class and its arguments, pickled
    view: Any   # the actor mesh's MeshView
    reply_to: str
    call_id: int
    owner: Any = None      # a spawning actor's (work address, key, actor id), for __supervise__


@message("stop_actor")
class StopActor(NamedTuple):
    """Stop an actor after what it runs now (controller or the actor itself -> work inbox)."""
    kind: str
    actor_id: str
    reason: str = "stopped"
    reply_to: str = ""
    call_id: int = 0


@message("abort_actor")
class AbortActor(NamedTuple):
    """An actor fails itself (the actor -> its own work inbox)."""
    kind: str
    actor_id: str
    reason: str


@message("kill_actor")
class KillActor(NamedTuple):
    """An actor's endpoint raised an error that ends it (its proc -> its own work inbox)."""
    kind: str
    actor_id: str
    error: Any
    in_call: bool


@message("supervise")
class Supervise(NamedTuple):
    """A child actor failed: its owner's __supervise__ hears of it (proc -> owner's work inbox)."""
    kind: str
    owner: str   # the owner's actor id
    failure: Any
    child: str   # the failed actor's id


@message("exit")
class Exit(NamedTuple):
    """Leave the main loop (the proc -> itself)."""
    kind: str


# ============================================================================ agent links
@message("req")
class Req(NamedTuple):
    """A request to a host agent (controller or proc -> agent); ``req`` 0: no reply wanted."""
    kind: str
    req: int
    op: str   # AgentLoop.op_<op> handles it
    args: tuple


@message("rep")
class Rep(NamedTuple):
    """An agent's answer to a Req (agent -> the requester's DEALER)."""
    kind: str
    req: int
    ok: bool
    value: Any


@message("ev")
class Ev(NamedTuple):
    """An agent's event (agent -> controller or proc): ``Ev.make(name, args)`` is sent as
    ``("ev", name, *args)``; Runtime.on_agent_event(name, fn) gets ``fn(link, *args)``."""
    kind: str
    name: str


# ============================================================================ fan-out (core/fanout.py, node/fanout.py)
@message("fan")
class Fan(NamedTuple):
    """One call, spawn or broadcast for many procs of a host (controller -> the agent's fan
    inbox); the agent stamps the inner message for each proc's work inbox."""
    kind: str
    keys: Any              # the member procs' keys on this host: a list, or one str joined by
                           # NUL for an agent of fan_version 2 (its hello answer says so)
    contact: Any           # where replies go (the caller's contact)
    call_id: int
    header: bytes          # the inner message's pickled header (the agent never unpickles it)
    buffers: list
    # Hosts forming a tree (node/fantree.py): what this agent forwards to its child agents,
    # [(their fan contact, their keys, their own children)]; its parent agent's fan contact
    # (None: reply to the controller itself); the send's number (an agent acts on it once).
    children: list = ()
    parent: Any = None
    send_id: int = 0
    # The caller takes "ra" items (node/fantree.py ``summarise``): when every member of this
    # host answered the same plain value, one item says so instead of a key per member.
    summaries: bool = False


@message("rv")
class FannedReply(NamedTuple):
    """A member's reply to a fanned call, its value pickled apart (proc -> agent's gather inbox)."""
    kind: str
    call_id: int
    key: str
    ok: bool
    value_header: bytes
    value_buffers: list


@message("rb")
class ReplyBatch(NamedTuple):
    """A host's replies and output, in order, one signed batch (agent -> the caller's inbox)."""
    kind: str
    items: list
    buffers: list


@message("ub")
class UpBatch(NamedTuple):
    """A child agent's batch for ``dest``, to its parent agent's fan inbox (a tree of hosts):
    merged as it is into the parent's own batch, values unopened."""
    kind: str
    dest: str
    items: list
    buffers: list


@message("rr")
class ResentBatch(NamedTuple):
    """Replies an agent had sent to a parent agent that was lost, sent again to the caller
    (``ReplyBatch``'s shape, replies only); the caller keeps those it did not have."""
    kind: str
    items: list
    buffers: list


# ============================================================================ who handles what
# kind -> "module:qualified name" of the function that handles it where it arrives.
HANDLERS: dict[str, str] = {
    "r": "monarch_kernel.core.calls:Calls.on_result",
    "rs": "monarch_kernel.core.calls:Calls.on_replies",
    "out": "monarch_kernel.core.runtime:Runtime._on_output",
    "died": "monarch_kernel.core.runtime:Runtime._on_died",   # a proc: ProcWorker._on_died_notice
    "replaced": "monarch_kernel.core.runtime:Runtime._on_replaced",
    "unhandled": "monarch_kernel.core.runtime:Runtime._on_unhandled",
    "wake": "monarch_kernel.core.runtime:_ignore",
    "port": "monarch_kernel.core.channels:_on_port",
    "getctl": "monarch_kernel.core.controllers:_on_request",
    "interrupt": "monarch_kernel.node.proc:ProcWorker._on_interrupt",
    "query": "monarch_kernel.node.proc:ProcWorker._on_query",
    "logopt": "monarch_kernel.node.proc:ProcWorker._on_logging_option",
    "call": "monarch_kernel.node.proc:ProcWorker.do_call",
    "spawn": "monarch_kernel.node.proc:ProcWorker.do_spawn",
    "stop_actor": "monarch_kernel.node.proc:ProcWorker.do_stop_actor",
    "abort_actor": "monarch_kernel.node.proc:ProcWorker.do_abort_actor",
    "kill_actor": "monarch_kernel.node.proc:ProcWorker.do_kill_actor",
    "supervise": "monarch_kernel.node.proc:ProcWorker.do_supervise",
    "exit": "monarch_kernel.node.proc:ProcWorker.do_exit",
    "req": "monarch_kernel.node.agent:HostAgent._drain_router",   # then op_<op>
    "rep": "monarch_kernel.core.agent_links:AgentLinks.on_socket",
    "ev": "monarch_kernel.core.agent_links:AgentLinks.on_socket",
    "fan": "monarch_kernel.node.fanout:FanRelay._drain_fan",
    "rv": "monarch_kernel.node.fanout:FanRelay._drain_gather",
    "rb": "monarch_kernel.core.fanout:_on_batch",
    "ub": "monarch_kernel.node.fanout:FanRelay._from_child",
    "rr": "monarch_kernel.core.fanout:_on_batch",
}
# Kinds features register (extensions.register_message_kind / Runtime.on_message) are
# declared beside their handlers: "dbg", "dbg_in", "dbg_pm" (debug/), "dap_src" (debug/
# dap_worker.py), "display" (node/rich_output.py -> jupyter/output.py), "torch_abort" (tensor/).
