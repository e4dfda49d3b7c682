"""The controller's half of fan-out and fan-in (issue 11, section 2): O(hosts) sends.

A message for the members of a mesh (a call, a spawn, a broadcast) is pickled once.
A send to at least ``MONARCH_KERNEL_FANOUT_MIN`` members reaches them through their hosts'
agents: one signed send to the agent's fan inbox, which signs it for each of its
procs (every message is bound to its receiving socket, wire.py) and pushes it over ipc
(node/fanout.py). Their replies, and the output they write
meanwhile, come back in one batch per host (``"rb"``): one signature checked here for the
batch (the agent checked each proc's), and only the values unpickled; members that
answered alike come as one summary per value (node/fantree.py ``summarise``), marked
answered from each host's place in the call, kept at send (``Calls.set_parts``). Smaller
sends and point-to-point calls (``call_one``, a slice), keep the one hop.

``MONARCH_KERNEL_FANOUT_MIN`` (default 32): members in one send before it goes through the
agents (every host of it, however few of them it holds: 32 hosts x 8 GPUs is 32 sends, not
256); 0 turns fan-out off. Why 32: the agent is one more Python hop. On this 2-core test machine
it cuts the controller's CPU per call to all (64 procs: 2.3 -> 0.5 ms; 256: 9-13 -> 1.3 ms)
but adds latency (4 procs: 0.45 -> 1.1 ms), so small meshes keep the direct path.
Failures are unchanged: a dead proc or a lost host fails its members from the agent's
events and the host heartbeat, as on the direct path.

Past ``MONARCH_KERNEL_FANOUT_TREE_WIDTH`` hosts (default 16) in one send, hosts form a tree
(``_tree``): the controller sends to at most that many relay agents, each forwards their
children's part (node/fantree.py) and merges their batches into its own, so the
controller's sends and batches per call grow as log(hosts). A relay whose host is lost
must not take its subtree's replies with it: the controller resends what the relay was
to forward (calls still pending) to its children directly, numbered so a child that had
it acts once, and tells them to send up directly from now on and to send again the
replies they had sent the relay (``reroute``); duplicates are dropped here.
"""
from __future__ import annotations

import itertools
import logging
import os
import pickle
import time
from collections import deque
from itertools import groupby
from operator import attrgetter

from .. import config
from . import wire
from .errors import ActorError
from .transport import is_local
from .wire import PLAIN_TYPES

log = logging.getLogger("monarch_kernel")

FAN_PREFIX = "fan+"   # marks a fanned call's reply_to (node/fanout.py reads it)

_routes: dict[str, str] = {}   # agent address -> its fan inbox (tcp; ipc alias in the runtime)
_fan: dict[str, list] = {}     # agent address -> its fan inbox's contact (for the agents of a tree)
_trees: dict[tuple, list] = {}   # (agents, width) -> [(agent, children)]: the tree of one send
_kids: dict[str, dict] = {}    # agent -> {child agent: mesh key}: whom to tell when it is lost
_lost: set[str] = set()        # agents whose host is lost: never a relay
_via: dict[str, deque] = {}    # relay agent -> what it was to forward: resent to its children if it is lost
_plans: dict[tuple, tuple] = {}   # a send's members -> them by host (_hosts_of)
_joined: set[str] = set()      # agents that read a host's member keys as one NUL-joined string
_sids = itertools.count(1)     # tree sends' numbers (an agent that gets one twice acts once)
RESEND_S = 10.0                # a relay's sends without a pending call kept this long (broadcasts)
_pid = [0]
_AGENT, _KEY = attrgetter("agent"), attrgetter("key")   # per-member work in C


def learn_agent(rt, agent_addr: str, info: dict) -> None:
    """From an agent's hello answer: where its fan inbox is (agents without one: direct)."""
    fan = info.get("fan")
    if _pid[0] != os.getpid():   # a forked child starts with no routes
        for d in (_routes, _fan, _trees, _kids, _lost, _via, _plans, _joined):
            d.clear()
        _pid[0] = os.getpid()
    _trees.clear()
    if not fan:
        _routes.pop(agent_addr, None)
        return
    _routes[agent_addr] = rt.learn_contact(list(fan))
    _fan[agent_addr] = list(fan)
    link = rt.agents.get(agent_addr)
    if link is not None:   # it counts our fanned calls as heartbeats (agent_links.AgentLinks.tick)
        link.fan_heartbeats = info.get("fan_version", 1) >= 3
    if info.get("fan_version", 1) >= 2:
        _joined.add(agent_addr)
    else:
        _joined.discard(agent_addr)
    _plans.clear()
    if rt.once("fan-in batches"):
        rt.on_message("rb", lambda msg: _on_batch(rt, msg))
        rt.on_message("rr", lambda msg: _on_batch(rt, msg, resent=True))
        rt.on_host_change(lambda addr, lost: _host_changed(rt, addr, lost))
        # A proc's fanned replies may still be on their way up when its death (sent straight
        # here) arrives: its agent names those calls first; they wait for the reply.
        rt.on_agent_event("replied", lambda link, key, calls: _replied_before_death(rt, key, calls))


