"""Code sync on a real mesh: edit-sync-call, deletions, excludes, no-op resyncs, escape
attempts sent straight to an agent, a killed agent mid-sync, a full disk, --env."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import cloudpickle
import pytest

from monarch_kernel.actor import Actor, attach_to_workers, endpoint, this_host
from monarch_kernel.core.connection import new_key
from monarch_kernel.core.runtime import runtime
from monarch_kernel.launch.local import start_local_agent
from monarch_kernel.sync import SyncError, SyncRefused, sync_workspace

cloudpickle.register_pickle_by_value(sys.modules[__name__])


class Probe(Actor):
    @endpoint
    def ev(self, expr: str):
        import importlib  # noqa: F401  (for expressions)

        return eval(expr)


@pytest.fixture(scope="module")
def procs():
    pm = this_host().spawn_procs(per_host={"gpus": 2})
    yield pm
    pm.stop()


@pytest.fixture(scope="module")
def probe(procs):
    return procs.spawn("probe", Probe)


@pytest.fixture
def ws(tmp_path, monkeypatch):
    """A fresh workspace as the controller's working directory, importable here too."""
    d = tmp_path / "ws"
    d.mkdir()
    monkeypatch.chdir(d)
    monkeypatch.syspath_prepend(str(d))
    return d


def _mod() -> str:
    return f"m_{uuid.uuid4().hex[:8]}"


def test_edit_sync_and_the_next_call_runs_the_new_code(procs, probe, ws):
    name = _mod()
    (ws / f"{name}.py").write_text(
        "from monarch_kernel.actor import Actor, endpoint\n"
        "def value():\n    return 1\n"
        "class Worker(Actor):\n    @endpoint\n    def v(self):\n        return value() * 10\n")
    report = procs.sync_workspace()
    assert report.changes()["added"] == [f"workspace/{name}.py"]
    mod = __import__(name)
    live = procs.spawn("w" + name, mod.Worker)
    assert live.v.call().get().values() == [10, 10]
    assert probe.ev.call(f"importlib.import_module({name!r}).value()").get().values() == [1, 1]

    (ws / f"{name}.py").write_text((ws / f"{name}.py").read_text().replace("return 1", "return 2"))
    report = procs.sync_workspace()
    assert report.changes()["modified"] == [f"workspace/{name}.py"]
    assert [r["reloaded"] for r in report.reload["procs"].values()] == [[name], [name]]
    assert live.v.call().get().values() == [20, 20]          # the live actor runs the new method
    assert probe.ev.call(f"importlib.import_module({name!r}).value()").get().values() == [2, 2]


def test_procs_work_in_the_synced_workspace_and_new_procs_start_there(procs, probe, ws):
    (ws / "hello.txt").write_text("hi")
    report = procs.sync_workspace()
    root = report.hosts[0].roots["workspace"]["root"]
    assert probe.ev.call("open('hello.txt').read()").get().values() == ["hi", "hi"]
    assert probe.ev.call("__import__('os').getcwd()").get().values() == [root, root]
    more = this_host().spawn_procs(per_host={"gpus": 1}, name="later")
    try:
        p = more.spawn("p", Probe)
        assert p.ev.call_one("(__import__('os').getcwd(), __import__('sys').path[0])").get() == (root, root)
    finally:
        more.stop()


def test_deleted_file_goes_but_files_the_procs_made_stay(procs, probe, ws):
    (ws / "gone.py").write_text("x = 1\n")
    (ws / "pkg").mkdir()
    (ws / "pkg" / "only.py").write_text("")
    root = Path(procs.sync_workspace().hosts[0].roots["workspace"]["root"])
    probe.slice(gpus=0).ev.call_one("open('made_on_host.txt', 'w').write('x')").get()
    (ws / "gone.py").unlink()
    (ws / "pkg" / "only.py").unlink()
    report = procs.sync_workspace()
    assert sorted(report.changes()["deleted"]) == ["workspace/gone.py", "workspace/pkg/only.py"]
    assert not (root / "gone.py").exists() and not (root / "pkg").exists()
    assert (root / "made_on_host.txt").exists()


def test_excluded_files_do_not_travel(procs, ws):
    (ws / "keep.py").write_text("")
    (ws / "__pycache__").mkdir()
    (ws / "__pycache__" / "keep.cpython-311.pyc").write_bytes(b"x")
    (ws / "data").mkdir()
    (ws / "data" / "big.bin").write_bytes(b"x" * 1000)
    (ws / "out.log").write_text("log")
    (ws / ".meshignore").write_text("data/\n")
    (ws / ".gitignore").write_text("*.log\n")
    report = procs.sync_workspace(excludes=["*.tmp"])
    (ws / "x.tmp").write_text("")
    root = Path(report.hosts[0].roots["workspace"]["root"])
    names = {p.name for p in root.iterdir()}
    assert {".gitignore", ".meshignore", "keep.py"} <= names
    assert not names & {"__pycache__", "data", "out.log"}
    assert procs.sync_workspace(excludes=["*.tmp"]).files_sent == 0


