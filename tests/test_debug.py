"""The distributed debugger through a real Monarch kernel (jupyter_client) and a real 3-proc mesh.

The test answers the kernel's input requests as a front-end does (allow_stdin=True): the
running cell is the debugger console, its prompts name the rank.
"""
from __future__ import annotations

import queue
import time

import pytest
from kernel_harness import KernelHarness, kernel_with_mesh

MESH = "kt-debug"


@pytest.fixture(scope="module")
def k():
    with kernel_with_mesh(MESH, "--procs 3") as h:
        yield h


class Session:
    """One cell run with its console: ``prompts`` asked, ``text`` as a user saw it."""

    def __init__(self):
        self.prompts: list[str] = []
        self.text = ""
        self.status = ""
        self.result = ""
        self.error: dict = {}


def drive(k: KernelHarness, code: str, answers, timeout: float = 60, interrupt_at: int | None = None) -> Session:
    """Run ``code``; answer each input request with ``answers(prompt, session)`` (or the next
    item of a list). ``interrupt_at``: interrupt the kernel at that prompt (0-based) instead."""
    it = iter(answers) if isinstance(answers, list) else None
    s = Session()
    mid = k.kc.execute(code, allow_stdin=True)
    deadline = time.monotonic() + timeout
    while True:
        if time.monotonic() > deadline:
            raise TimeoutError(f"cell did not finish in {timeout} s; saw:\n{s.text}")
        try:
            m = k.kc.get_stdin_msg(timeout=0.02)
        except queue.Empty:
            m = None
        if m is not None and m["msg_type"] == "input_request":
            prompt = m["content"]["prompt"]
            if interrupt_at is not None and len(s.prompts) == interrupt_at:
                s.prompts.append(prompt)
                k.km.interrupt_kernel()
            else:
                time.sleep(0.05)   # let the output sent before the prompt arrive
                _drain(k, mid, s)
                line = next(it) if it is not None else answers(prompt, s)
                s.prompts.append(prompt)
                s.text += f"{prompt}{line}\n"
                k.kc.input(line)
        if _drain(k, mid, s):
            break
    reply = k.kc.get_shell_msg(timeout=10)
    while reply["parent_header"].get("msg_id") != mid:
        reply = k.kc.get_shell_msg(timeout=10)
    s.status = reply["content"]["status"]
    return s


def _drain(k, mid, s: Session) -> bool:
    while True:
        try:
            msg = k.kc.get_iopub_msg(timeout=0.01)
        except queue.Empty:
            return False
        if msg["parent_header"].get("msg_id") != mid:
            continue
        t, c = msg["msg_type"], msg["content"]
        if t == "stream":
            s.text += c["text"]
        elif t == "execute_result":
            s.result = c["data"]["text/plain"]
        elif t == "error":
            s.error = c
            s.text += f"{c['ename']}: {c['evalue']}\n"
        elif t == "status" and c["execution_state"] == "idle":
            return True


def values(result: str) -> list[str]:
    return [line.split(": ", 1)[1] for line in result.splitlines()[1:]]


# ----------------------------------------------------------------------- one rank, in a cell
def test_breakpoint_on_one_rank_makes_the_cell_its_console(k):
    s = drive(k, "%%on_mesh\nx = rank * 10\nif rank == 1:\n    breakpoint()\n    x += 1\nx",
              ["p x", "l", "next", "p x", "continue"])
    assert s.status == "ok", s.text
    assert s.prompts == ["(rank 1 pdb) "] * 5
    assert "rank 1 paused at <In [" in s.text and "(cell)" in s.text
    assert "(rank 1 pdb) p x\n10\n" in s.text
    assert "breakpoint()" in s.text.split("(rank 1 pdb) l\n")[1]   # `list` shows the cell's source
    assert "(rank 1 pdb) p x\n11\n" in s.text
    assert values(s.result) == ["0", "11", "20"]   # the other ranks ran on


