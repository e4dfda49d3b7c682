"""Reliability as a user meets it (issue 9): stalls, dead hosts, leaks, hangs.

Real procs throughout: agents are frozen with SIGSTOP and killed with SIGKILL, and the
mesh must come back or fail at once with an error that names it.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import cloudpickle
import pytest

from monarch_kernel.actor import Actor, ActorError, SupervisionError, endpoint, this_host
from monarch_kernel.core.errors import MeshGoneError
from monarch_kernel.core.runtime import runtime

STRANGER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "stranger.py")

cloudpickle.register_pickle_by_value(sys.modules[__name__])


class Counter(Actor):
    def __init__(self):
        self.n = 0

    @endpoint
    def bump(self) -> int:
        self.n += 1
        return self.n

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def sleep(self, s: float) -> None:
        time.sleep(s)


def _run_script(code: str, timeout: float = 90, env: dict | None = None) -> str:
    """Run ``code`` in a fresh controller process (its own runtime and agents)."""
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                       timeout=timeout, env={**os.environ, "MONARCH_KERNEL_NO_TORCH": "1", **(env or {})},
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


# ---------------------------------------------------------------- 1. stalls are not deaths
def test_a_frozen_host_agent_comes_back_with_its_procs_and_state_and_reports_what_failed():
    hm = this_host("stall-test", lease=60)
    try:
        pm = hm.spawn_procs(per_host={"gpus": 2}, name="stalled")
        c = pm.spawn("c", Counter)
        assert c.bump.call().get(30).values() == [1, 1]
        agent = hm._agents[0]["pid"]
        waiting = hm.status  # an agent request in flight during the freeze fails, and is reported
        os.kill(agent, signal.SIGSTOP)
        try:
            fut = runtime().agent_request(hm._agents[0]["addr"], hm._key, "status",
                                          timeout_what="status during the freeze")
            with pytest.raises(SupervisionError, match="silent|unreachable"):
                fut.get(15)
            time.sleep(0.5)
        finally:
            os.kill(agent, signal.SIGCONT)
        deadline = time.monotonic() + 10
        while pm.dead_ranks() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert pm.dead_ranks() == []
        assert c.bump.call().get(30).values() == [2, 2]      # same procs, state kept
        assert [r["state"] for r in waiting()] == ["alive", "alive"]
        report = runtime().outages[-1]
        assert report["procs_back"] == 2 and "status during the freeze" in report["failed"], report
    finally:
        hm.shutdown()


def test_a_sync_of_many_tiny_files_does_not_lose_the_host(tmp_path):
    # 20,000 files take the agent several seconds to write: longer than a 1 s host timeout.
    src = tmp_path / "many"
    for d in range(20):
        (src / f"d{d}").mkdir(parents=True)
        for i in range(1000):
            (src / f"d{d}" / f"f{i}.txt").write_text(str(i))
    out = _run_script(f"""
        from monarch_kernel.actor import Actor, endpoint, this_host
        class A(Actor):
            @endpoint
            def ping(self): return 1
        pm = this_host().spawn_procs(per_host={{"gpus": 1}})
        a = pm.spawn("a", A)
        pm.sync_workspace([{str(src)!r}])
        print("PING", a.ping.call().get(10).values(), pm.dead_ranks())
        """, env={"MONARCH_KERNEL_HOST_TIMEOUT_S": "1.0", "MONARCH_KERNEL_HOME": str(tmp_path / "home")})
    assert "PING [1] []" in out, out


# ---------------------------------------------------------------- 3. dead hosts fail at once
def test_requests_to_a_killed_host_fail_at_once_naming_the_mesh_and_this_host_starts_a_new_agent():
    hm = this_host("dead-host-test", lease=60)
    pm = hm.spawn_procs(per_host={"gpus": 2}, name="trainers")
    c = pm.spawn("c", Counter)
    c.bump.call().get(30)
    os.kill(hm._agents[0]["pid"], signal.SIGKILL)
    hm.local_process.wait(10)
    time.sleep(1.2)   # the controller notices a dead local agent within about a heartbeat
    t0 = time.monotonic()
    with pytest.raises(SupervisionError) as call_err:
        c.bump.call().get(10)
    assert "mesh 'trainers'" in str(call_err.value) and "other ranks keep their state" not in str(call_err.value)
    with pytest.raises(MeshGoneError, match="trainers"):
        pm.respawn()
    with pytest.raises(MeshGoneError, match="dead-host-test"):
        hm.spawn_procs(per_host={"gpus": 1})
    assert time.monotonic() - t0 < 3.0
    hm2 = this_host("dead-host-test", lease=60)
    try:
        assert hm2 is not hm
        assert hm2.spawn_procs(per_host={"gpus": 1}).spawn("c", Counter).bump.call().get(30).values() == [1]
    finally:
        hm2.shutdown()


# ---------------------------------------------------------------- 4. exceptions we cannot rebuild
class TwoArgError(Exception):
    def __init__(self, a, b):
        super().__init__(f"{a} and {b}")   # args == ("1 and 2",): cls(*args) fails on unpickle


class Raiser(Actor):
    @endpoint
    def two_args(self) -> None:
        raise TwoArgError(1, 2)

    @endpoint
    def worker_only(self, folder: str) -> None:
        sys.path.insert(0, folder)
        import worker_only_module

        raise worker_only_module.WorkerOnlyError("only the worker can import me")

    @endpoint
    def fine(self) -> int:
        return 7


def test_exceptions_the_controller_cannot_rebuild_fail_the_call_with_the_remote_traceback(tmp_path):
    (tmp_path / "worker_only_module.py").write_text("class WorkerOnlyError(Exception):\n    pass\n")
    pm = this_host().spawn_procs(per_host={"gpus": 1}, name="raisers")
    try:
        r = pm.spawn("r", Raiser)
        with pytest.raises(ActorError) as two:
            r.two_args.call_one().get(15)
        assert two.value.exc_type == "TwoArgError" and "raise TwoArgError(1, 2)" in two.value.remote_traceback
        assert "could not be rebuilt" in two.value.cause_error
        with pytest.raises(ActorError) as only:
            r.worker_only.call_one(str(tmp_path)).get(15)
        assert "WorkerOnlyError: only the worker can import me" in only.value.remote_traceback
        assert "No module named 'worker_only_module'" in only.value.cause_error
        assert r.fine.call_one().get(15) == 7
    finally:
        pm.stop()


# ---------------------------------------------------------------- 7. no fd leak per stopped proc
def test_spawn_and_stop_cycles_leave_the_controller_fd_count_flat():
    out = _run_script("""
        import os, resource
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
        from monarch_kernel.actor import Actor, endpoint, this_host
        class A(Actor):
            @endpoint
            def ping(self): return 1
        hm = this_host()
        def cycle():
            pm = hm.spawn_procs(per_host={"gpus": 2})
            pm.spawn("a", A).ping.call().get(10)
            pm.stop()
        cycle()
        before = len(os.listdir("/proc/self/fd"))
        for _ in range(60):
            cycle()
        print("FDS", before, len(os.listdir("/proc/self/fd")))
        """, timeout=120)
    before, after = map(int, out.split("FDS")[1].split())
    assert after - before <= 2, f"{after - before} fds leaked over 60 spawn/stop cycles of 2 procs"


# ---------------------------------------------------------------- 10. the CPU column
class Spinner(Actor):
    @endpoint
    def spin(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            pass


def test_status_cpu_column_shows_a_busy_rank_busy_and_an_idle_one_idle():
    hm = this_host("cpu-column-test", lease=60)   # its own agent: other tests see none of its events
    try:
        pm = hm.spawn_procs(per_host={"gpus": 2}, name="spinners")
        s = pm.spawn("s", Spinner)
        busy = s.slice(gpus=0).spin.call(3.0)
        time.sleep(0.5)
        hm.status()
        time.sleep(1.0)
        rows = {r["rank"]: r for r in hm.status() if r["mesh"] == "spinners"}
        # A loaded 2-core CI machine gives a spinning proc far less than 100%: compare the two.
        assert rows[0]["cpu"] >= 10 and rows[1]["cpu"] < rows[0]["cpu"] / 2, rows
        busy.get(10)
    finally:
        hm.shutdown()


# ---------------------------------------------------------------- 11. stopped actor meshes are gone
def test_a_stopped_actor_mesh_is_gone_here_and_for_a_controller_that_attaches_later():
    hm = this_host("stopped-actors-test", lease=60)
    try:
        pm = hm.spawn_procs(per_host={"gpus": 1}, name="pm")
        kept, stopped = pm.spawn("kept", Counter), pm.spawn("stopped", Counter)
        kept.bump.call().get(30)
        stopped.stop()
        assert sorted(pm.actor_meshes()) == ["kept"]
        out = _run_script("""
            from monarch_kernel.actor import attach
            hm = attach("stopped-actors-test")
            pm = hm.proc_mesh("pm")
            print("ACTORS", sorted(pm.actor_meshes()))
            hm.detach()
            """)
        assert "ACTORS ['kept']" in out, out
    finally:
        hm.shutdown()


# ---------------------------------------------------------------- 9. interrupting async endpoints
class Sleeper(Actor):
    def __init__(self):
        self.cancelled = 0

    @endpoint
    async def wait_forever(self) -> None:
        import asyncio

        try:
            await asyncio.sleep(1000)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise

    @endpoint
    async def cancelled_count(self) -> int:
        return self.cancelled


def test_interrupt_cancels_a_stuck_async_endpoint_and_the_actor_serves_the_next_call():
    pm = this_host().spawn_procs(per_host={"gpus": 2}, name="sleepers")
    try:
        s = pm.spawn("s", Sleeper)
        stuck = s.wait_forever.call()
        time.sleep(0.3)
        assert [st["state"] for st in pm.states().values()] == ["awaiting s.wait_forever"] * 2
        pm.interrupt()
        with pytest.raises(ActorError, match="interrupted: s.wait_forever was cancelled"):
            stuck.get(10)
        assert s.cancelled_count.call().get(10).values() == [1, 1]   # CancelledError ran in the endpoint
        assert [st["state"] for st in pm.states().values()] == ["idle", "idle"]
    finally:
        pm.stop()


# ---------------------------------------------------------------- 2. spawn limits
def _agent_children(hm) -> int:
    import psutil

    return len(psutil.Process(hm._agents[0]["pid"]).children(recursive=True)) - 1   # minus the zygote


@pytest.mark.parametrize("env, match", [({"MONARCH_KERNEL_MAX_PROCS": "4"}, "holds at most 4"),
                                        ({"MONARCH_KERNEL_PROC_MEM_MB": "100000000"}, "MB are available")])
def test_a_spawn_the_host_cannot_hold_is_refused_before_forking_and_the_mesh_keeps_working(
        monkeypatch, env, match):
    for k, v in env.items():
        monkeypatch.setenv(k, v)   # the agent started below reads them
    hm = this_host("spawn-limit-test", lease=60)
    try:
        if "MONARCH_KERNEL_MAX_PROCS" in env:
            kept = hm.spawn_procs(per_host={"gpus": 2}, name="kept").spawn("c", Counter)
            kept.bump.call().get(30)
            n_before = _agent_children(hm)
        with pytest.raises(ValueError, match=match):
            hm.spawn_procs(per_host={"gpus": 10000 if "MONARCH_KERNEL_MAX_PROCS" in env else 2})
        time.sleep(0.5)
        if "MONARCH_KERNEL_MAX_PROCS" in env:
            assert _agent_children(hm) == n_before, "procs were forked for a refused spawn"
            assert kept.bump.call().get(30).values() == [2, 2]
            assert len(hm.spawn_procs(per_host={"gpus": 2}, name="more")) == 2   # within the cap: fine
        else:
            assert _agent_children(hm) == 0
    finally:
        hm.shutdown()


def test_256_procs_on_one_host_need_no_setting_and_each_starts_well_under_the_memory_assumed(monkeypatch):
    """Issue 11's 256 procs on this 2-core machine, as a user writes it, with the limits left at
    their defaults (they refused it: a cap of 64 and 150 MB assumed a proc). The default of
    MONARCH_KERNEL_PROC_MEM_MB must stay above what a fresh proc really takes."""
    import psutil

    from monarch_kernel import config

    monkeypatch.delenv("MONARCH_KERNEL_MAX_PROCS", raising=False)
    monkeypatch.delenv("MONARCH_KERNEL_PROC_MEM_MB", raising=False)
    if psutil.virtual_memory().available < 256 * 40 * 2**20:
        pytest.skip("less than 10 GiB of memory available: 256 procs would rightly be refused here")
    hm = this_host("spawn-256-defaults", lease=60)
    try:
        pm = hm.spawn_procs(per_host={"gpus": 256})
        c = pm.spawn("c", Counter)
        pids = c.pid.call().get(120).values()
        assert len(set(pids)) == 256
        own_mb = [psutil.Process(p).memory_full_info().uss / 2**20 for p in pids[::32]]
        assert max(own_mb) < config.PROC_MEM_MB.default / 2, own_mb
        table = pm._repr_html_()   # one row: ranks 0-255 on one host, alive (not 256 rows)
        assert table.count("<tr><td>") == 1 and "<td>0-255</td><td>gpus=0-255</td>" in table, table
        pm.stop()
        assert _agent_children(hm) == 0
    finally:
        hm.shutdown()


# ---------------------------------------------------------------- 6. unauthenticated peers are cheap
def test_a_huge_frame_and_many_idle_connections_from_a_peer_without_the_key_cost_the_agent_little():
    import socket

    import psutil

    hm = this_host("flood-test", lease=60)
    socks = []
    stranger = None
    try:
        agent = psutil.Process(hm._agents[0]["pid"])
        rss0, fds0 = agent.memory_info().rss, agent.num_fds()
        peak = [rss0]
        done = threading.Event()

        def watch():   # the frame is freed once dropped: catch the peak while it arrives
            while not done.is_set():
                peak[0] = max(peak[0], agent.memory_info().rss)
                time.sleep(0.005)
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        # No key: must not be allocated. A raw ZMTP peer (tests/scripts/stranger.py), since a
        # zmq DEALER without CURVE never completes the agent's handshake and its send of 256 MiB
        # can block for good (CI saw it hang).
        host, port = hm._agents[0]["addr"][len("tcp://"):].split("?", 1)[0].rsplit(":", 1)
        stranger = subprocess.Popen([sys.executable, STRANGER, host, port, "frame", "256"],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert stranger.stdout.readline().strip(), "the stranger said nothing"
        time.sleep(2)
        done.set()
        watcher.join()
        assert peak[0] - rss0 < 64 << 20, "the agent allocated the unauthenticated frame"
        socks = [socket.create_connection((host, int(port))) for _ in range(300)]   # idle, no handshake
        time.sleep(4)
        assert agent.num_fds() - fds0 < 20, "idle unauthenticated connections still hold the agent's fds"
        pm = hm.spawn_procs(per_host={"gpus": 1}, name="after-flood")
        assert pm.spawn("c", Counter).bump.call().get(30).values() == [1]
    finally:
        if stranger is not None:
            stranger.stdin.close()
            stranger.wait(10)
        for s in socks:
            s.close()
        hm.shutdown()


# ---------------------------------------------------------------- 5. replayed frames are dropped
class _RecordingProxy:
    """A ZeroMQ proxy between the controller and an agent that records every message the
    controller sends: the real frames an eavesdropper on the link would capture (were it
    not CURVE: the proxy holds the agents' keys). It listens on the agent's port at another
    loopback address (frames name the port they are for)."""

    def __init__(self, target: str, listen: str, key: bytes):
        import zmq

        from monarch_kernel.core import curve

        self.ctx = zmq.Context()
        self.key = curve.agent_keys(key)
        self.front = self.ctx.socket(zmq.ROUTER)
        curve.bind(self.front, listen, self.key[1])
        self.addr = self.front.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.target = target
        self.back = None   # connected with the controller's identity (the agent answers to it)
        self.sent: list[list[bytes]] = []
        self.closing = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        import zmq

        from monarch_kernel.core import curve

        poller = zmq.Poller()
        poller.register(self.front, zmq.POLLIN)
        ident = None
        while not self.closing:
            for sock, _ in poller.poll(50):
                if sock is self.front:
                    ident, *frames = self.front.recv_multipart()
                    if self.back is None:
                        self.back = self.ctx.socket(zmq.DEALER)
                        self.back.setsockopt(zmq.ROUTING_ID, ident)
                        curve.connect(self.back, self.target, self.key[0])
                        poller.register(self.back, zmq.POLLIN)
                    self.sent.append(frames)
                    self.back.send_multipart(frames)
                else:
                    self.front.send_multipart([ident, *self.back.recv_multipart()])

    def close(self):
        self.closing = True
        self.thread.join(2)
        self.ctx.destroy(0)


def _replay(addr: str, captured: list, sock_type, server_key: bytes | None = None) -> None:
    """Send ``captured`` from a new connection that got past CURVE (it knows the server key)."""
    import zmq

    from monarch_kernel.core import curve

    ctx = zmq.Context()
    s = ctx.socket(sock_type)
    curve.connect(s, addr, server_key)
    for frames in captured:                   # the same frames, from another connection
        s.send_multipart(frames)
    time.sleep(1.5)
    ctx.destroy(0)


def test_a_captured_spawn_replayed_to_its_agent_or_another_agent_of_the_mesh_forks_nothing():
    import zmq

    from monarch_kernel.actor import attach_to_workers
    from monarch_kernel.core.connection import new_key
    from monarch_kernel.launch.local import start_local_agent

    key = new_key()
    agent, process = start_local_agent(key, name="replay-test", persistent=False, lease=60)
    other, other_process = start_local_agent(key, name="replay-other", persistent=False, lease=60)
    port = agent["addr"].rsplit(":", 1)[1]
    proxy = _RecordingProxy(agent["addr"], f"tcp://127.0.0.2:{port}", key)
    hm = attach_to_workers([proxy.addr], key, name="replay-test")
    try:
        pm = hm.spawn_procs(per_host={"gpus": 1}, name="replayed")
        c = pm.spawn("c", Counter)
        assert c.bump.call().get(30).values() == [1]
        captured = list(proxy.sent)               # hello, spawn, register, heartbeats...
        assert any(b"spawn" in f[0] for f in captured)
        for addr, proc in ((agent["addr"], process), (other["addr"], other_process)):
            children = _agent_children_of(proc.pid)
            _replay(addr, captured, zmq.DEALER, proxy.key[0])
            assert _agent_children_of(proc.pid) == children, f"a replayed spawn forked procs ({addr})"
        assert c.bump.call().get(30).values() == [2]
    finally:
        hm.shutdown()
        proxy.close()
        process.wait(10)
        other_process.terminate()
        other_process.wait(10)


def _agent_children_of(pid: int) -> int:
    import psutil

    return len(psutil.Process(pid).children(recursive=True))


def _record_stamped(monkeypatch, rt) -> list:
    """(destination, frames) of every message this runtime sends, exactly as on the wire."""
    captured: list[tuple[bytes, list[bytes]]] = []
    stamp, sign_one = rt.keyring.stamp, rt.keyring.sign_one

    def recording(sealed, dest):
        frames = stamp(sealed, dest)
        captured.append((dest, [bytes(f) for f in frames]))
        return frames

    def recording_one(key, header, dest):   # a message of one frame (call_one of plain values)
        frame = sign_one(key, header, dest)
        captured.append((dest, [frame]))
        return frame
    monkeypatch.setattr(rt.keyring, "stamp", recording)
    monkeypatch.setattr(rt.keyring, "sign_one", recording_one)
    return captured


def test_a_captured_call_replayed_to_the_proc_does_not_run_again(monkeypatch):
    import zmq

    from monarch_kernel.core import wire

    pm = this_host().spawn_procs(per_host={"gpus": 1}, name="replay-calls")
    try:
        c = pm.spawn("c", Counter)
        captured = _record_stamped(monkeypatch, runtime())
        assert c.bump.call().get(30).values() == [1]
        monkeypatch.undo()
        work = pm.procs()[0].work
        (frames,) = [f for d, f in captured if d == wire.dest_id(work)]
        _replay(work, [frames, frames], zmq.PUSH)   # the same call, sent again twice
        assert c.bump.call().get(30).values() == [2], "a replayed call ran again"
    finally:
        pm.stop()


def test_a_call_captured_on_its_way_to_one_proc_is_refused_by_another_proc_of_the_mesh(monkeypatch):
    """Issue 9 item 5: the destination is inside the MAC, so a frame for rank 0 sent to rank 1
    (same mesh, same key, a sequence number rank 1 never saw from that sender) is dropped."""
    import zmq

    from monarch_kernel.core import wire

    pm = this_host().spawn_procs(per_host={"gpus": 2}, name="replay-dest")
    rt = runtime()
    got: list = []
    orig = rt.output
    try:
        c = pm.spawn("c", Counter)
        assert c.bump.call().get(30).values() == [1, 1]
        captured = _record_stamped(monkeypatch, rt)
        assert c.slice(gpus=0).bump.call_one().get(30) == 2    # to rank 0 only
        monkeypatch.undo()
        r0, r1 = pm.procs()
        (frames,) = [f for d, f in captured if d == wire.dest_id(r0.work)]
        rt.output = lambda rank, stream, text: got.append((rank, text))
        _replay(r1.work, [frames], zmq.PUSH)
        assert c.bump.call().get(30).values() == [3, 2], "rank 1 ran a call captured on its way to rank 0"
        assert any(rank == 1 and "addressed to another socket" in text for rank, text in got), got
    finally:
        rt.output = orig
        pm.stop()


# ---------------------------------------------------------------- CurveZMQ between hosts
def test_curve_links_work_and_refuse_a_plain_peer_even_with_a_validly_signed_message():
    # One host, but every link forced onto tcp with CURVE (as between two hosts).
    out = _run_script("""
        import time, zmq
        from monarch_kernel.actor import Actor, endpoint, this_host
        from monarch_kernel.core.runtime import runtime
        class C(Actor):
            def __init__(self): self.n = 0
            @endpoint
            def bump(self): self.n += 1; return self.n
        pm = this_host().spawn_procs(per_host={"gpus": 2})
        c = pm.spawn("c", C)
        print("CALLS", c.bump.call().get(30).values())
        rt = runtime()
        ref = pm.procs()[0]
        frames = rt.pack_to(ref.work, pm._state.key, ("call", c._state.id, "bump", (), {}, rt.address, 0, None))
        ctx = zmq.Context(); s = ctx.socket(zmq.PUSH); s.connect(ref.work.split("?")[0])   # plain ZMTP
        s.send_multipart(frames); time.sleep(1.0); ctx.destroy(0)
        print("AFTER", c.bump.call().get(30).values())
        """, env={"MONARCH_KERNEL_CURVE": "always", "MONARCH_KERNEL_SAME_HOST_IPC": "0"})
    assert "CALLS [1, 1]" in out and "AFTER [2, 2]" in out, out


# ---------------------------------------------------------------- sync of paths a user cannot read
@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/usr/bin/setpriv"),
                    reason="needs root and setpriv to run the walk as an unprivileged user")
def test_sync_walk_reports_unreadable_links_and_gitignores_instead_of_raising():
    import shutil
    import tempfile

    d = tempfile.mkdtemp(prefix="mk-perm-")
    try:
        os.chmod(d, 0o755)
        os.makedirs(f"{d}/pkg/sub")
        with open(f"{d}/pkg/a.py", "w") as f:
            f.write("x = 1\n")
        with open(f"{d}/pkg/sub/.gitignore", "w") as f:
            f.write("*.tmp\n")
        os.chmod(f"{d}/pkg/sub/.gitignore", 0)
        os.symlink("/proc/1/cwd", f"{d}/pkg/link")      # a link only root may follow
        for p in (f"{d}/pkg", f"{d}/pkg/sub", f"{d}/pkg/a.py"):
            os.chmod(p, 0o755)
        # The walk's module (stdlib only) is copied beside the tree: the checkout itself may sit
        # where the unprivileged user cannot read (a fresh clone under a 0700 temp dir).
        from monarch_kernel.sync import manifest

        os.makedirs(f"{d}/mod")
        shutil.copy(manifest.__file__, f"{d}/mod/walk_under_test.py")
        os.chmod(f"{d}/mod", 0o755)
        os.chmod(f"{d}/mod/walk_under_test.py", 0o644)
        code = (f"from walk_under_test import build_manifest\n"
                f"m = build_manifest({d + '/pkg'!r})\n"
                f"print('ENTRIES', [e[0] for e in m.entries]); print('PROBLEMS', [p.path for p in m.problems])")
        r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                            os.path.realpath(sys.executable), "-c", code],
                           capture_output=True, text=True, timeout=60, cwd=d,
                           env={"PATH": os.environ.get("PATH", ""), "PYTHONPATH": f"{d}/mod"})
        assert r.returncode == 0, r.stderr
        assert "ENTRIES ['a.py']" in r.stdout and "'link'" in r.stdout and "'sub/.gitignore'" in r.stdout, r.stdout
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_when_one_host_refuses_a_spawn_the_other_hosts_stop_their_share(monkeypatch):
    from monarch_kernel.actor import attach_to_workers
    from monarch_kernel.core.connection import new_key
    from monarch_kernel.launch.local import start_local_agent

    key = new_key()
    roomy, roomy_proc = start_local_agent(key, name="abort-roomy", persistent=False, lease=60)
    monkeypatch.setenv("MONARCH_KERNEL_MAX_PROCS", "1")
    tight, tight_proc = start_local_agent(key, name="abort-tight", persistent=False, lease=60)
    hm = attach_to_workers([roomy["addr"], tight["addr"]], key, name="abort-test")
    try:
        with pytest.raises(ValueError, match="holds at most 1"):
            hm.spawn_procs(per_host={"gpus": 2})
        assert _wait_for(lambda: _agent_children_of(roomy_proc.pid) == 1, 5), \
            "the host that accepted kept its procs of a failed spawn"
        assert len(hm.spawn_procs(per_host={"gpus": 1})) == 2   # a spawn both can hold works
    finally:
        hm.shutdown()
        for p in (roomy_proc, tight_proc):
            p.wait(10)


def _wait_for(cond, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def test_an_agent_bound_on_every_interface_is_reachable_through_loopback_too():
    """CURVE is chosen by the address a peer dials: an agent bound on 0.0.0.0 (CURVE off this
    host) still answers a controller on its host that dials 127.0.0.1 (plain, MAC only)."""
    import select

    from monarch_kernel.actor import attach_to_workers
    from monarch_kernel.core.connection import new_key

    key = new_key()
    agent = subprocess.Popen([sys.executable, "-m", "workers.agent", "--bind", "0.0.0.0",
                              "--parent-pid", str(os.getpid())], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                             env=dict(os.environ, MONARCH_KERNEL_KEY=key.hex(), MONARCH_KERNEL_CURVE="auto"),
                             start_new_session=True)
    try:
        line, deadline = b"", time.monotonic() + 60
        while not line.endswith(b"\n") and time.monotonic() < deadline:
            if select.select([agent.stdout], [], [], 1)[0]:
                chunk = os.read(agent.stdout.fileno(), 4096)
                assert chunk, f"the agent exited at start (code {agent.wait()})"
                line += chunk
        advertised = line.decode().split()[1]
        assert not advertised.startswith("tcp://127."), advertised   # it tells peers a real address
        hosts = attach_to_workers(["tcp://127.0.0.1:" + advertised.rsplit(":", 1)[1]], key, name="wildcard")
        procs = hosts.spawn_procs(per_host={"gpus": 1})
        assert procs.spawn("c", Counter).bump.call_one().get(30) == 1
        procs.stop()
    finally:
        agent.send_signal(signal.SIGKILL)   # its zygote and procs die with it (PDEATHSIG)
        agent.wait(10)
        agent.stdout.close()
