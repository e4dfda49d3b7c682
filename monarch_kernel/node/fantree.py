"""The tree of host agents (issue 11, section 2): what a relay agent needs beyond fan-out.

Past ``MONARCH_KERNEL_FANOUT_TREE_WIDTH`` hosts in one send, the controller sends its
envelope to at most that many agents; each forwards their part to its child agents
(``("fan", keys, contact, call id, header, buffers, subtree, parent contact)``), and the
batches come back up merged (``("ub", dest, items, buffers)`` to the parent's fan inbox),
so the controller's sends and receives per call grow as log(hosts). A parent that dies must
not lose its subtree's replies: each agent keeps what it sent up (``Retained``) and, told by
the controller that its parent is lost (agent op ``reroute``), sends it again directly.
"""
from __future__ import annotations

import logging
import pickle
import time
from collections import deque

from monarch_kernel.core import wire
from monarch_kernel.core.runtime import host_id

log = logging.getLogger("monarch_kernel.agent")

RETAIN_S = 30.0   # replies sent to a parent agent kept this long, for its loss
MAX_RETAINED = 200_000
MAX_RETAINED_BYTES = 256 << 20
MAX_SENDS = 8192   # tree sends remembered (to act on a resent one once)


def addr_of(contact) -> str:
    """The address to reach a ``[tcp, ipc, host id, ...]`` contact from here: ipc on this host."""
    if contact[1] and contact[2] == host_id():
        return contact[1]
    return contact[0]


def members(node) -> int:
    """Members in one node of the tree ``(fan contact, keys, children)``, its subtree included.
    ``keys``: a list, or (fan_version 2) one string of keys joined by NUL."""
    keys = node[1]
    n = (keys.count("\0") + 1 if keys else 0) if type(keys) is str else len(keys)
    return n + sum(members(c) for c in node[2])


_NONE = wire.dumps(None)[0]   # a None value's pickled header, as procs send it


def columns(items: list) -> None:
    """Turn the runs of replies gathered in ``items`` (``["rc", call id, keys, oks, value
    headers, buffer counts]``, lists while they grow) into the batch's columnar items, in
    place: ``("rc", call id, keys, oks or None when all True, headers or None when every
    value is None, counts or None when all 0)``. The controller then records a run of
    ``None`` replies (most calls to all) with a few C-level calls, no tuple per member."""
    for j, it in enumerate(items):
        if type(it) is list:
            keys, oks, headers, counts = it[2], it[3], it[4], it[5]
            items[j] = ("rc", it[1], keys, None if all(oks) else oks,
                        None if headers.count(_NONE) == len(headers) else headers, counts if any(counts) else None)


MAX_SUMMARIES = 4   # distinct values of one call in a batch before its replies go key by key


def summarise(items: list, own: dict, dest: str) -> None:
    """Turn the replies of this host's own members to a call in ``items`` (a batch about to
    go up, runs still lists), when all are ok plain values without buffers and of at most
    ``MAX_SUMMARIES`` distinct pickled headers, into one ``("ra", call id, first key, mask,
    header)`` item per value at the place of the call's last run. ``mask``: a byte per
    member this host was sent (in the order the controller listed them), 1 where that
    member answered this value. The controller kept each host's places in the call per
    first key when it sent (core/fanout.py), so it marks them answered with a few C-level
    steps, and no key per member travels or is unpickled (at 256 members that was most of
    a call to all's cost there). The first key names the host exactly through relays,
    which pass the item up unopened. Output between the runs keeps its place, before the
    replies. ``own``: (dest, call id) -> [keys forwarded, their positions or None, replies
    still to come], dropped once they have all come, or at the call's first batch that
    cannot be summarised (its later ones then go key by key too)."""
    runs: dict = {}
    for j, it in enumerate(items):
        if type(it) is list:
            at = runs.get(it[1])
            if at is None:
                runs[it[1]] = [j]
            else:
                at.append(j)
    put: dict = {}   # position of a call's last run -> its summaries
    for call_id, at in runs.items():
        entry = own.get((dest, call_id))
        if entry is None:
            continue
        masks = None
        if all(all(items[j][3]) and not any(items[j][5]) for j in at):
            masks = _masks(entry, [items[j] for j in at])
        if masks is None:   # key by key, this batch and the call's later ones: its entry (the
            del own[(dest, call_id)]   # keys of up to 256 members) is not kept for nothing
            continue
        put[at[-1]] = [("ra", call_id, entry[0][0], mask, header) for header, mask in masks]
        for j in at[:-1]:
            put[j] = []
        entry[2] -= sum(len(items[j][2]) for j in at)
        if entry[2] <= 0:
            del own[(dest, call_id)]
    if put:
        items[:] = [x for j, it in enumerate(items) for x in put.get(j, (it,))]