def test_noop_resync_sends_nothing_and_one_edit_sends_one_file(procs, ws):
    for i in range(30):
        (ws / f"f{i}.py").write_text(f"x = {i}\n")
    assert procs.sync_workspace().files_sent == 30
    again = procs.sync_workspace()
    assert again.files_sent == 0 and again.bytes_sent == 0
    (ws / "f7.py").write_text("x = 'seven'\n")
    one = procs.sync_workspace()
    assert one.files_sent == 1 and one.changes()["modified"] == ["workspace/f7.py"]


def test_files_travel_compressed_across_a_network(procs, ws, monkeypatch):
    """Compression is on for remote hosts and off to loopback agents; force it on here."""

    monkeypatch.setenv("MONARCH_KERNEL_SYNC_COMPRESS", "always")
    text = "def f(x):\n    return x + 1\n" * 4000
    (ws / "big.py").write_text(text)
    (ws / "noise.bin").write_bytes(os.urandom(100_000))
    report = procs.sync_workspace()
    raw = sum(t.bytes_raw for t in report.hosts)
    assert raw == len(text) + 100_000 and report.bytes_sent < 100_000 + len(text) // 10
    root = Path(report.hosts[0].roots["workspace"]["root"])
    assert (root / "big.py").read_text() == text
    assert (root / "noise.bin").read_bytes() == (ws / "noise.bin").read_bytes()


def test_dry_run_says_what_would_change_and_changes_nothing(procs, ws):
    (ws / "a.py").write_text("")
    procs.sync_workspace()
    (ws / "b.py").write_text("")
    (ws / "a.py").unlink()
    dry = procs.sync_workspace(dry_run=True)
    assert dry.changes() == {"added": ["workspace/b.py"], "modified": [], "deleted": ["workspace/a.py"]}
    assert "would sync" in str(dry)
    real = procs.sync_workspace()
    assert real.changes()["added"] == ["workspace/b.py"]


def test_missing_path_is_refused_before_anything_is_sent(procs, ws):
    with pytest.raises(FileNotFoundError, match="no_such_dir"):
        procs.sync_workspace(["no_such_dir"])


def test_escape_attempts_sent_straight_to_the_agent_are_refused(procs, tmp_path):
    """A crafted manifest (not from our sender) must not write outside the destination."""
    rt = runtime()
    hm = procs._state.host_mesh
    addr, key = hm._agents[0]["addr"], hm._key
    target = tmp_path / "pwned"
    digest = b"\0" * 32
    attempts = [
        ("workspace", [(f"../../../../../../..{target}", 1, 0o644, digest, None)]),
        ("workspace", [(str(target), 1, 0o644, digest, None)]),
        ("workspace", [("a/../../../x", 1, 0o644, digest, None)]),
        ("workspace", [("link", 0, 0o777, None, "../../../../etc")]),
        ("workspace", [("link", 0, 0o777, None, "/etc")]),
        ("../../evil", [("x.py", 1, 0o644, digest, None)]),
    ]
    for dest, entries in attempts:
        with pytest.raises(SyncRefused, match="refused"):
            rt.agent_request(addr, key, "sync_plan", uuid.uuid4().hex, dest, "", entries, [], {}).get(10)
    assert not target.exists()
    sid = uuid.uuid4().hex   # a put for a file the plan did not ask for
    rt.agent_request(addr, key, "sync_plan", sid, "workspace", "", [], [], {}).get(10)
    with pytest.raises(SyncRefused):
        rt.agent_request(addr, key, "sync_put", sid, [("../x", 0, b"x", 0, True)]).get(10)
    rt.agent_request(addr, key, "sync_abort", sid).get(10)
    assert procs.sync_workspace([str(tmp_path)]).ok          # the agent still serves


def test_env_syncs_site_packages_and_editable_sources(procs, probe, ws, tmp_path):
    site = tmp_path / "site-packages"
    (site / "fakelib_sync").mkdir(parents=True)
    (site / "fakelib_sync" / "__init__.py").write_text("VALUE = 7\n")
    src = tmp_path / "editable_src"
    src.mkdir()
    (src / "edmod_sync.py").write_text("VALUE = 8\n")
    (site / "__editable__.edpkg-0.1.pth").write_text(f"{src}\n")
    (site / "distutils-precedence.pth").write_text("import os\n")
    report = procs.sync_workspace(env=str(site))
    dests = sorted(report.hosts[0].roots)
    assert dests[0].startswith("editable/editable_src-") and dests[1:] == ["env/site-packages", "workspace"]
    got = probe.ev.call("(__import__('fakelib_sync').VALUE, __import__('edmod_sync').VALUE, "
                        "__import__('fakelib_sync').__file__)").get().values()
    assert [g[:2] for g in got] == [(7, 8), (7, 8)]
    assert got[0][2].startswith(report.hosts[0].roots["env/site-packages"]["root"])