def _replied_before_death(rt, key: str, calls) -> None:
    """The calls (destination, call id) a dead proc answered lately, from its agent: ours wait
    for their replies. Another controller's are not ours though their ids may be (every
    controller counts from 1): taken for ours, a call of the same id to that proc waited the
    5 s of LATE_REPLY_S for a reply that never comes (a cell after a kernel restart)."""
    mine = rt.addresses
    rt.calls.replied_before_death[key] = {
        c[1] if type(c) is tuple else c   # (an agent started by an earlier version names bare ids)
        for c in calls if type(c) is not tuple or c[0] in mine}


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
        hosts, starts, keys, wire_keys, parts, local_all = _hosts_of(refs)
        groups = dict(hosts)
        for agent in hosts:   # a big send goes through every agent: 32 hosts x 8 too
            if agent not in _routes:
                direct.extend(groups.pop(agent))
    inner = None
    if groups:
        # Pickled once; each agent gets it inside its envelope (the header in the MAC'd part,
        # tensors out of band) and signs it for each of its procs (replays stay per socket).
        fanned = (*msg[:reply_at], FAN_PREFIX + msg[reply_at], *msg[reply_at + 1:])
        # Same-host tensor handles need every receiver here; one proc a host tells (an
        # agent's procs share its host). ``local``: how many receivers will pull them.
        whole = len(groups) == len(hosts)   # (the usual case: what _hosts_of kept holds)
        local = 0 if wire.LARGE_TENSOR_HOOK is None else local_all if whole else _local(groups)
        inner = wire.dumps(fanned, local)
        bufs = [pickle.PickleBuffer(b) for b in inner[1:]] if len(inner) > 1 else []
    frames = rt.pack(key, msg, [r.work for r in direct]) if direct else None
    if inner is not None:
        if len(groups) < len(keys):
            keys = {agent: keys[agent] for agent in groups}
            wire_keys = {agent: wire_keys[agent] for agent in groups}
        if call_id:   # where each host's members sit in the call, for its summaries (``_on_batch``)
            rt.calls.set_parts(call_id, parts if whole else [(starts[a], ks) for a, ks in keys.items()])
        width = config.FANOUT_TREE_WIDTH.get() if len(groups) > 1 else 0
        if width and len(groups) > width:
            sid = next(_sids)
            for agent, subtree in _tree(tuple(groups), width, key):
                below = _envelopes(subtree, wire_keys)
                env = ("fan", wire_keys[agent], rt.contact, call_id, inner[0], bufs, below, None, sid, True)
                rt.send_frames(_routes[agent], rt.pack(key, env))
                if below:
                    _remember_sends(rt, agent, subtree, below, (time.monotonic(), sid, key, call_id, inner[0], bufs))
        else:
            for agent, ks in wire_keys.items():
                env = ("fan", ks, rt.contact, call_id, inner[0], bufs, (), None, 0, True)
                rt.send_frames(_routes[agent], rt.pack(key, env))
    for r in direct:
        rt.send_frames(r.work, frames)
    if inner is not None and call_id:   # (the agent counts a fanned call as our heartbeat)
        now, links = time.monotonic(), rt.agents
        for agent in groups:
            link = links.get(agent)
            if link is not None:
                link.fan_sent = now


def _local(groups: dict) -> int:
    """How many receivers will pull same-host tensor handles: all of ``groups``' members when
    every host of them is this one (one proc a host tells: an agent's procs share its host),
    else none."""
    return sum(map(len, groups.values())) if all(is_local(g[0].work) for g in groups.values()) else 0