def _masks(entry: list, runs: list) -> list | None:
    """[(header, mask)] for the replies in ``runs`` (see summarise), or None when they are
    not an exact set of distinct members we were sent, or hold too many distinct values.
    C-level steps over the replies (map, set), not a Python step each: at 256 members the
    loop was a tenth of the agent's CPU per call."""
    keys, pos = entry[0], entry[1]
    if pos is None:
        pos = entry[1] = dict(zip(keys, range(len(keys))))
    if len(runs) == 1:
        rkeys, headers = runs[0][2], runs[0][4]
    else:
        rkeys = [k for run in runs for k in run[2]]
        headers = [h for run in runs for h in run[4]]
    n = len(keys)
    if len(rkeys) == n == len(pos) and headers.count(headers[0]) == n and pos.keys() == set(rkeys):
        return [(headers[0], b"\x01" * n)]   # every member once, one value: a call to all
    at = list(map(pos.get, rkeys))
    if None in at or len(set(at)) != len(at):
        return None   # not a member we were sent, or twice: not exact, key by key
    values = dict.fromkeys(headers)   # in the order they first came
    if len(values) > MAX_SUMMARIES:
        return None
    masks = {header: bytearray(len(keys)) for header in values}
    for i, header in zip(at, headers):
        masks[header][i] = 1
    return [(header, bytes(mask)) for header, mask in masks.items()]


def replies_in(item) -> int:
    """How many replies a batch item carries (0: output or another kind)."""
    kind = item[0]
    return len(item[2]) if kind == "rc" else item[3].count(1) if kind == "ra" else 1 if kind == "r" else 0


def buffers_in(item) -> int:
    kind = item[0]
    if kind == "r":
        return item[5]
    if kind == "ra":
        return 0
    return sum(item[5]) if item[5] else 0


class Retained:
    """Replies this agent sent up to a parent agent, kept ``RETAIN_S`` (at most ``MAX_RETAINED``
    replies and ``MAX_RETAINED_BYTES`` of their buffers: tensors) in case that parent dies
    before passing them on: the controller then asks for them again (``reroute``). Values
    stay opaque bytes."""

    def __init__(self):
        self.entries: deque = deque()   # (time, dest, parent, reply items, their buffers, count, bytes)
        self.count = 0
        self.bytes = 0

    def keep(self, dest: str, parent: str, items: list, buffers: list) -> None:
        replies, bufs, i, count = [], [], 0, 0
        for it in items:
            n = replies_in(it)
            if n:
                nb = buffers_in(it)
                replies.append(it)
                bufs.extend(buffers[i:i + nb])
                i += nb
                count += n
        if not replies:
            return
        now = time.monotonic()
        size = sum(memoryview(b).nbytes for b in bufs)
        self.entries.append((now, dest, parent, replies, bufs, count, size))
        self.count += count
        self.bytes += size
        while self.entries and (now - self.entries[0][0] > RETAIN_S or self.count > MAX_RETAINED
                                or self.bytes > MAX_RETAINED_BYTES):
            old = self.entries.popleft()
            self.count -= old[5]
            self.bytes -= old[6]

    def take(self, dest: str, parent: str, calls: set | None = None) -> tuple[list, list]:
        """What was sent to ``parent`` for ``dest`` (replies of ``calls`` only, if given)."""
        items, bufs = [], []
        kept = deque()
        for e in self.entries:
            if e[1] != dest or e[2] != parent:
                kept.append(e)
                continue
            self.count -= e[5]
            self.bytes -= e[6]
            i = 0
            for it in e[3]:
                nb = buffers_in(it)
                if calls is None or it[1] in calls:
                    items.append(it)
                    bufs.extend(e[4][i:i + nb])
                i += nb
        self.entries = kept
        return items, bufs


def seen_before(relay, dest: str, sid: int, call_id, parent) -> bool:
    """Has this tree send (``sid``, numbered by the controller ``dest``) come before? If so,
    only its way up changes (the controller resends it, parentless, when a relay is lost)."""
    k = (dest, sid)
    if k not in relay.sends:
        relay.sends[k] = None
        if len(relay.sends) > MAX_SENDS:
            for old in list(relay.sends)[:MAX_SENDS // 2]:
                del relay.sends[old]
        return False
    if call_id:
        relay.up_of[(dest, call_id)] = addr_of(parent) if parent else ""
    return True


def reroute(relay, dest: str, lost_contact, calls=None) -> int:
    """The controller ``dest`` lost the parent agent ``lost_contact`` of our tree: from now
    on, what we gather for it goes to it directly, and the replies we sent that parent in
    the last ``RETAIN_S`` for the ``calls`` it still waits on (None: all) go again (it
    keeps the first of each). Returns how many replies went again."""
    lost = addr_of(lost_contact)
    for k, v in list(relay.up_of.items()):
        if v == lost:
            relay.up_of[k] = ""
    for d, v in list(relay.last_up.items()):
        if v == lost:
            relay.last_up[d] = ""
    h = relay.held.pop((dest, lost), None)
    link = relay.up_links.pop(lost, None)
    if link is not None:
        link[0].close(0)
    items, buffers = relay.tree.take(dest, lost, None if calls is None else set(calls))
    if h is not None and h.items:
        mine = relay.held_slot(dest, "")
        if mine is not None:
            if not mine.items:
                mine.since = time.monotonic()
            mine.items.extend(h.items)
            mine.buffers.extend(h.buffers)
            mine.shown += h.shown
    if items:
        relay.send_up(dest, "", ("rr", items, [pickle.PickleBuffer(b) for b in buffers]))
    n = sum(map(replies_in, items))
    log.warning("parent agent %s lost: %d replies for %s sent again directly", lost, n, dest)
    return n