# ----------------------------------------------------------------------- several ranks
def test_several_ranks_switch_cast_and_continue_all(k):
    def answer(prompt, s):
        if "3 ranks paused" not in s.text:   # wait until every rank has stopped
            time.sleep(0.1)
            return "ranks"
        plan = ["rank 2", "p rank", "cast ranks(0,1) p rank * 100", "continue all"]
        done = sum(1 for line in s.text.splitlines() if line.split(") ", 1)[-1] in plan)
        return plan[done]

    s = drive(k, "%%on_mesh\nbreakpoint()\nrank + 1", answer)
    assert s.status == "ok", s.text
    assert "3 ranks paused (0-2)" in s.text
    assert s.prompts[-3:] == ["(rank 2 pdb) "] * 3
    assert "(rank 2 pdb) p rank\n2\n" in s.text
    assert "[rank 0] 0\n" in s.text and "[rank 1] 100\n" in s.text
    assert values(s.result) == ["1", "2", "3"]


def test_moving_from_one_paused_rank_to_the_next_ends_the_cell_cleanly(k):
    def answer(prompt, s):
        if prompt == "(rank 0 pdb) " and "2 ranks paused" not in s.text:   # both ranks stopped first
            time.sleep(0.1)
            return "ranks"
        return "continue"

    s = drive(k, "%%on_mesh --ranks 0,1\nbreakpoint()\nrank + 1", answer)
    assert "rank 0 continued; now at rank 1" in s.text
    assert s.status == "ok" and not s.error, s.text   # was: TypeError: signal handler must be ...
    assert values(s.result) == ["1", "2"]


def test_where_starts_at_the_cell_not_at_our_machinery(k):
    s = drive(k, "%%on_mesh --ranks 1\ndef f():\n    breakpoint()\n    return 1\nf()",
              ["where", "up", "up", "continue"])
    assert s.status == "ok", s.text
    where = s.text.split("(rank 1 pdb) where\n")[1].split("(rank 1 pdb)")[0]
    for internal in ("runpy", "zygote", "node/proc.py", "cells.py"):
        assert internal not in where, where   # was: ~10 frames of the proc's own loop first
    assert where.lstrip().startswith("[0] <In [") and "f()" in where
    assert "Oldest frame" in s.text.split("(rank 1 pdb) up\n")[2]   # `up` stops at the cell


def test_pdb_set_trace_and_the_named_dim_grammar(k):
    def answer(prompt, s):
        if "2 ranks paused" not in s.text:
            time.sleep(0.1)
            return "ranks"
        plan = ["cast ranks(gpus=1:3) p v * 2", "continue all"]
        return plan[sum(1 for line in s.text.splitlines() if line.split(") ", 1)[-1] in plan)]

    s = drive(k, "%%on_mesh --ranks 1:3\nimport pdb\nv = rank + 5\npdb.set_trace()\nv", answer)
    assert s.status == "ok", s.text
    assert "[rank 1] 12\n" in s.text and "[rank 2] 14\n" in s.text
    assert values(s.result) == ["6", "7"]


# ----------------------------------------------------------------------- actor endpoint, plain cell
STEPPER = ("if 'stepper' not in dir():\n"
           "    from monarch_kernel.actor import Actor, endpoint\n"
           "    class Stepper(Actor):\n"
           "        @endpoint\n"
           "        def step(self, k: int) -> int:\n"
           "            y = k * 3\n"
           "            breakpoint()\n"
           "            return y + 1\n"
           "    stepper = mesh.spawn('stepper', Stepper)")


def test_breakpoint_in_an_endpoint_called_from_a_plain_cell(k):
    k.ok(STEPPER)
    s = drive(k, "stepper.slice(gpus=2).step.call_one(k=5).get()", ["p y", "where", "c"])
    assert s.status == "ok", s.text
    assert "rank 2 paused at" in s.text and "step() (stepper.step)" in s.text
    assert "(rank 2 pdb) p y\n15\n" in s.text
    assert s.result == "16"


# ----------------------------------------------------------------------- post-mortem
def test_post_mortem_stops_a_raising_rank_at_the_raise(k):
    k.ok("%mesh debug --post-mortem on")
    try:
        s = drive(k, "%%on_mesh\nz = 7\nif rank == 0:\n    z / 0\nz", ["p z", "c"])
    finally:
        k.ok("%mesh debug --post-mortem off")
    assert "post-mortem: ZeroDivisionError: division by zero" in s.text
    assert "(rank 0 pdb) p z\n7\n" in s.text
    assert s.status == "error" and "ZeroDivisionError" in s.text   # the error still comes back
    r = k.run("%%on_mesh\nif rank == 0:\n    1 / 0")   # off: no console
    assert r.status == "error" and "ZeroDivisionError" in str(r.error)


