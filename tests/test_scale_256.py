"""256 procs on this machine as 8 hosts x 32 (issue 11, section 4): each host a host agent,
its 32 procs forked from its warm zygote. One bring-up (about a minute on 2 cores), then
what a user does at that size: spawn, a call to all, a cell through a real kernel, every
rank busy for seconds (the hosts must not be declared lost for it), a killed proc, a lost
host, stop, no orphans.

Two ways to make 8 hosts here (scale_hosts.py): each agent in its own network namespace,
with its own address and hostname (needs root: skipped, saying why, without it), and each on
a loopback port of its own (anyone; a lost host is a frozen one). Marked ``scale``
(``-m "not scale"`` leaves it out).
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import cloudpickle
import psutil
import pytest

from monarch_kernel.actor import Actor, SupervisionError, endpoint
from monarch_kernel.core.bootstrap import attach_to_workers
from monarch_kernel.core.runtime import runtime

sys.path.insert(0, os.path.dirname(__file__))
import scale_hosts  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = [pytest.mark.scale, pytest.mark.timeout(420)]

HOSTS, PER_HOST = 8, 32
N = HOSTS * PER_HOST


class Rank(Actor):
    @endpoint
    def where(self) -> tuple:
        """(this proc's host, as scale_hosts names it; its pid; its hostname)"""
        import socket

        return os.environ.get("MK_SCALE_HOST"), os.getpid(), socket.gethostname()

    @endpoint
    def spin(self, seconds: float) -> int:
        t = time.monotonic()
        n = 0
        while time.monotonic() - t < seconds:
            n += 1
        return n

    @endpoint
    def nap(self, seconds: float) -> None:
        time.sleep(seconds)


@pytest.mark.parametrize("how", ["netns", "loopback"])
def test_256_procs_on_8_hosts_spawn_answer_run_a_cell_survive_load_and_fail_exactly(how):
    why = scale_hosts.unavailable()
    if how == "netns" and why:
        pytest.skip(why)
    if os.environ.get(_INNER) != "1":
        _run_in_a_process_of_its_own(how)
        return
    with scale_hosts.AgentHosts(HOSTS, how=how) as hosts:
        hm = None
        try:
            _spawn_and_run_a_cell_from_a_kernel(hosts)
            hm = attach_to_workers(hosts.addrs, key=hosts.key, name="scale256")
            _exercise(hm, hosts)
        finally:
            if hm is not None:
                hm.shutdown()


_INNER = "MK_TEST_SCALE_256_INNER"


def _run_in_a_process_of_its_own(how: str) -> None:
    """Attaching to the netns hosts makes this process's runtime listen on their bridge and
    give that address to every peer from then on (Runtime.listen_on); the bridge is deleted
    at the end, and the later tests of a shared pytest process would send their procs a reply
    address that no longer exists (their calls hung). A pytest process of its own keeps the
    test's network out of the rest of the suite; the orphan check still runs here."""
    name = test_256_procs_on_8_hosts_spawn_answer_run_a_cell_survive_load_and_fail_exactly.__name__
    test = f"{__file__}::{name}[{how}]"
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", test],
                       env={**os.environ, _INNER: "1"}, capture_output=True, text=True, timeout=400)
    print(r.stdout[-3000:])
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]


def _spawn_and_run_a_cell_from_a_kernel(hosts) -> None:
    """A notebook attaches to the 8 agents (a connection file names them), starts 32
    procs on each, runs one ``%%on_mesh`` cell on all 256 ranks, and lets go of the mesh."""
    from kernel_harness import KernelHarness

    hosts.write_connection_file("scale256")
    k = KernelHarness(env={"MONARCH_KERNEL_HOME": os.environ["MONARCH_KERNEL_HOME"],
                           "MONARCH_KERNEL_BIND": hosts.bridge_ip})
    try:
        t0 = time.monotonic()
        k.ok(f"%mesh connect scale256 --procs {PER_HOST}", timeout=240)
        print(f"\n%mesh connect of {N} procs on {HOSTS} hosts: {time.monotonic() - t0:.1f} s")
        r = k.ok("%%on_mesh\nimport os\nprint(os.environ['MK_SCALE_HOST'])\nrank", timeout=120)
        for h in range(HOSTS):   # identical lines merged: one line per host, with its ranks
            lo = h * PER_HOST
            assert f"[ranks {lo}-{lo + PER_HOST - 1}] n{h + 1}" in r.stdout, r.stdout[:2000]
        assert "255" in r.result + str(r.data()), r.result[:2000]
        # Every rank printing 10,000 lines as fast as it can (issue 11's flood): the cell ends
        # well, no host lost (a message a line once starved the agents into 30 s of silence),
        # the notebook gets a bounded number of lines, and the cell says where the rest is:
        # shown + not shown is every line. (It fell 40-60 % short here: the kernel, starved of
        # CPU, sent no heartbeat for 3-6 s, every agent detached it mid-cell, and the lines
        # printed then went to the hosts' stderr, neither shown nor counted.)
        t0 = time.monotonic()
        r = k.ok("%%on_mesh\nfor i in range(10_000):\n    print(f'flood {rank} line {i}')", timeout=240)
        shown = r.stdout.count("\n")
        m = re.search(r"([\d,]+) lines from ranks 0-255 not shown here", r.stderr)
        assert m, r.stderr[-2000:]
        assert 0 < shown <= 12_000 and int(m.group(1).replace(",", "")) + shown == N * 10_000, (
            shown, m.group(1), hosts.warnings()[-20:])   # (once 0.3 % short in CI, round 18: the agents' say)
        print(f"256 ranks x 10,000 printed lines: {time.monotonic() - t0:.1f} s, {shown} shown, "
              f"{m.group(1)} counted as not shown")
        assert "1" in k.ok("%%on_mesh --ranks 0\n1", timeout=60).result   # (and the next cell runs)
        k.ok("%mesh disconnect", timeout=60)
    finally:
        k.close()


