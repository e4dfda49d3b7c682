"""JupyterLab's visual debugger on one rank: debug_request messages on the control channel,
as JupyterLab's debugger panel sends them, through a real Monarch kernel and a 2-proc mesh."""
from __future__ import annotations

import os
import queue
import signal
import time

import pytest
from kernel_harness import KernelHarness, kernel_with_mesh

MESH = "kt-dap"
CELL = "%%on_mesh\nx = rank * 10\ny = x + 1\nfor_gutter = 'line 4'\ny\n"


@pytest.fixture(scope="module")
def k():
    with kernel_with_mesh(MESH, "--procs 2") as h:
        yield h


class Dap:
    """The panel's side: numbered DAP requests in debug_request messages; debug_event on iopub."""

    def __init__(self, k: KernelHarness):
        self.k, self.seq, self.events = k, 0, []

    def request(self, command: str, timeout: float = 30, **arguments) -> dict:
        self.seq += 1
        msg = self.k.kc.session.msg("debug_request", {"type": "request", "seq": self.seq,
                                                      "command": command, "arguments": arguments})
        self.k.kc.control_channel.send(msg)
        deadline = time.monotonic() + timeout
        while True:
            reply = self.k.kc.control_channel.get_msg(timeout=max(0.1, deadline - time.monotonic()))
            if reply["parent_header"].get("msg_id") == msg["header"]["msg_id"]:
                return reply["content"]

    def event(self, name: str, timeout: float = 30) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            for e in self.events:
                if e.get("event") == name:
                    self.events.remove(e)
                    return e
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {name!r} debug_event in {timeout} s; got {self.events}")
            self.pump()

    def pump(self, on_other=None) -> None:
        try:
            m = self.k.kc.get_iopub_msg(timeout=0.1)
        except queue.Empty:
            return
        if m["msg_type"] == "debug_event":
            self.events.append(m["content"])
        elif on_other is not None:
            on_other(m)


def start_panel(dap: Dap) -> None:
    """What JupyterLab does when the debugger toggle is switched on."""
    init = dap.request("initialize", clientID="test", clientName="test", adapterID="",
                       pathFormat="path", linesStartAt1=True, columnsStartAt1=True,
                       supportsVariableType=True, supportsVariablePaging=True,
                       supportsRunInTerminalRequest=True, locale="en")
    assert init["success"], init
    attach = dap.request("attach")
    assert attach["success"], attach
    info = dap.request("debugInfo")
    assert info["body"]["isStarted"]


def test_the_panel_stops_the_chosen_rank_in_an_on_mesh_cell(k):
    r = k.ok("%mesh debug dap 1")
    assert "now drives rank 1" in r.stdout
    dap = Dap(k)
    start_panel(dap)
    path = dap.request("dumpCell", code=CELL)["body"]["sourcePath"]
    bp = dap.request("setBreakpoints", source={"path": path}, breakpoints=[{"line": 3}],
                     sourceModified=False)
    assert bp["success"] and bp["body"]["breakpoints"][0]["verified"], bp
    assert dap.request("configurationDone")["success"]

    mid = k.submit(CELL)
    stopped = dap.event("stopped")
    assert stopped["body"]["reason"] == "breakpoint"

    threads = dap.request("threads")["body"]["threads"]
    assert "MainThread" in [t["name"] for t in threads], threads   # the rank's threads
    tid = stopped["body"]["threadId"]
    frames = dap.request("stackTrace", threadId=tid)["body"]["stackFrames"]
    assert frames[0]["source"]["path"] == path and frames[0]["line"] == 3
    scopes = dap.request("scopes", frameId=frames[0]["id"])["body"]["scopes"]
    names = {v["name"]: v["value"] for v in
             dap.request("variables", variablesReference=scopes[0]["variablesReference"])["body"]["variables"]}
    assert names["rank"] == "1" and names["x"] == "10" and "y" not in names

    nxt = dap.request("next", threadId=tid)
    assert nxt["success"], nxt
    dap.event("stopped")
    frames = dap.request("stackTrace", threadId=tid)["body"]["stackFrames"]
    assert frames[0]["line"] == 4
    assert dap.request("continue", threadId=tid)["success"]
    reply = k.wait(mid, timeout=30)
    assert reply.status == "ok", reply.error
    assert "0: 1" in reply.result and "1: 11" in reply.result   # rank 0 ran on; rank 1 finished

    # the panel off and on again, then back to the kernel's own process
    dap.request("disconnect", restart=False, terminateDebuggee=True)
    assert "drives rank 1" in k.ok("%mesh debug dap").stdout
    assert "kernel's own process again" in k.ok("%mesh debug dap off").stdout
    r = k.ok(CELL)   # cells run under their usual names again
    assert "1: 11" in r.result


