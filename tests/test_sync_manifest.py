"""Code sync, sending side, no mesh: excludes, hash cache, size limit, bad paths, symlinks."""
from __future__ import annotations

import os

import pytest

from monarch_kernel.sync import SyncTooLarge, resolve_roots
from monarch_kernel.sync.manifest import HashCache, build_manifest
from monarch_kernel.sync.paths import SyncRefused, check_rel


def _tree(root, files: dict):
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def _paths(m):
    return [e.path for e in m.entries]


def test_default_gitignore_and_meshignore_excludes(tmp_path):
    _tree(tmp_path, {
        "a.py": "", "pkg/b.py": "", "pkg/__pycache__/b.cpython-311.pyc": "", ".git/HEAD": "",
        ".venv/lib/x.py": "", "run.log": "", "keep.log": "", "data/big.bin": "", "sub/.gitignore": "*.tmp\n",
        "sub/x.tmp": "", "sub/y.py": "", "other/x.tmp": "", "build/out.o": "", "src/build/keep.py": "",
        ".gitignore": "*.log\n!keep.log\n/build/\n", ".meshignore": "data/\n",
        "deep/a/b/c.ckpt": "", "notes.md": "",
    })
    m = build_manifest(str(tmp_path), excludes=["**/*.ckpt"], cache=HashCache())
    assert _paths(m) == [".gitignore", ".meshignore", "a.py", "keep.log", "notes.md", "other/x.tmp",
                         "pkg/b.py", "src/build/keep.py", "sub/.gitignore", "sub/y.py"]


def test_hashes_are_cached_by_size_and_mtime(tmp_path):
    _tree(tmp_path, {"a.py": "x = 1\n", "b.py": "y = 2\n"})
    old = 1_600_000_000_000_000_000   # an mtime well in the past, so the entry is not "racy"
    for n in ("a.py", "b.py"):
        os.utime(tmp_path / n, ns=(old, old))
    cache = HashCache()
    first = build_manifest(str(tmp_path), cache=cache)
    assert cache.hashed_bytes == 12
    again = build_manifest(str(tmp_path), cache=cache)
    assert cache.hashed_bytes == 12 and again.entries == first.entries
    (tmp_path / "a.py").write_text("x = 3\n")      # same size, new mtime
    changed = build_manifest(str(tmp_path), cache=cache)
    assert cache.hashed_bytes == 18
    assert changed.entries[0].digest != first.entries[0].digest
    assert changed.entries[1] == first.entries[1]


def test_a_file_edited_right_after_hashing_is_hashed_again(tmp_path):
    """Coarse mtimes: a same-size rewrite in the same tick must not be missed."""
    _tree(tmp_path, {"a.py": "x = 1\n"})
    cache = HashCache()
    first = build_manifest(str(tmp_path), cache=cache)
    st = os.stat(tmp_path / "a.py")
    (tmp_path / "a.py").write_text("x = 2\n")
    os.utime(tmp_path / "a.py", ns=(st.st_atime_ns, st.st_mtime_ns))   # same size, same mtime
    second = build_manifest(str(tmp_path), cache=cache)
    assert second.entries[0].digest != first.entries[0].digest


def test_tree_over_the_limit_names_its_largest_parts(tmp_path):
    _tree(tmp_path, {"code.py": "x = 1\n"})
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "weights.bin").write_bytes(b"\0" * 300_000)
    with pytest.raises(SyncTooLarge) as ei:
        build_manifest(str(tmp_path), max_bytes=100_000, cache=HashCache())
    msg = str(ei.value)
    assert "data/" in msg and "data/weights.bin" in msg and "300.0 KB" in msg
    assert ".meshignore" in msg and "max_bytes" in msg
    assert build_manifest(str(tmp_path), max_bytes=100_000, excludes=["data/"], cache=HashCache()).entries


def test_symlink_leaving_the_tree_is_reported_and_one_inside_is_kept(tmp_path):
    _tree(tmp_path, {"ws/a.py": "", "outside.txt": "secret"})
    ws = tmp_path / "ws"
    (ws / "out").symlink_to(tmp_path / "outside.txt")
    (ws / "alias.py").symlink_to("a.py")
    m = build_manifest(str(ws), cache=HashCache())
    assert _paths(m) == ["a.py", "alias.py"]
    assert m.entries[1].link == "a.py"
    assert [p.path for p in m.problems] == ["out"] and "leaves the tree" in m.problems[0].why


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_file_is_reported_and_kept_on_hosts(tmp_path):
    _tree(tmp_path, {"a.py": "", "secret.py": "x"})
    os.chmod(tmp_path / "secret.py", 0)
    m = build_manifest(str(tmp_path), cache=HashCache())
    assert _paths(m) == ["a.py"] and m.keep == ["secret.py"]
    assert "cannot read" in m.problems[0].why


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist.*nope"):
        resolve_roots([str(tmp_path / "nope")], cwd=str(tmp_path))


def test_paths_map_to_workspace_or_their_own_root(tmp_path):
    _tree(tmp_path, {"ws/src/m.py": "", "lib/l.py": ""})
    roots = resolve_roots([str(tmp_path / "ws"), str(tmp_path / "ws/src"), str(tmp_path / "lib")],
                          cwd=str(tmp_path / "ws"))
    assert [(r.dest.split("-")[0], r.scope, r.cwd) for r in roots] == [
        ("workspace", "", True), ("workspace", "src", True), ("roots/lib", "", False)]


@pytest.mark.parametrize("bad", ["../x", "/etc/passwd", "a/../../x", "a//b", "./a", "", "a/\0"])
def test_receiver_refuses_paths_that_escape(bad):
    with pytest.raises(SyncRefused, match="refused"):
        check_rel(bad)