# ----------------------------------------------------------------------- interrupt
def test_interrupt_at_the_prompt_leaves_no_rank_paused(k):
    s = drive(k, "%%on_mesh\nimport time\nbreakpoint()\ntime.sleep(60)", [], interrupt_at=0)
    assert s.status == "error" and "KeyboardInterrupt" in s.text, s.text
    assert "every paused rank was interrupted" in s.text
    out = k.ok("%mesh debug list").stdout
    assert "no rank is paused" in out
    assert k.ok("%%on_mesh\nrank").result   # the mesh is usable


def test_a_front_end_without_input_boxes_gets_a_clear_message_and_the_cell_finishes(k):
    mid = k.kc.execute("%%on_mesh\nif rank == 0:\n    breakpoint()\nrank", allow_stdin=False)
    r = k.wait(mid, timeout=30)
    assert r.status == "ok"
    assert "cannot answer input requests (allow_stdin is off); they were continued" in r.stdout
    assert r.result.endswith("rank 2: 2")


# ----------------------------------------------------------------------- outside a cell
def test_list_cast_attach_continue_outside_a_running_cell(k):
    k.ok(STEPPER)
    k.ok("fut = stepper.slice(gpus=1).step.call_one(k=2)")   # rank 1 pauses; the cell ends
    deadline = time.monotonic() + 20
    while "stepper.step" not in (out := k.ok("%mesh debug list").stdout) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert out.splitlines()[0].split() == ["rank", "in", "where", "function", "state"]
    assert out.splitlines()[1].split()[:2] == ["1", "stepper.step"]
    assert "[rank 1] 6\n" in k.ok("%mesh debug cast ranks(1) p y").stdout
    s = drive(k, "%mesh debug attach 1", ["p y + 1", "detach"])
    assert s.prompts == ["(rank 1 pdb) "] * 2 and "7\n" in s.text and "stay paused" in s.text
    out = k.ok("%mesh debug continue").stdout
    assert "continued rank 1" in out
    assert k.ok("fut.get()").result == "7"


def test_a_reattached_controller_sees_ranks_paused_while_it_was_away(k):
    k.ok(STEPPER)
    k.ok("fut = stepper.slice(gpus=0).step.call_one(k=4)")
    deadline = time.monotonic() + 20
    while "stepper.step" not in k.ok("%mesh debug list").stdout and time.monotonic() < deadline:
        time.sleep(0.2)
    k.restart()   # the kernel leaves; the mesh (and the paused rank) stays
    k.ok(f"%mesh connect {MESH}", timeout=60)
    out = k.ok("%mesh debug list").stdout
    assert out.splitlines()[1].split()[:2] == ["0", "stepper.step"], out
    assert "continued rank 0" in k.ok("%mesh debug continue").stdout
    assert "no rank is paused" in k.ok("%mesh debug list").stdout


# ----------------------------------------------------------------------- bad input
@pytest.mark.parametrize("line,message", [
    ("attach 2", "rank 2 is not paused in the debugger (no rank is paused)"),
    ("attach 9", "rank 9 is outside the mesh: valid ranks are 0..2"),
    ("cast ranks(1)", "cast needs ranks and a command"),
    ("frobnicate", "invalid choice: 'frobnicate'"),
])
def test_bad_debug_commands_say_what_is_wrong(k, line, message):
    r = k.run(f"%mesh debug {line}")
    text = r.stderr + r.error.get("evalue", "")   # a UsageError shows on stderr
    assert r.status == "error"
    assert message in text, text
    assert k.ok("%%on_mesh\nrank").result   # the mesh stays usable


