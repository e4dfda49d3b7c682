"""One module (monarch_kernel/config.py) reads every MONARCH_KERNEL_* variable: each is
declared with its type, default and meaning, the README's table is generated from it, a
bad value is an error naming the variable, and values are read when used."""
from __future__ import annotations

import re
import uuid
from pathlib import Path

import pytest

from monarch_kernel import config
from monarch_kernel.core.connection import new_key

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("monarch_kernel", "workers", "tests", "bench", "scripts", "examples", "notebooks", "README.md")
NAME = re.compile(r"MONARCH_KERNEL_[A-Z0-9_]*[A-Z0-9]")
DIRECT_READ = re.compile(r"""os\.(environ(\.get|\.pop|\.setdefault)?\s*[\[(]\s*|getenv\(\s*)["']MONARCH_KERNEL_"""
                         r"""|["']MONARCH_KERNEL_\w+["']\s+(not\s+)?in\s+os\.environ""")
TABLE = re.compile(r"<!-- config-table[^>]*-->\n(.*?)<!-- /config-table -->", re.S)


def _files():
    for top in SCANNED:
        p = ROOT / top
        for f in ([p] if p.is_file() else sorted(p.rglob("*"))):
            if f.is_file() and f.suffix in (".py", ".md", ".sh", ".ipynb", ".json", ".yaml", ".txt", "") \
                    and "__pycache__" not in f.parts and "node_modules" not in f.parts:
                yield f


def test_every_variable_the_tree_mentions_is_declared_in_config():
    """A new variable (or a typo in a doc) fails here until it is declared, with its type,
    default and meaning, in monarch_kernel/config.py."""
    unknown = {}
    for f in _files():
        try:
            text = f.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        for m in NAME.finditer(text):
            name = m.group(0)[len(config.PREFIX):]
            if name not in config.SETTINGS:
                unknown.setdefault(m.group(0), f"{f.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}")
    assert not unknown, ("declare these in monarch_kernel/config.py (type, default, meaning), then run "
                         "`python -m monarch_kernel.config --update README.md`:\n"
                         + "\n".join(f"{k} ({v})" for k, v in sorted(unknown.items())))


def test_config_imports_only_the_standard_library_so_the_core_may_use_it():
    import ast
    import sys

    tree = ast.parse((ROOT / "monarch_kernel" / "config.py").read_text())
    mods = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    mods |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert mods <= set(sys.stdlib_module_names) | {"__future__"}, mods


def test_no_module_outside_the_core_reads_a_variable_itself():
    """Reads go through config (the core's own reads are switched by its engineer; core/ is
    left out until then)."""
    direct = [f"{f.relative_to(ROOT)}:{n}: {line.strip()}"
              for f in sorted((ROOT / "monarch_kernel").rglob("*.py"))
              if f.name != "config.py" and "core" not in f.relative_to(ROOT / "monarch_kernel").parts[:1]
              for n, line in enumerate(f.read_text().splitlines(), 1) if DIRECT_READ.search(line)]
    assert not direct, "read these through monarch_kernel.config:\n" + "\n".join(direct)


def test_the_readme_table_is_the_one_config_generates():
    m = TABLE.search((ROOT / "README.md").read_text())
    assert m, "README.md has no <!-- config-table --> section"
    assert m.group(1) == config.markdown_table(), \
        "the README's table of variables is stale: run `python -m monarch_kernel.config --update README.md`"
    for name in config.SETTINGS:
        assert f"`{config.PREFIX}{name}`" in m.group(1)


def test_a_bad_value_names_the_variable_the_value_and_the_default(monkeypatch):
    monkeypatch.setenv("MONARCH_KERNEL_MAX_PROCS", "abc")
    with pytest.raises(config.ConfigError) as e:
        config.MAX_PROCS.get()
    msg = str(e.value)
    assert msg.startswith("MONARCH_KERNEL_MAX_PROCS='abc' is not an integer") and "default (0)" in msg
    for name, raw, why in (("HOLD_S", "1s", "is not a number"), ("PREWARM", "maybe", "is not a boolean"),
                           ("CURVE", "sometimes", "is not 'auto' or 'remote' or 'always' or 'never'"),
                           ("OUTPUT_RATE", "-5", "is below 0"), ("KEY", "xyz", "is not a hex string")):
        monkeypatch.setenv(config.PREFIX + name, raw)
        with pytest.raises(ValueError, match=re.escape(f"MONARCH_KERNEL_{name}='{raw}' {why}")):
            config.SETTINGS[name].get()


def test_values_are_read_when_used_not_at_import(monkeypatch):
    monkeypatch.delenv("MONARCH_KERNEL_OUTPUT_RATE", raising=False)
    assert config.OUTPUT_RATE.get() == 200.0
    monkeypatch.setenv("MONARCH_KERNEL_OUTPUT_RATE", "12.5")
    assert config.OUTPUT_RATE.get() == 12.5
    monkeypatch.setenv("MONARCH_KERNEL_OUTPUT_RATE", "")
    assert config.OUTPUT_RATE.get() == 200.0   # empty is unset
    monkeypatch.setenv("MONARCH_KERNEL_PREWARM", "Off")
    assert config.PREWARM.get() is False
    monkeypatch.setenv("MONARCH_KERNEL_AGENT_MAX_MESSAGE", "1e6")
    assert config.AGENT_MAX_MESSAGE.get() == 1_000_000
    from monarch_kernel.jupyter.text_output import OutputBudget

    monkeypatch.setenv("MONARCH_KERNEL_OUTPUT_RATE", "12.5")
    assert OutputBudget().rate == 12.5 and OutputBudget(rate=3).rate == 3


def test_an_agent_refuses_to_start_on_a_bad_value_and_says_which():
    """Checked at the agent's start (its procs inherit its environment), not halfway
    through a spawn; the launcher's error carries the agent's last words."""
    from monarch_kernel.core.errors import MeshGoneError
    from monarch_kernel.launch.local import start_local_agent

    for env, said in (({"MONARCH_KERNEL_MAX_PROCS": "abc"}, "MONARCH_KERNEL_MAX_PROCS='abc' is not an integer"),
                      ({"MONARCH_KERNEL_PROC_OUTPUT_RATE": "fast"},   # read by each proc
                       "MONARCH_KERNEL_PROC_OUTPUT_RATE='fast' is not a number")):
        with pytest.raises(MeshGoneError, match=r"exited at start \(code 1\): workers.agent: cannot start: "
                                                + re.escape(said)):
            start_local_agent(new_key(), name=f"bad-env-{uuid.uuid4().hex[:6]}", persistent=False, env=env)
