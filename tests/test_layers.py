"""The core is the ground floor: it imports no feature, and features plug in by name.

DESIGN.md: "monarch_kernel.core must import without ipykernel and without any feature
package". A core module that imports upward (even inside a function, where it would only
show when that path runs) fails here, naming the file, line and what to do instead.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from monarch_kernel.core import extensions

CORE = Path(__file__).resolve().parent.parent / "monarch_kernel" / "core"
ALLOWED_TOP = {"monarch_kernel.core", "monarch_kernel.core.*"}


def _imports(path: Path):
    """(line, absolute module name) of every import in ``path``, at any depth."""
    package = ["monarch_kernel", "core"]
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if node.module is None or mod == "monarch_kernel":   # from .. import x: x is a module
                for a in node.names:
                    yield node.lineno, f"{mod}.{a.name}"
            else:
                yield node.lineno, mod
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            yield node.lineno, node.args[0].value


def _upward(mod: str) -> bool:
    top = mod.split(".")[0]
    if top in ("workers",):
        return True
    if top != "monarch_kernel":
        return False
    if mod == "monarch_kernel.config":   # a leaf below the core: the standard library only (test_config)
        return False
    return not (mod == "monarch_kernel.core" or mod.startswith("monarch_kernel.core."))


def test_no_core_module_imports_a_feature_or_the_facade():
    bad = [f"{p.relative_to(CORE.parent.parent)}:{line}: imports {mod}"
           for p in sorted(CORE.rglob("*.py")) for line, mod in _imports(p) if _upward(mod)]
    assert not bad, ("core/ is the ground floor and imports no feature (nor monarch_kernel.actor); register "
                     "what the core must call through monarch_kernel/core/extensions.py instead:\n"
                     + "\n".join(bad))


def test_the_layer_check_sees_imports_inside_functions(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from ..sync import sync_workspace\n    import workers.proc\n"
                 "    from .. import actor\n    from . import wire\n")
    found = [mod for _, mod in _imports(f) if _upward(mod)]
    assert found == ["monarch_kernel.sync", "workers.proc", "monarch_kernel.actor"]


def test_importing_every_core_module_loads_no_feature_and_features_still_reach_procmesh():
    mods = [f"monarch_kernel.core.{p.stem}" for p in sorted(CORE.glob("*.py")) if p.stem != "__init__"]
    code = ("import sys\n" + "".join(f"import {m}\n" for m in mods) +
            "feat = sorted(m for m in sys.modules if m.startswith('monarch_kernel.') and not "
            "m.startswith(('monarch_kernel.core', 'monarch_kernel.features', 'monarch_kernel.config')))\n"
            "assert not feat, feat\n"
            "assert 'workers' not in sys.modules and 'ipykernel' not in sys.modules\n"
            "from monarch_kernel.core.mesh import ProcMesh\n"
            "for name in ('sync_workspace', 'init_process_group', 'distribute', 'tensor', 'telemetry'):\n"
            "    assert hasattr(ProcMesh, name), name\n"
            "from monarch_kernel.core import wire\n"
            "assert wire.LARGE_TENSOR_HOOK is not None\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_a_duplicate_registration_is_refused_with_its_name():
    with pytest.raises(extensions.DuplicateRegistration, match="message kind 'dbg' is already registered"):
        extensions.register_message_kind("dbg", print)
    with pytest.raises(extensions.DuplicateRegistration, match="ProcMesh member 'sync_workspace'"):
        extensions.register_proc_mesh_member("sync_workspace", print)
    with pytest.raises(extensions.DuplicateRegistration, match="large-tensor hook"):
        extensions.register_large_tensor_hook(print)
    with pytest.raises(extensions.DuplicateRegistration, match="local agent starter"):
        extensions.register_local_agent_starter(print)
    # A new name registers once and is refused the second time.
    extensions.register_message_kind("test_layers_kind", print)
    try:
        assert extensions.message_handler("test_layers_kind") is print
        with pytest.raises(extensions.DuplicateRegistration):
            extensions.register_message_kind("test_layers_kind", repr)
    finally:
        extensions._message_kinds.pop("test_layers_kind")