# ---------------------------------------------------------------------------- hosts that fail
def _agent(key, name, env=None):
    old = dict(os.environ)
    os.environ.update(env or {})
    try:
        return start_local_agent(key, name=name, persistent=False)
    finally:
        os.environ.clear()
        os.environ.update(old)


def _stop(*procs_):
    for p in procs_:
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
        p.wait(10)


def test_agent_killed_mid_sync_others_finish_and_a_later_sync_completes_it(tmp_path):
    ws = tmp_path / "big"
    ws.mkdir()
    for i in range(24):
        (ws / f"blob{i:02d}.bin").write_bytes(os.urandom(400_000))
    key = new_key()
    name2 = f"victim-{uuid.uuid4().hex[:6]}"
    (a1, p1), (a2, p2) = _agent(key, f"keeper-{uuid.uuid4().hex[:6]}"), _agent(key, name2)
    p2b = None
    try:
        hm = attach_to_workers([a1["addr"], a2["addr"]], key)

        def kill_victim(progress):
            if progress.bytes_done and p2.poll() is None:
                os.kill(p2.pid, signal.SIGKILL)

        with pytest.raises(SyncError) as ei:
            sync_workspace(hm, [str(ws)], progress=kill_victim)
        report = ei.value.report
        assert report.hosts[0].ok and len(report.hosts[0].roots) == 1
        assert not report.hosts[1].ok and "FAILED" in str(report) and "sync again" in str(report)
        root1 = Path(next(iter(report.hosts[0].roots.values()))["root"])
        assert len(list(root1.iterdir())) == 24
        p2.wait(10)

        a2b, p2b = _agent(key, name2)        # the host comes back (same name, same folder)
        hm2 = attach_to_workers([a1["addr"], a2b["addr"]], key)
        again = sync_workspace(hm2, [str(ws)])
        assert again.hosts[0].files_sent == 0
        root2 = Path(next(iter(again.hosts[1].roots.values()))["root"])
        assert sorted(p.name for p in root2.iterdir() if p.is_file()) == sorted(p.name for p in ws.iterdir())
        assert (root2 / "blob23.bin").read_bytes() == (ws / "blob23.bin").read_bytes()
        hm2.shutdown()
    finally:
        _stop(*(p for p in (p1, p2, p2b) if p is not None))


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                       capture_output=True)
    return r.returncode == 0


def test_disk_full_receiver_on_a_small_tmpfs_leaves_no_half_file(tmp_path):
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "1m"):
        pytest.skip("cannot mount a small tmpfs here (needs root and mount permission)")
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "small.py").write_text("x = 1\n")
    key = new_key()
    a, p = _agent(key, f"full-{uuid.uuid4().hex[:6]}", {"MONARCH_KERNEL_SYNC_DIR": str(disk)})
    try:
        hm = attach_to_workers([a["addr"]], key)
        root = Path(next(iter(sync_workspace(hm, [str(ws)]).hosts[0].roots.values()))["root"])
        (ws / "big.bin").write_bytes(os.urandom(3_000_000))
        with pytest.raises(SyncError, match="no space left") as ei:
            sync_workspace(hm, [str(ws)])
        assert "MONARCH_KERNEL_SYNC_DIR" in str(ei.value)
        assert not (root / "big.bin").exists()
        assert list((disk / ".tmp").iterdir()) == []
        assert (root / "small.py").read_text() == "x = 1\n"
        (ws / "big.bin").unlink()
        (ws / "small.py").write_text("x = 2\n")
        assert sync_workspace(hm, [str(ws)]).ok                 # the host still serves
        assert (root / "small.py").read_text() == "x = 2\n"
        hm.shutdown()
    finally:
        _stop(p)
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_sync_of_the_runtimes_own_source_leaves_it_running_and_says_a_new_mesh_runs_it(tmp_path,
                                                                                          monkeypatch):
    """Syncing a checkout of monarch-kernel (its package loaded by the procs from there, as an
    editable install does) reloaded the proc loop in place mid-call: every proc died (round 22,
    on 64 and 256 ranks: 'proc exited with code 1', NameError then a ContextVar token error)."""
    import monarch_kernel

    src = Path(monarch_kernel.__file__).parent
    monkeypatch.chdir(tmp_path)
    pm = this_host().spawn_procs(per_host={"gpus": 2})
    try:
        probe = pm.spawn("probe", Probe)
        loaded_here = probe.ev.call("__import__('monarch_kernel').__file__").get().values()
        if not all(f.startswith(str(src)) for f in loaded_here):
            pytest.skip(f"the procs load monarch_kernel from {loaded_here[0]}, not {src} (not an editable install)")
        report = sync_workspace(pm, [str(src)])
        for r in report.reload["procs"].values():
            assert "monarch_kernel.node.proc" in r["runtime"] and not r["failed"], r
            assert not any(n.startswith("monarch_kernel") for n in r["reloaded"]), r
        assert "ranks 0-1: " in str(report) and "`%mesh stop` then `%mesh connect`" in str(report), str(report)
        assert probe.ev.call("1 + 1").get().values() == [2, 2]   # every proc lives, its actors too
    finally:
        pm.stop()
