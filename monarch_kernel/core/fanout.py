"""The controller's half of fan-out and fan-in (issue 11, section 2): O(hosts) sends.

A message for the members of a mesh (a call, a spawn, a broadcast) is pickled once.
Members on a host with at least ``MONARCH_KERNEL_FANOUT_MIN`` of them get it through that
host's agent: one signed send to the agent's fan inbox, which signs it for each of its
procs (every message is bound to its receiving socket, wire.py) and pushes it over ipc
(node/fanout.py). Their replies, and the output they write
meanwhile, come back in one batch per host (``"rb"``): one signature checked here for the
batch (the agent checked each proc's), and only the values unpickled. Members on hosts
below the threshold, and point-to-point calls (``call_one``, a slice), keep the one hop.

``MONARCH_KERNEL_FANOUT_MIN`` (default 32): members on one host before its agent forwards;
0 turns fan-out off. Why 32: the agent is one more Python hop. On this 2-core test machine
it cuts the controller's CPU per call to all (64 procs: 2.3 -> 0.5 ms; 256: 9-13 -> 1.3 ms)
but adds latency (4 procs: 0.45 -> 1.1 ms), so small meshes keep the direct path.
Failures are unchanged: a dead proc or a lost host fails its members from the agent's
events and the host heartbeat, as on the direct path.
"""
from __future__ import annotations

import logging
import os
import pickle
from itertools import groupby
from operator import attrgetter

from .. import config
from . import wire
from .errors import ActorError
from .transport import is_local

log = logging.getLogger("monarch_kernel")

FAN_PREFIX = "fan+"   # marks a fanned call's reply_to (node/fanout.py reads it)

_routes: dict[str, str] = {}   # agent address -> its fan inbox (tcp; ipc alias in the runtime)
_pid = [0]
_AGENT, _KEY = attrgetter("agent"), attrgetter("key")   # per-member work in C


def learn_agent(rt, agent_addr: str, info: dict) -> None:
    """From an agent's hello answer: where its fan inbox is (agents without one: direct)."""
    fan = info.get("fan")
    if _pid[0] != os.getpid():   # a forked child starts with no routes
        _routes.clear()
        _pid[0] = os.getpid()
    if not fan:
        _routes.pop(agent_addr, None)
        return
    _routes[agent_addr] = rt.learn_contact(list(fan))
    if rt.once("fan-in batches"):
        rt.on_message("rb", lambda msg: _on_batch(rt, msg))


def send(rt, key: bytes, msg: tuple, refs, reply_at: int) -> None:
    """Send ``msg`` to every proc of ``refs``; ``msg[reply_at]`` is its reply address and
    ``msg[reply_at + 1]`` its call id (0: no reply). Raises what packing raises, before
    anything is sent."""
    groups: dict[str, list] = {}
    direct = refs
    call_id = msg[reply_at + 1]
    # One member (call_one, a one-rank slice) keeps its one hop; and skips reading the setting.
    fan_min = config.FANOUT_MIN.get() if _routes and len(refs) > 1 else 0
    if fan_min and len(refs) >= fan_min and type(call_id) is int and _pid[0] == os.getpid():
        direct = []
        for agent, run in groupby(refs, _AGENT):   # ranks of a host are usually adjacent
            have = groups.get(agent)
            if have is None:
                groups[agent] = list(run)
            else:
                have.extend(run)
        for agent in list(groups):
            if len(groups[agent]) < fan_min or agent not in _routes:
                direct.extend(groups.pop(agent))
    inner = None
    if groups:
        # Pickled once; each agent gets it inside its envelope (the header in the MAC'd part,
        # tensors out of band) and signs it for each of its procs (replays stay per socket).
        fanned = (*msg[:reply_at], FAN_PREFIX + msg[reply_at], *msg[reply_at + 1:])
        # Same-host tensor handles need every receiver here; one proc a host tells (an
        # agent's procs share its host). ``local``: how many receivers will pull them.
        local = (sum(map(len, groups.values())) if wire.LARGE_TENSOR_HOOK is not None
                 and all(is_local(g[0].work) for g in groups.values()) else 0)
        inner = wire.dumps(fanned, local)
        bufs = [pickle.PickleBuffer(b) for b in inner[1:]]
    frames = rt.pack(key, msg, [r.work for r in direct]) if direct else None
    if inner is not None:
        for agent, members in groups.items():
            env = ("fan", list(map(_KEY, members)), rt.contact, call_id, inner[0], bufs)
            rt.send_frames(_routes[agent], rt.pack(key, env))
    for r in direct:
        rt.send_frames(r.work, frames)


_NONE = wire.dumps(None)[0]


def _on_batch(rt, msg) -> None:
    """One host's replies and output, in the order its procs sent them (the agent checked
    each proc's signature; this batch's was checked on arrival): only values are unpickled.
    Replies are handed to the pending calls in runs (``Calls.on_results``: one lookup and
    one wake per call, not per member); a run ends before any other item, so output still
    reaches the user before the reply that follows it."""
    _, items, buffers = msg
    handlers, on_results = rt.handlers, rt.calls.on_results
    none, loads = _NONE, wire.loads
    replies: list = []
    i = 0
    for item in items:
        kind = item[0]
        if kind == "r":
            _, call_id, key, ok, vheader, n = item
            if vheader == none:
                i += n
                replies.append((call_id, key, ok, None))
                continue
            try:
                value = loads(vheader, buffers[i:i + n])
            except Exception as e:
                ok, value = False, ActorError(
                    f"the result could not be unpickled here: {e!r}. Return plain data, or make its "
                    "module importable on this side", exc_type=type(e).__name__)
            i += n
            replies.append((call_id, key, ok, value))
            continue
        if replies:
            _deliver(on_results, replies)
            replies = []
        h = handlers.get(kind)
        if h is None:
            log.warning("dropped a batched message of unknown kind %r", kind)
            continue
        try:
            h(item)
        except Exception:
            log.exception("handler for %r failed", kind)
    if replies:
        _deliver(on_results, replies)


def _deliver(on_results, replies: list) -> None:
    try:
        on_results(replies)
    except Exception:
        log.exception("handler for 'r' failed")