def test_switching_ranks_while_the_panel_is_on_keeps_its_breakpoints(k):
    dap = Dap(k)
    k.ok("%mesh debug dap 0")
    start_panel(dap)
    path = dap.request("dumpCell", code=CELL)["body"]["sourcePath"]
    assert dap.request("setBreakpoints", source={"path": path}, breakpoints=[{"line": 3}])["success"]
    assert "now drives rank 1" in k.ok("%mesh debug dap 1").stdout   # panel stays on: replayed
    mid = k.submit(CELL)
    stopped = dap.event("stopped")
    tid = stopped["body"]["threadId"]
    frames = dap.request("stackTrace", threadId=tid)["body"]["stackFrames"]
    scopes = dap.request("scopes", frameId=frames[0]["id"])["body"]["scopes"]
    names = {v["name"]: v["value"] for v in
             dap.request("variables", variablesReference=scopes[0]["variablesReference"])["body"]["variables"]}
    assert names["rank"] == "1"
    dap.request("setBreakpoints", source={"path": path}, breakpoints=[])
    assert dap.request("continue", threadId=tid)["success"]
    assert k.wait(mid, timeout=30).status == "ok"
    dap.request("disconnect", restart=False, terminateDebuggee=True)
    k.ok("%mesh debug dap off")


def usage_error(k: KernelHarness, code: str) -> str:
    r = k.run(code)
    assert r.status == "error", r.stdout
    return r.stderr + r.error.get("evalue", "")   # a UsageError shows on stderr


def test_a_rank_outside_the_mesh_or_bad_input_is_a_clear_message(k):
    text = usage_error(k, "%mesh debug dap 5")
    assert "5" in text and "0" in text and "dap" in text, text
    assert "one rank or `off`" in usage_error(k, "%mesh debug dap 0 1")
    assert "names 2" in usage_error(k, "%mesh debug dap ranks(0:2)")
    assert "kernel's own process" in k.ok("%mesh debug dap").stdout


def test_a_dead_rank_is_a_clear_message(k):
    pid = int(k.ok("%%on_mesh --ranks 1\nimport os\nos.getpid()").result.splitlines()[-1].split(": ")[1])
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while True:
        r = k.run("%mesh debug dap 1")
        text = r.stderr + r.error.get("evalue", "")
        if r.status == "error" and "dead" in text:
            break
        assert time.monotonic() < deadline, text
        time.sleep(0.2)
    assert "rank 1 is dead" in text and "respawn" in text, text
    assert "0: 0" in k.ok("%%on_mesh --ranks 0\nrank").result   # the mesh stays usable


def test_off_while_the_panel_is_on_hands_it_back_to_the_kernel(k):
    dap = Dap(k)
    k.ok("%mesh debug dap 0")
    start_panel(dap)
    assert "kernel's own process again" in k.ok("%mesh debug dap off").stdout
    threads = dap.request("threads")
    names = [t["name"] for t in threads["body"]["threads"]]
    assert "IPythonHistorySavingThread" in names, names   # the kernel's threads, not a rank's
    dap.request("disconnect", restart=False, terminateDebuggee=False)