def test_bad_console_input_is_reported_and_the_console_goes_on(k):
    s = drive(k, "%%on_mesh\nif rank == 1:\n    breakpoint()\nrank",
              ["rank 0", "rank 7", "rank x", "cast 1", "cast ranks(5) p 1", "c"])
    assert s.status == "ok", s.text
    assert "debugger: rank 0 is not paused in the debugger (paused: rank 1)" in s.text
    assert "debugger: rank 7 is outside the mesh: valid ranks are 0..2" in s.text
    assert "debugger: `rank x`: give a rank number" in s.text
    assert "debugger: cast needs ranks and a command" in s.text
    assert "debugger: rank 5 is outside the mesh" in s.text
    assert s.prompts == ["(rank 1 pdb) "] * 6


# ----------------------------------------------------------------------- the widget, via its comms
class Iopub:
    """Every iopub message, for waiting on widget state while a cell runs."""

    def __init__(self, k: KernelHarness):
        self.k, self.seen = k, []

    def wait(self, pred, timeout: float = 30, what: str = ""):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for m in self.seen:
                if pred(m):
                    self.seen.remove(m)
                    return m
            try:
                self.seen.append(self.k.kc.get_iopub_msg(timeout=0.1))
            except queue.Empty:
                pass
        raise TimeoutError(f"no iopub message {what} within {timeout} s")


def _value(m) -> str:
    if m["msg_type"] not in ("comm_msg", "comm_open"):
        return ""
    state = m["content"]["data"].get("state") or {}
    return str(state.get("value", ""))


def test_the_widget_drives_a_rank_while_its_cell_runs(k):
    io = Iopub(k)
    assert "debugger widget on" in k.ok("%mesh debug").stdout
    comms = {}

    def send(model, desc, data):
        msg = k.kc.session.msg("comm_msg", {"comm_id": comms[(model, desc)], "data": data})
        k.kc.shell_channel.send(msg)

    def click(desc):
        send("ButtonModel", desc, {"method": "custom", "content": {"event": "click"}})

    cell = k.kc.execute("%%on_mesh\nx = rank * 10\nif rank == 1:\n    breakpoint()\n    x += 1\nx")
    io.wait(lambda m: "monarch-debugger-row" in _value(m) and "<td style='text-align:left;padding:0 8px'>1</td>"
            in _value(m), what="(table shows rank 1)")
    for m in io.seen:   # the widget opened under the running cell
        if m["msg_type"] == "comm_open":
            st = m["content"]["data"]["state"]
            comms[(st["_model_name"], st.get("description", ""))] = m["content"]["comm_id"]
    shown = io.wait(lambda m: m["parent_header"].get("msg_id") == cell and m["msg_type"] == "display_data"
                    and "application/vnd.jupyter.widget-view+json" in m["content"]["data"], what="(widget)")
    note = io.wait(lambda m: m["parent_header"].get("msg_id") == cell and m["msg_type"] == "stream",
                   what="(the cell says who drives the rank)")["content"]["text"]
    assert "rank 1 paused at <In [" in note and "the debugger widget drives it" in note
    before = len(io.seen)
    send("TextModel", "command", {"method": "update", "state": {"value": "p x"}, "buffer_paths": []})
    click("send")
    io.wait(lambda m: "(rank 1 pdb) p x\n10\n" in _value(m), what="(rank 1's pane shows p x)")
    states = [m["content"]["execution_state"] for m in io.seen[before:] if m["msg_type"] == "status"]
    assert "idle" not in states, states   # JupyterLab's indicator stays busy while the cell runs
    click("continue")
    settled = io.wait(lambda m: m["parent_header"].get("msg_id") == cell and m["msg_type"] == "update_display_data",
                      what="(the widget became text)")
    assert settled["content"]["transient"]["display_id"] == shown["content"]["transient"]["display_id"]
    assert settled["content"]["data"] == {"text/plain": "mesh debugger: drove rank 1 in this cell (the widget "
                                                        "closed when the cell ended)"}
    done = io.wait(lambda m: m["parent_header"].get("msg_id") == cell and m["msg_type"] == "execute_result",
                   what="(the cell finished)")
    assert values(done["content"]["data"]["text/plain"]) == ["0", "11", "20"]
    assert "debugger console on" in k.ok("%mesh debug console").stdout   # the next cells use the console
    assert "no rank is paused" in k.ok("%mesh debug list").stdout
