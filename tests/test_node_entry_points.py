"""The node side moved from ``workers/`` (and the procs' half of the notebook from
``jupyter/``) to ``monarch_kernel.node``; the old names still work: ``python -m
workers.agent`` (deployments, pod specs, docs), ``import workers.proc`` and
``monarch_kernel.jupyter.cells.NAMESPACE`` (notebooks), as the same module objects, so
module-global state (a proc's ``WORKER``, the cells' namespace) exists once."""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

import cloudpickle

from monarch_kernel.actor import Actor, attach_to_workers, endpoint
from monarch_kernel.core.connection import new_key

cloudpickle.register_pickle_by_value(sys.modules[__name__])

MODULES = ("agent", "proc", "zygote", "linux", "output_limit")


def _python(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          timeout=60).stdout


def test_old_and_new_names_are_the_same_module_objects_in_either_import_order():
    for first, second in (("workers", "monarch_kernel.node"), ("monarch_kernel.node", "workers")):
        out = _python(
            "import importlib\n"
            f"for m in {MODULES!r}:\n"
            f"    a = importlib.import_module('{first}.' + m)\n"
            f"    b = importlib.import_module('{second}.' + m)\n"
            "    assert a is b, m\n"
            "    assert a.__name__ == 'monarch_kernel.node.' + m and a.__spec__.name == a.__name__, m\n"
            "import workers.proc, monarch_kernel.node.proc as p\n"
            "p.WORKER = 'set through the new name'\n"
            "print(workers.proc.WORKER)\n")
        assert out.strip() == "set through the new name"


def test_the_cells_namespace_notebooks_read_under_its_old_name_is_the_same_dict():
    out = _python(
        "from monarch_kernel.jupyter.cells import NAMESPACE\n"
        "import monarch_kernel.node.cells as cells, monarch_kernel.jupyter.figure_backend as old\n"
        "import monarch_kernel.node.figure_backend as new\n"
        "print(NAMESPACE is cells.NAMESPACE, old is new)\n")
    assert out.split() == ["True", "True"]


def test_what_runs_on_a_proc_imports_nothing_from_jupyter():
    """The procs' side (agent, proc loop, cell runner, rank display, the debugger's worker
    halves) loads no ipykernel / IPython / jupyter_client and no kernel-side module."""
    out = _python(
        "import sys\n"
        "import monarch_kernel.node.agent, monarch_kernel.node.proc, monarch_kernel.node.cells\n"
        "import monarch_kernel.node.rich_output, monarch_kernel.debug.dap_worker, monarch_kernel.debug.worker\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('ipykernel', 'IPython', 'jupyter_client')\n"
        "             or m.startswith('monarch_kernel.jupyter.') or m == 'monarch_kernel.debug.dap'))\n")
    assert out.strip() == "[]"


def test_an_unknown_old_name_is_still_an_import_error():
    out = _python("try:\n    import workers.nope\nexcept ModuleNotFoundError as e:\n    print(e.name)\n")
    assert out.strip() == "workers.nope"


def test_python_m_workers_agent_help_names_the_documented_command():
    r = subprocess.run([sys.executable, "-m", "workers.agent", "--help"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: python -m workers.agent") and "--bind" in r.stdout


class Where(Actor):
    @endpoint
    def modules(self):
        import workers.proc as old

        import monarch_kernel.node.proc as new

        return old is new, new.WORKER is not None, sys.modules["__main__"].__name__


def test_an_agent_started_as_python_m_workers_agent_serves_procs():
    """The real start path: the documented command, a controller attaching, a proc forked
    from its zygote (now ``python -m monarch_kernel.node.zygote``), and one call."""
    key = new_key()
    env = dict(os.environ, MONARCH_KERNEL_KEY=key.hex())
    agent = subprocess.Popen([sys.executable, "-m", "workers.agent", "--bind", "127.0.0.1",
                              "--parent-pid", str(os.getpid())], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, env=env,
                             start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        line = b""
        while not line.endswith(b"\n") and time.monotonic() < deadline:
            if select.select([agent.stdout], [], [], 1)[0]:
                chunk = os.read(agent.stdout.fileno(), 4096)
                assert chunk, f"the agent exited at start (code {agent.wait()})"
                line += chunk
        text = line.decode().strip()
        assert text.startswith("MONARCH_AGENT_READY tcp://127.0.0.1:"), text
        hosts = attach_to_workers([text.split()[1]], key, name="shim-test")
        procs = hosts.spawn_procs(per_host={"gpus": 1})
        same, has_worker, _ = procs.spawn("where", Where).modules.call_one().get(60)
        assert same and has_worker
        hosts.shutdown()
        agent.wait(10)
    finally:
        if agent.poll() is None:
            agent.send_signal(signal.SIGKILL)   # its zygote and procs die with it (PDEATHSIG)
            agent.wait(10)
        agent.stdout.close()
