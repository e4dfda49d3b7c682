"""The zygote's memory (node/zygote_memory.py): what a user of many procs notices is the
memory each proc costs and how long a big spawn takes. Real agents, zygotes and procs."""
from __future__ import annotations

import os
import sys
import time

import cloudpickle
import psutil
import pytest

from monarch_kernel.actor import Actor, endpoint, this_host

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _own_memory_mb() -> float:
    """USS: the pages this process does not share (with the zygote, with its siblings)."""
    with open("/proc/self/smaps_rollup") as f:
        rows = {ln.split(":")[0]: int(ln.split(":")[1].split()[0]) for ln in list(f)[1:]}
    return (rows["Private_Dirty"] + rows["Private_Clean"]) / 1024


class Memory(Actor):
    @endpoint
    def own_mb_after_a_full_collection(self) -> tuple[float, float]:
        import gc

        before = _own_memory_mb()
        gc.collect()
        return before, _own_memory_mb()

    @endpoint
    def keep(self, value: str) -> None:
        self.kept = value

    @endpoint
    def kept_value(self) -> str:
        return self.kept


def _zygote_of(host) -> psutil.Process:
    agent = psutil.Process(host._agents[0]["pid"])
    return next(c for c in agent.children() if "zygote" in " ".join(c.cmdline()))


def test_a_full_garbage_collection_in_a_proc_does_not_copy_the_zygote_heap_into_it():
    """A long-running proc runs full collections; one that visited every inherited object
    would write to each one's header and own a private copy of ~40 MB of the zygote's heap
    (x 256 procs: 10 GB). The zygote freezes what it made, so the proc keeps sharing it."""
    host = this_host()
    try:
        procs = host.spawn_procs(per_host={"gpus": 2}, name="gcmem")
        ranks = procs.spawn("mem", Memory)
        for before, after in ranks.own_mb_after_a_full_collection.call().get(60).values():
            assert after - before < 10, f"a gc.collect() made the proc own {after - before:.0f} MB more"
        procs.stop()
    finally:
        host.shutdown()


def test_the_zygote_forks_from_huge_pages_and_its_procs_keep_their_own_state():
    """Forks copy the zygote's page tables; in 2 MB pages they are ~5x cheaper to copy. The
    procs forked from those pages still each write their own copy (copy on write)."""
    if tuple(int(x) for x in os.uname().release.split(".")[:2] if x.isdigit()) < (6, 1):
        pytest.skip("MADV_COLLAPSE needs Linux 6.1 or later")
    host = this_host()
    try:
        zygote = _zygote_of(host)
        deadline = time.monotonic() + 60
        huge_kb = 0
        while time.monotonic() < deadline:   # it collapses while idle, a chunk at a time
            with open(f"/proc/{zygote.pid}/smaps_rollup") as f:
                huge_kb = next(int(ln.split()[1]) for ln in f if ln.startswith("AnonHugePages:"))
            if huge_kb >= 32 * 1024:
                break
            time.sleep(0.2)
        if huge_kb == 0 and not _can_collapse():
            pytest.skip("this kernel gives no transparent huge pages (THP disabled, or none free)")
        assert huge_kb >= 32 * 1024, f"the zygote holds only {huge_kb} kB in huge pages"
        procs = host.spawn_procs(per_host={"gpus": 4}, name="thp")
        ranks = procs.spawn("mem", Memory)
        for i in range(4):
            ranks.slice(gpus=i).keep.call_one(f"rank {i}").get(30)
        assert list(ranks.kept_value.call().get(30).values()) == [f"rank {i}" for i in range(4)]
        procs.stop()
    finally:
        host.shutdown()


def _can_collapse() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def test_a_proc_that_lives_while_the_zygote_idles_keeps_sharing_its_memory():
    """The zygote makes its huge pages only while none of its procs lives: a proc forked
    before would otherwise be left the sole owner of every page it shared (a lone proc's
    own memory went from 6 to ~125 MB a few seconds after it started)."""
    host = this_host()
    try:
        procs = host.spawn_procs(per_host={"gpus": 1}, name="lone")   # at once: the zygote has just started
        ranks = procs.spawn("mem", Memory)
        time.sleep(8)   # the zygote idles (it would have collapsed its memory by now)
        before, after = ranks.own_mb_after_a_full_collection.call_one().get(60)
        assert before < 30, f"a lone proc owns {before:.0f} MB of memory it should share with the zygote"
        procs.stop()
    finally:
        host.shutdown()