def _exercise(hm, hosts) -> None:
    """The same procs from this process (attached after the kernel let go)."""
    pm = hm.proc_mesh("procs")
    assert len(pm) == N
    ranks = pm.spawn("ranks", Rank)
    where = ranks.where.call().get(120).values()
    assert len(where) == N and len({pid for _, pid, _ in where}) == N
    assert [h for h, _, _ in where] == [f"n{1 + r // PER_HOST}" for r in range(N)]   # rank order = host order
    if hosts.mode == "netns":   # a host of its own: its hostname too
        assert [name for _, _, name in where] == [h for h, _, _ in where]
    # What the notebook shows of them: a row a host (its 32 ranks alike), not 256 rows.
    rows = re.findall(r"<tr><td>([\d-]+)</td><td>[^<]*</td><td>([^<]*)</td>", pm._repr_html_())
    assert rows == [(f"{32 * h}-{32 * h + 31}", f"n{h + 1}") for h in range(HOSTS)], rows
    assert "n1, n2, n3, … (8 in all)" in ranks._repr_html_()
    # The 8 hosts in a tree of width 2 (relays forward to their child agents over tcp + CURVE
    # and merge their batches): the same 256 answers, in rank order.
    os.environ["MONARCH_KERNEL_FANOUT_TREE_WIDTH"] = "2"
    try:
        assert ranks.where.call().get(120).values() == where
    finally:
        del os.environ["MONARCH_KERNEL_FANOUT_TREE_WIDTH"]

    # Memory per proc: forked from the zygote that imported torch, so most pages are shared.
    mem = [psutil.Process(pid).memory_full_info() for _, pid, _ in where[::32]]
    uss_mb = max(m.uss for m in mem) / 2**20
    print(f"memory per proc: USS {uss_mb:.1f} MB, PSS {max(m.pss for m in mem) / 2**20:.1f} MB, "
          f"RSS {max(m.rss for m in mem) / 2**20:.0f} MB")
    assert uss_mb < 64, f"a proc costs {uss_mb:.0f} MB of its own: 256 of them do not fit a small host"

    # Every rank busy for 4 s on 2 cores: agents starve, yet no host is declared lost.
    spins = ranks.spin.call(4.0).get(120).values()
    assert len(spins) == N and min(spins) > 0

    # A killed proc fails the call waiting on it within about a second, naming its rank;
    # the other ranks keep answering.
    victim = 37
    fut = ranks.nap.call(4)
    time.sleep(0.5)
    t0 = time.monotonic()
    os.kill(where[victim][1], signal.SIGKILL)
    with pytest.raises(SupervisionError, match=f"rank {victim}"):
        fut.get(10)
    assert time.monotonic() - t0 < 3.0
    assert len(ranks.slice(hosts=slice(2, 8)).where.call().get(60).values()) == 6 * PER_HOST

    # A lost host (its link cut; on loopback, frozen) fails only its members' calls, within the host bound.
    fut = ranks.slice(hosts=7).nap.call(30)
    hosts.cut("n8")
    t0 = time.monotonic()
    with pytest.raises(SupervisionError, match="host lost") as lost:
        fut.get(20)
    assert time.monotonic() - t0 < 8.0
    assert "(host n8" in str(lost.value), str(lost.value)   # the host by its name, either way
    assert len(ranks.slice(hosts=slice(2, 7)).where.call().get(60).values()) == 5 * PER_HOST
    hosts.cut("n8", up=True)

    # A relay of the tree cut off mid-call: n3..n7 (rank 37 on n2 is dead) in a tree of width
    # 2 make n6 the relay of n7. Its own ranks fail as a lost host's; n7's replies, sent into
    # the cut relay, are sent again straight to us once it is declared lost.
    os.environ["MONARCH_KERNEL_FANOUT_TREE_WIDTH"] = "2"
    try:
        fut = ranks.slice(hosts=slice(2, 7)).nap.call(2.0)
        pending = runtime().pending_of(fut)
        time.sleep(0.5)   # the call is down the tree
        hosts.cut("n6")
        t0 = time.monotonic()
        with pytest.raises(SupervisionError, match="host lost"):
            fut.get(20)
        n6, n7 = range(3 * PER_HOST, 4 * PER_HOST), range(4 * PER_HOST, 5 * PER_HOST)   # in the slice
        while not all(pending.answered[i] for i in n7) and time.monotonic() - t0 < 10:
            time.sleep(0.1)
        assert all(pending.answered[i] for i in n7), "the cut relay's subtree lost its replies"
        assert [pending.results[i] for i in n7] == [None] * PER_HOST
        assert all("host lost" in str(pending.results[i]) for i in n6)
    finally:
        del os.environ["MONARCH_KERNEL_FANOUT_TREE_WIDTH"]
        hosts.cut("n6", up=True)
