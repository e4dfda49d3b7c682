"""Telemetry: the agent's sampler, its SQL tables seen from the controller, and the proc
log files, against real procs (one private 2-proc mesh for the module)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import types

import cloudpickle
import psutil
import pytest

from monarch_kernel.actor import Actor, endpoint, this_host
from monarch_kernel.telemetry.logs import ProcLogFile, search
from monarch_kernel.telemetry.result import QueryResult
from monarch_kernel.telemetry.sampler import GpuProbe, ProcSampler

cloudpickle.register_pickle_by_value(sys.modules[__name__])   # the procs cannot import this test module


class Worker(Actor):
    @endpoint
    def work(self, n: int) -> int:
        print(f"step {n} done")
        if n < 0:
            raise ValueError("negative step")
        return n * 2


@pytest.fixture(scope="module")
def mesh():
    hm = this_host()
    pm = hm.spawn_procs({"gpus": 2})
    w = pm.spawn("w", Worker)
    yield hm, pm, w
    pm.stop()


def wait_for(fn, within=5.0):
    deadline = time.monotonic() + within
    while True:
        got = fn()
        if got or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


# ----------------------------------------------------------------------- the sampler, alone
def test_cpu_percent_of_a_busy_process_is_measured_between_samples():
    busy = subprocess.Popen([sys.executable, "-c", "print('go', flush=True)\nwhile True: pass"],
                            stdout=subprocess.PIPE)
    try:
        assert busy.stdout.readline() == b"go\n"   # spinning now (start-up is not what we measure)
        s = ProcSampler("h", GpuProbe(nvml=types.SimpleNamespace()))   # no NVML: no GPU
        s.sample([("m", 0, busy.pid)])
        time.sleep(1.0)
        row = s.sample([("m", 0, busy.pid)])[0]
        # a fresh psutil.Process says 0.0 every time; the kept one measures since the last sample
        # (on this shared 2-core machine, at load 20, a spinning process got only 4 % of a core)
        assert psutil.Process(busy.pid).cpu_percent(None) == 0.0
        assert row.cpu_percent > 0.5, row
        assert row.rss_mb > 1 and row.uss_mb > 0 and row.threads >= 1 and row.fds >= 3
    finally:
        busy.kill()
        busy.wait()
        busy.stdout.close()


def test_a_proc_that_vanished_is_skipped_not_an_error():
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert ProcSampler("h").sample([("m", 0, gone.pid), ("m", 1, os.getpid())])[0].rank == 1


def test_no_gpu_here_means_gpu_fields_absent_not_zero():
    probe = GpuProbe()
    assert not probe.available   # this machine has no GPU (NVML missing or finding none)
    row = ProcSampler("h", probe).sample([("m", 0, os.getpid())])[0]
    assert row.gpu_util is None and row.gpu_mem_mb is None


def test_fake_nvml_gives_each_proc_its_gpu_memory_and_utilisation():
    me = os.getpid()
    P = types.SimpleNamespace
    fake = P(nvmlInit=lambda: None, nvmlDeviceGetCount=lambda: 1, nvmlDeviceGetHandleByIndex=lambda i: "gpu0",
             nvmlDeviceGetComputeRunningProcesses=lambda h: [P(pid=me, usedGpuMemory=512 * 2**20)],
             nvmlDeviceGetProcessUtilization=lambda h, since: [P(pid=me, smUtil=73)])
    row = ProcSampler("h", GpuProbe(nvml=fake)).sample([("m", 0, me)])[0]
    assert (row.gpu_util, row.gpu_mem_mb) == (73.0, 512.0)


# ----------------------------------------------------------------------- log files
def test_log_files_rotate_and_grep_tail_and_follow_read_them(tmp_path, monkeypatch):
    monkeypatch.setenv("MONARCH_KERNEL_LOG_MB", "0.01")   # rotate at about 10 KB
    log = ProcLogFile(str(tmp_path / "procs.rank3.log"))
    for i in range(2000):
        log.write("stderr" if i % 100 == 0 else "stdout", f"line {i}\n")
    size = sum(p.stat().st_size for p in tmp_path.iterdir())
    assert len(list(tmp_path.iterdir())) == 3 and size < 40_000   # bounded: the file and 2 backups
    ans = search(tmp_path, "procs", {3}, grep=r"line 19\d0$", tail=3)
    assert [(x.rank, x.text, x.stream) for x in ans["lines"]] == [
        (3, "line 1970", "stdout"), (3, "line 1980", "stdout"), (3, "line 1990", "stdout")]
    assert ans["matched"] == 10 and ans["dropped"] == 7
    assert search(tmp_path, "procs", {0}, grep="line")["lines"] == []   # another rank's file
    log.write("stdout", "after\n")
    new = search(tmp_path, "procs", None, since=ans["since"])["lines"]
    assert [x.text for x in new] == ["after"]
    assert [x.text for x in search(tmp_path, "procs", None, grep="^line 199[05]$")["lines"]] == [
        "line 1990", "line 1995"]   # '^' is the start of the text, not of the stored line


def test_query_result_is_rows_with_columns_and_a_table_repr():
    r = QueryResult([(0, 1.5), (1, None)], ("rank", "rss_mb"))
    assert r[0] == (0, 1.5) and r.columns == ("rank", "rss_mb")
    assert repr(r).splitlines() == ["rank  rss_mb", "0     1.5", "1"]
    assert "<th>rss_mb</th>" in r._repr_html_()
    try:
        import pandas  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="pip install pandas"):
            r.to_pandas()
    else:
        assert list(r.to_pandas().columns) == ["rank", "rss_mb"]


# ----------------------------------------------------------------------- SQL on a real mesh
def test_every_rank_is_sampled_each_second_without_gpu_columns(mesh):
    _, pm, _ = mesh
    sql = "select rank, count(*), max(rss_mb), max(gpu_util), max(gpu_mem_mb) from samples group by rank"
    rows = wait_for(lambda: (lambda rs: rs if len(rs) == 2 else None)([r for r in pm.telemetry.query(sql)
                                                                        if r[1] >= 2]), within=15)
    assert [r[0] for r in rows] == [0, 1]
    assert all(r[2] > 10 and r[3] is None and r[4] is None for r in rows), rows


class Threads(Actor):
    @endpoint
    def zmq_contexts(self) -> int:
        """zmq contexts in this proc: each has one reaper thread."""
        names = []
        for t in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{t}/comm") as f:
                names.append(f.read().strip())
        return names.count("ZMQbg/Reaper")

    @endpoint
    def noop(self) -> None:
        return None

    @endpoint
    def blob(self) -> bytes:
        return b"x" * 200_000


def test_a_proc_sending_many_call_records_or_a_big_reply_keeps_one_zmq_context(mesh):
    """A telemetry pull of thousands of call records, or a 200 KB reply, is over pyzmq's 64 KB
    copy threshold: a proc copies it (core/transport.py PROC_COPY_THRESHOLD), so pyzmq does
    not start its zero-copy garbage collector in every proc (a thread and a zmq context of
    its own: 3 threads and 7 descriptors more a proc)."""
    _, pm, _ = mesh
    t = pm.spawn("threads", Threads)
    for _ in range(3000):   # ~200 KB of records a proc for the next pull
        t.noop.call().get()
    rows = wait_for(lambda: pm.telemetry.query("select count(*) from calls where actor = 'threads'")[0][0] >= 6000,
                    within=20)
    assert rows, "the agent did not pull the procs' call records"
    assert t.zmq_contexts.call().get().values() == [1, 1]
    for _ in range(3):   # and a reply over 64 KB, straight to the caller
        assert len(t.slice(gpus=1).blob.call_one().get()) == 200_000
    assert t.zmq_contexts.call().get().values() == [1, 1]


def test_calls_and_their_failures_land_in_the_calls_table(mesh):
    _, pm, w = mesh
    w.work.call(3).get()
    with pytest.raises(Exception, match="negative step"):
        w.slice(gpus=0).work.call_one(-1).get()
    rows = wait_for(lambda: [r for r in pm.telemetry.query(
        "select rank, actor, endpoint, ok, seconds from calls where endpoint = 'work'") if not r[3]], within=10)
    assert rows and rows[0][:4] == (0, "w", "work", 0)
    rows = pm.telemetry.query("select rank, ok, seconds from calls where actor = 'w'")
    assert {(r[0], r[1]) for r in rows} >= {(0, 1), (1, 1), (0, 0)} and all(0 <= r[2] < 5 for r in rows)


def test_a_killed_proc_is_a_died_event_with_its_signal_then_respawned(mesh):
    _, pm, w = mesh
    os.kill(pm.procs()[1].pid, signal.SIGKILL)
    died = wait_for(lambda: pm.telemetry.query(
        "select rank, detail from proc_events where event = 'died'"), within=10)
    assert died == [(1, "killed by signal SIGKILL")]
    pm.respawn()
    events = pm.telemetry.query("select rank, event from proc_events order by time")
    assert [e for r, e in events if r == 1] == ["spawned", "died", "respawned"]


def test_output_is_kept_on_the_host_and_grep_finds_it(mesh):
    _, pm, w = mesh
    w.work.call(41).get()
    ans = pm.telemetry.logs(grep=r"step 41 ")
    assert sorted(x.rank for x in ans["lines"]) == [0, 1] and ans["lines"][0].text == "step 41 done"
    with pytest.raises(ValueError, match="not a valid regular expression"):
        pm.telemetry.logs(grep="(")


def test_sampling_off_stops_new_samples_and_a_bad_query_names_the_tables(mesh):
    _, pm, _ = mesh
    tel = pm.telemetry
    tel.sampling(0)
    try:
        time.sleep(0.3)
        before = tel.query("select count(*) from samples")[0][0]
        time.sleep(1.5)
        assert tel.query("select count(*) from samples")[0][0] == before
    finally:
        tel.sampling(1.0)
    with pytest.raises(ValueError, match="Tables: samples, proc_events, calls, cells"):
        tel.query("select nope from samples")


# ----------------------------------------------------------------------- the Mesh panel's server API
def test_server_api_describes_meshes_from_connection_files_without_attaching():
    from monarch_kernel.telemetry import server

    hm = this_host("tel-server-api")
    try:
        pm = hm.spawn_procs({"gpus": 2})
        time.sleep(1.5)   # a sample or two
        found = {m["name"]: m for m in server._meshes()}
        assert found["tel-server-api"]["alive"]
        m = wait_for(lambda: (lambda d: d if len(d["procs"][0]["rss_hist"]) >= 1 else None)(
            server.describe_mesh("tel-server-api", found["tel-server-api"]["info"], True)), within=10)
        assert [p["rank"] for p in m["procs"]] == [0, 1] and {p["state"] for p in m["procs"]} == {"idle"}
        assert m["controller_pids"] == [os.getpid()] and m["gpu"] is False
        assert m["procs"][0]["rss_mb"] > 10 and m["procs"][0]["gpu_util"] is None

        os.kill(pm.procs()[0].pid, signal.SIGKILL)
        m = wait_for(lambda: (lambda d: d if d["procs"][0]["state"] == "dead" else None)(
            server.describe_mesh("tel-server-api", found["tel-server-api"]["info"], True)), within=10)
        assert m and m["procs"][0]["cpu"] is None
    finally:
        hm.shutdown()


def test_the_panel_sees_a_job_that_lost_one_host_of_two_as_running_with_a_host_gone_and_its_stop_ends_the_rest():
    """The Mesh panel's server: a job whose agent on one host was killed still runs on the
    other (its ranks answer); it read "not running", with the stop button disabled, so the
    living agents could not be stopped from the panel."""
    import asyncio

    from monarch_kernel.core.transport import pid_alive as _running  # (a zombie is not running)
    from monarch_kernel.job import ProcessJob
    from monarch_kernel.telemetry import server

    job = ProcessJob(meshes={"hosts": 2}, name="tel-lost-host")
    pids = []
    try:
        job.state().hosts.spawn_procs(per_host={"gpus": 1})
        pids = [a["pid"] for a in job._agents]
        found = {m["name"]: m for m in server._meshes()}["tel-lost-host"]
        m = server.describe_mesh("tel-lost-host", found["info"], True)   # (the panel looked before)
        assert [(p["rank"], p["state"]) for p in m["procs"]] == [(0, "idle"), (1, "idle")], m
        os.kill(pids[1], signal.SIGKILL)
        assert wait_for(lambda: not _running(pids[1]), within=10)
        found = {m["name"]: m for m in server._meshes()}["tel-lost-host"]
        assert found["alive"] and found["hosts_gone"] == 1, found
        m = server.describe_mesh("tel-lost-host", found["info"], found["alive"], found["hosts_gone"])
        # its rank is still listed, as its host's: it went with it (it was dropped from the panel)
        assert m["hosts_gone"] == 1 and len(m["hosts"]) == 1 and m["hosts_silent"] == 0, m
        assert [(p["rank"], p["state"], p["cpu"]) for p in m["procs"]] == [(0, "idle", m["procs"][0]["cpu"]),
                                                                          (1, "host gone", None)], m
        job.disconnect()   # (the panel's stop is another process's: the job as cached)

        class Stop(server.StopHandler):   # its post, without a web server around it
            def __init__(self):
                self.sent = []

            def finish(self, body):
                self.sent.append(body)

        handler = Stop()
        asyncio.run(server.StopHandler.post.__wrapped__(handler, "tel-lost-host"))
        assert handler.sent and "stopped" in handler.sent[0]
        assert wait_for(lambda: not _running(pids[0]), within=15)
        assert "tel-lost-host" not in {m["name"] for m in server._meshes()}
    finally:
        job.kill()
        assert not [p for p in pids if _running(p)]


def test_the_panel_lists_the_ranks_of_a_host_whose_agent_does_not_answer_as_unreachable():
    """A host cut off or stopped (on a cluster the panel cannot check a remote agent's pid):
    its ranks vanished from the panel and nothing said so ("1 proc on 1 host"); now they stay,
    unreachable, and the mesh names the host that does not answer, until it answers again."""
    from monarch_kernel.core.transport import pid_alive as _running
    from monarch_kernel.job import ProcessJob
    from monarch_kernel.telemetry import server

    job = ProcessJob(meshes={"hosts": 2}, name="tel-silent-host")
    pids = []
    try:
        job.state().hosts.spawn_procs(per_host={"gpus": 1})
        pids = [a["pid"] for a in job._agents]
        info = {m["name"]: m for m in server._meshes()}["tel-silent-host"]["info"]
        before = server.describe_mesh("tel-silent-host", info, True)
        assert [p["state"] for p in before["procs"]] == ["idle", "idle"] and len(before["hosts"]) == 2, before
        os.kill(pids[1], signal.SIGSTOP)
        try:
            m = server.describe_mesh("tel-silent-host", info, True)
            assert m["hosts_silent"] == 1 and m["hosts_gone"] == 0 and sorted(m["hosts"]) == sorted(before["hosts"])
            assert [(p["rank"], p["state"]) for p in m["procs"]] == [(0, "idle"), (1, "unreachable")], m
            assert m["procs"][1]["pid"] == before["procs"][1]["pid"] and m["procs"][1]["cpu"] is None
        finally:
            os.kill(pids[1], signal.SIGCONT)
    finally:
        job.kill()
        assert wait_for(lambda: not [p for p in pids if _running(p)], within=15)


def test_fake_gpu_samples_give_the_panel_a_gpu_line_and_none_without(monkeypatch):
    from monarch_kernel.telemetry import server
    from monarch_kernel.telemetry.store import TelemetryStore

    st = TelemetryStore()
    monkeypatch.setattr(server, "store", lambda: st)
    now = time.time()
    rows = [(now - 2 + i, "h", "procs", r, 100 + r, 10.0, 100.0, 50.0, 4, 20, 30.0 + i if r == 0 else None,
             512.0 if r == 0 else None, "m1") for i in range(3) for r in (0, 1)]
    st.insert("tcp://fake:1", {"cursor": 6, "agent": "fake-gpu", "host": "h", "gpu": True,
                               "rows": {"samples": rows}})
    got = server._latest("fake-gpu")
    assert got[("procs", 0)]["gpu_hist"] == [30.0, 31.0, 32.0] and got[("procs", 1)]["gpu_hist"] == []


def test_a_mesh_spawned_again_under_the_same_name_sees_only_its_own_rows():
    """Three ranks of 'again' stopped, then two: the second mesh's query shows ranks 0-1 only
    (rows were kept by mesh name, so the old rank 2 and its 'stopped' events showed up)."""
    hm = this_host()
    old = hm.spawn_procs({"gpus": 3}, name="again")
    wait_for(lambda: len(old.telemetry.query("select distinct rank from samples")) == 3, within=15)
    old.stop().get()
    new = hm.spawn_procs({"gpus": 2}, name="again")
    try:
        wait_for(lambda: len(new.telemetry.query("select distinct rank from samples")) == 2, within=15)
        assert [r[0] for r in new.telemetry.query("select distinct rank from samples order by rank")] == [0, 1]
        assert {e for _, e in new.telemetry.query("select rank, event from proc_events")} == {"spawned"}
    finally:
        new.stop().get()