def _hosts_of(refs: list) -> tuple[dict, dict, dict, dict, list, int]:
    """``refs`` by host agent: {agent: its members}, {agent: their first place in refs, or
    -1 where they are not adjacent}, {agent: their keys}, {agent: their keys as its envelope
    carries them (joined by NUL for an agent that reads that)}, [(first place, keys)] a host
    (``Calls.set_parts``), and ``_local`` of them all. Cached per list of members (a call to
    all sends to the same members each time; 256 of them took ~70 µs to group, and their
    keys as a list ~20 µs more to pickle): the cache is checked by comparing the lists,
    which is a pointer compare per member."""
    plan = _plans.get((len(refs), id(refs[0]), id(refs[-1])))
    if plan is not None and plan[0] == refs:
        return plan[1]
    groups: dict[str, list] = {}
    at, starts = 0, {}
    for agent, run in groupby(refs, _AGENT):   # ranks of a host are usually adjacent
        run = list(run)
        have = groups.get(agent)
        if have is None:
            groups[agent] = run
            starts[agent] = at
        else:
            have.extend(run)
            starts[agent] = -1
        at += len(run)
    keys = {agent: list(map(_KEY, members)) for agent, members in groups.items()}
    out = (groups, starts, keys, {agent: "\0".join(ks) if agent in _joined else ks for agent, ks in keys.items()},
           [(starts[agent], ks) for agent, ks in keys.items()], _local(groups))
    if len(_plans) >= 64:
        _plans.clear()
    _plans[(len(refs), id(refs[0]), id(refs[-1]))] = (list(refs), out)   # (its refs keep the ids taken)
    return out


def _tree(agents: tuple, width: int, key: bytes) -> list:
    """The tree of one send (cached per set of hosts): at most ``width`` agents under any
    sender, so the controller's sends and the batches it reads grow as log(hosts). A lost
    host is never a relay (its members are failed anyway): it hangs off the controller."""
    tree = _trees.get((agents, width))
    if tree is None:
        live = [a for a in agents if a not in _lost]
        tree = _split(live, width) + [(a, []) for a in agents if a in _lost]
        if len(_trees) >= 256:   # many different slices: start again rather than grow
            _trees.clear()
        _trees[(agents, width)] = tree
        _remember_parents(tree, key)
    return tree


def _split(agents: list, width: int) -> list:
    if len(agents) <= width:
        return [(a, []) for a in agents]
    size, extra = divmod(len(agents), width)
    out, start = [], 0
    for i in range(width):
        part = agents[start:start + size + (i < extra)]
        start += len(part)
        out.append((part[0], _split(part[1:], width)))
    return out


def _remember_parents(tree: list, key: bytes) -> None:
    for agent, children in tree:
        if children:
            kids = _kids.setdefault(agent, {})
            for child, _ in children:
                kids[child] = key
            _remember_parents(children, key)


def _envelopes(subtree: list, keys: dict) -> list:
    """A relay's children, as it forwards to them: (fan contact, member keys, their children)."""
    return [(_fan[a], keys[a], _envelopes(kids, keys)) for a, kids in subtree]


def _host_changed(rt, addr: str, lost: bool) -> None:
    """(I/O thread) A host was lost or came back. A lost relay's children send what they had
    sent it again, directly, and gather for us directly from now on (node/fanout.py
    ``reroute``): its subtree's replies are not lost with it."""
    _trees.clear()
    if not lost:
        _lost.discard(addr)
        return
    _lost.add(addr)
    fan = _fan.get(addr)
    sends = [r for r in _via.pop(addr, ()) if not r[3] or rt.calls.is_pending(r[3])]
    waiting = sorted({r[3] for r in sends if r[3]})   # the calls whose replies it may have held
    for child, key in _kids.pop(addr, {}).items():
        if child not in _lost and fan is not None:
            log.warning("relay host %s lost: its child agent %s now sends its replies directly", addr, child)
            rt.agent_send(child, key, "reroute", rt.address, fan, waiting)
    # What the lost relay was to forward goes to its children directly, parentless: a child
    # that had it already only sends its replies our way from now on (node/fanout.py).
    for _, sid, key, call_id, header, bufs, below in sends:
        for fan_contact, keys, subtree in below:
            env = ("fan", keys, rt.contact, call_id, header, bufs, subtree, None, sid, True)
            try:
                rt.send_frames(rt.learn_contact(fan_contact), rt.pack(key, env))
            except Exception:
                log.exception("could not resend a lost relay's part to %s", fan_contact[0])


