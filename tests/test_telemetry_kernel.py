"""%mesh logs, %mesh top and mesh.telemetry through a real Monarch kernel and a 2-proc mesh."""
from __future__ import annotations

import re
import threading
import time

import pytest
from kernel_harness import kernel_with_mesh

MESH = "kt-telemetry"


@pytest.fixture(scope="module")
def k():
    with kernel_with_mesh(MESH, "--procs 2") as h:
        yield h


def test_logs_show_what_ranks_printed_with_grep_ranks_and_tail(k):
    k.ok('%%on_mesh\nfor i in range(3): print(f"epoch {i} loss {rank + i}")')
    out = k.ok('%mesh logs --grep "epoch [12]"').stdout.splitlines()
    assert sorted(out) == ["[rank 0] epoch 1 loss 1", "[rank 0] epoch 2 loss 2",
                           "[rank 1] epoch 1 loss 2", "[rank 1] epoch 2 loss 3"]
    assert k.ok("%mesh logs --ranks 1 --tail 1 --grep epoch").stdout.splitlines() == [
        "[rank 1] epoch 2 loss 3", "(2 earlier matching lines not shown: --tail N for more)"]


def test_output_printed_while_no_notebook_was_attached_is_in_the_logs(k):
    k.ok('%%on_mesh\nimport threading\nthreading.Timer(1.0, print, (f"while away {rank}",)).start()')
    k.ok("%mesh disconnect")
    time.sleep(2.0)
    k.ok(f"%mesh connect {MESH}", timeout=60)
    assert sorted(k.ok('%mesh logs --grep "while away"').stdout.splitlines()) == [
        "[rank 0] while away 0", "[rank 1] while away 1"]


def test_a_bad_logs_flag_or_regex_says_what_to_fix(k):
    r = k.run("%mesh logs --grep '('")   # a UsageError: IPython prints it on stderr
    assert r.status == "error" and "--grep '(' is not a valid regular expression" in r.stderr + str(r.error)
    r = k.run("%mesh logs --tial 3")
    assert r.status == "error" and "unrecognized arguments: --tial" in r.stderr + str(r.error)


def test_top_keeps_refreshing_while_another_cell_runs_and_leaves_a_text_line(k):
    r = k.ok("%mesh top")
    shown = [m for m in r.outputs if m["msg_type"] == "display_data"][0]["content"]["data"]
    assert "application/vnd.jupyter.widget-view+json" in shown
    assert shown["text/plain"].startswith(f"mesh {MESH} · 2 procs · CPU ")
    before = k.value("[v.updates for v in __import__('monarch_kernel.telemetry.top').telemetry.top.SHOWN][0]")
    k.ok("%%on_mesh\nimport time; time.sleep(3)")
    after = k.value("[v.updates for v in __import__('monarch_kernel.telemetry.top').telemetry.top.SHOWN][0]")
    assert after >= before + 1   # refreshed while the other cell held the kernel
    k.ok("[v.close() for v in __import__('monarch_kernel.telemetry.top').telemetry.top.SHOWN]; import time; "
         "time.sleep(1.5)")
    assert k.value("[v.open for v in __import__('monarch_kernel.telemetry.top').telemetry.top.SHOWN]") == [False]


def test_mesh_telemetry_query_shows_a_table_of_rows(k):
    r = k.ok("mesh.telemetry.query('select rank, count(*) > 0 from samples group by rank')")
    assert r.result.splitlines() == ["rank  count(*) > 0", "0     1", "1     1"]
    assert "<table>" in r.data()[0]["data"]["text/html"]


def test_logs_follow_prints_new_lines_until_interrupted(k):
    k.ok('%%on_mesh\nimport threading, time\ndef _tick():\n    for i in range(6):\n        time.sleep(0.7)\n'
         '        print(f"tick {i} on {rank}", flush=True)\nthreading.Thread(target=_tick, daemon=True).start()')
    seen, timer = [], []
    followed = re.compile(r"\d\d:\d\d:\d\d\.\d{3} \[rank (\d)\] tick 2 on")   # --time: the follow's own lines

    def on_output(msg):
        if msg["msg_type"] == "stream":
            seen.append(msg["content"]["text"])
            if {m.group(1) for m in followed.finditer("".join(seen))} == {"0", "1"} and not timer:
                # as a user would: at some moment after, most likely while it waits for more
                timer.append(threading.Timer(0.5, k.km.interrupt_kernel))
                timer[0].start()

    r = k.wait(k.submit('%mesh logs --follow --time --grep "^tick" --tail 0'), timeout=30, on_output=on_output)
    assert r.status == "ok" and "(stopped following)" in r.stdout
    lines = [ln for ln in r.stdout.splitlines() if re.match(r"\d\d:", ln)]
    assert {"[rank 0] tick 1 on 0", "[rank 1] tick 1 on 1"} <= {ln.split(" ", 1)[1] for ln in lines}


def test_cells_table_records_each_rank_s_cells_and_failures(k):
    count = "mesh.telemetry.query('select count(*) from cells')[0][0]"
    before = k.value(count)
    k.ok("%%on_mesh\nmarker_ok = rank")
    k.run("%%on_mesh\nif rank == 1: raise ValueError('bad rank')")
    deadline = time.monotonic() + 10   # the agents collect cell records once a second
    while time.monotonic() < deadline and k.value(count) < before + 4:
        time.sleep(0.5)
    rows = k.value("[tuple(r) for r in mesh.telemetry.query('select rank, cell, ok from cells order by time')][-4:]")
    assert sorted((r[0], r[2]) for r in rows[-2:]) == [(0, 1), (1, 0)]   # the failing cell: rank 1 not ok
    assert sorted((r[0], r[2]) for r in rows[:2]) == [(0, 1), (1, 1)]
    assert all(r[1].endswith("on mesh>") for r in rows)


TOP_VIEW = "[v for v in __import__('monarch_kernel.telemetry.top').telemetry.top.SHOWN if v.open][-1]"


def test_top_on_40_ranks_has_a_row_a_host_and_the_dead_rank_apart_and_all_on_asking():
    """Past 32 ranks a row a rank is a page of bars redrawn each second (256 ranks: 256 rows):
    the view has a row a host, then each dead or paused rank; ``--all`` keeps a row a rank."""
    import os
    import signal
    import socket

    with kernel_with_mesh("kt-top-big", "--hosts 2 --procs 20") as k:
        k.ok("%mesh top")
        html = k.value(f"{TOP_VIEW}.html()")
        assert html.count("monarch-top-host") == 2 and "monarch-top-row" not in html
        assert "20 idle" in html and "0-19" in html and "20-39" in html and "%mesh top --all</code>" in html
        os.kill(k.value("mesh.procs()[25].pid"), signal.SIGKILL)
        deadline = time.monotonic() + 10
        while "dead" not in k.value(f"{TOP_VIEW}.text()") and time.monotonic() < deadline:
            time.sleep(0.5)
        text = k.value(f"{TOP_VIEW}.text()").splitlines()
        assert text[0].startswith("mesh kt-top-big · 40 procs · 1 dead · CPU")
        host = socket.gethostname()
        assert [line.split()[:3] for line in text[2:4]] == [[f"{host}/hosts0", "0-19", "20"],
                                                            [f"{host}/hosts1", "20-39", "19"]]
        assert "1 dead" in text[3] and "ranks to look at:" in text
        assert text[text.index("ranks to look at:") + 2].split()[:3] == ["25", f"{host}/hosts1", "dead"]
        k.ok(f"{TOP_VIEW}.close()")
        k.ok("%mesh top --all")
        assert k.value(f"{TOP_VIEW}.html()").count("monarch-top-row") == 40
        k.ok(f"{TOP_VIEW}.close()")