def _remember_sends(rt, relay: str, subtree: list, below: list, send: tuple) -> None:
    """Keep what ``relay`` (and each relay under it) is to forward while its call is pending
    (sends without a reply: ``RESEND_S``), in case its host is lost before it did."""
    q = _via.get(relay)
    if q is None:
        q = _via[relay] = deque()
    q.append((*send, below))
    for (child, grandchildren), entry in zip(subtree, below):
        if grandchildren:
            _remember_sends(rt, child, grandchildren, entry[2], send)
    now, is_pending = send[0], rt.calls.is_pending
    while q and (len(q) > 1024 or (now - q[0][0] > RESEND_S and not (q[0][3] and is_pending(q[0][3])))):
        q.popleft()


_NONE = wire.dumps(None)[0]


def _on_batch(rt, msg, resent: bool = False) -> None:
    """One host's (or subtree's) replies and output, in the order its procs sent them (the
    agent checked each proc's signature; this batch's was checked on arrival): only values
    are unpickled. Replies come in columnar runs of one call (node/fantree.py ``columns``):
    a run of ``None`` replies is recorded with a few C-level calls (``Calls.on_none_run``);
    others are handed to the pending calls in runs (``Calls.on_results``: one lookup and one
    wake per call, not per member). A run ends before any other item, so output still
    reaches the user before the reply that follows it."""
    _, items, buffers = msg
    handlers, calls = rt.handlers, rt.calls
    none = _NONE
    replies: list = []
    i = 0
    _heard(rt, items)
    for item in items:
        kind = item[0]
        if kind == "rc":
            _, call_id, keys, oks, headers, counts = item
            if oks is None and headers is None and not resent:
                if replies:
                    _deliver(calls.on_results, replies)
                    replies = []
                try:
                    calls.on_none_run(call_id, keys)
                except Exception:
                    log.exception("handler for a run of replies failed")
                continue
            for j, key in enumerate(keys):
                n = counts[j] if counts else 0
                ok = True if oks is None else oks[j]
                vheader = none if headers is None else headers[j]
                replies.append((call_id, key, *_value(ok, vheader, buffers, i, n)))
                i += n
            continue
        if kind == "ra":   # one host's members answered one value (node/fantree.py summarise)
            _, call_id, first, mask, vheader = item
            ok, value = _value(True, vheader, buffers, i, 0)
            values = None
            if not ok or type(value) not in PLAIN_TYPES:   # not shared: each member its own copy
                values = [value, *(_value(True, vheader, buffers, i, 0)[1] for _ in range(mask.count(1) - 1))]
            if resent:
                replies.extend(calls.summary_replies(call_id, first, mask, ok, value, values))
                continue
            if replies:
                _deliver(calls.on_results, replies)
                replies = []
            try:
                calls.on_summary(call_id, first, mask, ok, value, values)
            except Exception:
                log.exception("handler for a summary of replies failed")
            continue
        if kind == "r":   # one reply (an agent that predates the columnar runs)
            _, call_id, key, ok, vheader, n = item
            replies.append((call_id, key, *_value(ok, vheader, buffers, i, n)))
            i += n
            continue
        if replies:
            _deliver(calls.on_results, replies)
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
        if resent:   # sent again after a relay was lost: keep only what did not arrive before
            replies = calls.unanswered(replies)
        _deliver(calls.on_results, replies)


def _heard(rt, items: list) -> None:
    """Each host whose procs' replies are in this batch answered: its agent is alive (its
    batches stand for heartbeats while we call it, agent_links.AgentLinks.tick). Its host is
    the host of the first member of each reply item (a relay's batch holds its subtree's)."""
    now, procs, links = time.monotonic(), rt.procs, rt.agents
    for item in items:
        kind = item[0]
        first = (item[2][0] if item[2] else None) if kind == "rc" else item[2] if kind in ("ra", "r") else None
        if first:
            known = procs.get(first)
            link = links.get(known[0].agent) if known is not None else None
            if link is not None:
                link.fan_seen = now


def _value(ok: bool, vheader: bytes, buffers: list, i: int, n: int) -> tuple:
    if vheader == _NONE:
        return ok, None
    try:
        return ok, wire.loads(vheader, buffers[i:i + n])
    except Exception as e:
        return False, ActorError(f"the result could not be unpickled here: {e!r}. Return plain data, or make "
                                 "its module importable on this side", exc_type=type(e).__name__)


def _deliver(on_results, replies: list) -> None:
    try:
        on_results(replies)
    except Exception:
        log.exception("handler for 'r' failed")
