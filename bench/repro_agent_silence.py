"""Spawn 256 procs on a same-machine agent, again and again, and record what the liveness
judgement sees: when the agent sent each heartbeat answer and when the controller read it,
each tick's silence and the scheduler's view, every thread of the agent (state, wchan,
schedstat) every 20 ms, and every host the controller declared lost.

    .venv/bin/python bench/repro_agent_silence.py [--rounds 5] [--n 256] [--out /tmp/repro.json]

Run a load beside it (bench/load_mix.py, other test suites). For each loss it prints the
agent's threads over the seconds before it.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time

from _home import private_dir

private_dir("MONARCH_KERNEL_HOME", "mk-repro-silence-")

SITE = textwrap.dedent('''
    import os, time
    try:
        with open("/proc/self/cmdline", "rb") as f:
            _agent = b"monarch_kernel.node.agent" in f.read()
    except OSError:
        _agent = False
    if _agent:   # the agent's heartbeat answer carries its send time (CLOCK_MONOTONIC, shared)
        from monarch_kernel.core import messages as _m
        _make = _m.Ev.make
        def make(name, *a, _make=_make):
            return _make(name) + (time.monotonic(),) if name == "hb" else _make(name, *a)
        _m.Ev.make = make
''')

SAMPLER = textwrap.dedent('''
    import json, os, signal, sys, time
    pid, out = int(sys.argv[1]), sys.argv[2]
    rows, stop = [], []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    def rd(p):
        try:
            with open(p) as f:
                return f.read()
        except OSError:
            return ""
    while not stop and os.path.exists(f"/proc/{pid}"):
        t = time.monotonic()
        pids = [pid] + [int(c) for c in rd(f"/proc/{pid}/task/{pid}/children").split()][:1]
        for p in pids:
            try:
                tids = os.listdir(f"/proc/{p}/task")
            except OSError:
                continue
            for tid in tids:
                st = rd(f"/proc/{p}/task/{tid}/stat")
                if not st:
                    continue
                comm = st[st.index("(") + 1:st.rindex(")")]
                state = st.rsplit(")", 1)[1].split()[0]
                ss = rd(f"/proc/{p}/task/{tid}/schedstat").split()
                rows.append((round(t, 4), p, int(tid), comm, state, rd(f"/proc/{p}/task/{tid}/wchan"),
                             int(ss[0]) if ss else 0, int(ss[1]) if ss else 0))
        time.sleep(0.02)
        if len(rows) > 400000:
            del rows[:100000]
    with open(out, "w") as f:
        json.dump(rows, f)
''')


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--n", type=int, default=256)
    p.add_argument("--out", default="/tmp/repro-agent-silence.json")
    a = p.parse_args(argv)
    site = tempfile.mkdtemp(prefix="mk-repro-site-")
    with open(os.path.join(site, "sitecustomize.py"), "w") as f:
        f.write(SITE)
    os.environ["PYTHONPATH"] = site + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
    os.environ["MONARCH_KERNEL_MAX_PROCS"] = str(a.n + 16)
    os.environ["MONARCH_KERNEL_PROC_MEM_MB"] = "15"

    from monarch_kernel.actor import this_host
    from monarch_kernel.core import agent_links, host_liveness

    events: list = []   # (t, what, ...)
    orig_on_socket, orig_tick, orig_lost = (agent_links.AgentLinks.on_socket, agent_links.AgentLinks.tick,
                                           agent_links.AgentLinks._host_lost)
    orig_look = host_liveness.LocalAgentWatch.look

    def on_socket(self, link):
        opener = self.rt.keyring.open

        def open_(frames, who, _o=opener):
            msg = _o(frames, who)
            if type(msg) is tuple:
                extra = msg[2] if msg[0] == "ev" and msg[1] == "hb" and len(msg) > 2 else None
                events.append((time.monotonic(), "recv", msg[0], msg[1] if msg[0] == "ev" else "", extra))
            return msg
        self.rt.keyring.open = open_
        try:
            return orig_on_socket(self, link)
        finally:
            del self.rt.keyring.open

    def tick(self, now):
        for link in self.links.values():
            if link.watched and not link.lost and now - link.last_seen > 0.6:
                events.append((now, "tick", round(now - link.last_seen, 3), link.unanswered,
                               link.os_watch.busy if link.os_watch else None,
                               getattr(link.os_watch, "why", "") if link.os_watch else ""))
        return orig_tick(self, now)

    def look(self, now=None):
        before_t, before_ns = self._t, self._ns
        orig_look(self, now)
        if before_ns is not None and self._ns is not None and self._t > before_t:
            events.append((self._t, "look", round((self._ns - before_ns) / ((self._t - before_t) * 1e9), 3),
                           round(self._t - before_t, 3), host_liveness._state(self.pid),
                           getattr(self, "why", None)))

    def host_lost(self, link, silent_s, gone=False):
        events.append((time.monotonic(), "LOST", round(silent_s, 2), gone))
        return orig_lost(self, link, silent_s, gone)

    agent_links.AgentLinks.on_socket, agent_links.AgentLinks.tick = on_socket, tick
    agent_links.AgentLinks._host_lost = host_lost
    host_liveness.LocalAgentWatch.look = look

    hm = this_host("repro-silence")
    agent_pid = hm._agents[0]["pid"]
    samples_path = a.out + ".samples"
    sampler = subprocess.Popen([sys.executable, "-c", SAMPLER, str(agent_pid), samples_path])
    results = []
    try:
        for r in range(a.rounds):
            t0 = time.monotonic()
            try:
                pm = hm.spawn_procs(per_host={"gpus": a.n}, name=f"r{r}")
                ok = "ok"
            except Exception as e:   # noqa: BLE001
                pm, ok = None, f"{type(e).__name__}: {e}"[:300]
            results.append((r, round(time.monotonic() - t0, 1), ok, os.getloadavg()[0]))
            print(f"round {r}: {results[-1]}", flush=True)
            if pm is not None:
                try:
                    pm.stop()
                except Exception as e:   # noqa: BLE001
                    results.append((r, "stop", f"{type(e).__name__}: {e}"[:300]))
                    print(f"round {r}: stop failed: {results[-1]}", flush=True)
            time.sleep(1)
    finally:
        hm.shutdown()
        sampler.terminate()
        sampler.wait(30)
    with open(samples_path) as f:
        samples = json.load(f)
    with open(a.out, "w") as f:
        json.dump({"results": results, "events": events, "agent_pid": agent_pid}, f)
    report(events, samples, agent_pid)


def report(events, samples, agent_pid):
    hb = [(e[0], e[4]) for e in events if e[1] == "recv" and e[3] == "hb" and e[4] is not None]
    if hb:
        delays = sorted(t - s for t, s in hb)
        print(f"hb answers: {len(hb)}; agent send -> controller read: p50 {delays[len(delays) // 2] * 1e3:.0f} ms, "
              f"max {delays[-1] * 1e3:.0f} ms")
    gaps = sorted(((b[1] - a[1]), a[1]) for a, b in zip(hb, hb[1:]))[-5:]
    print("longest gaps between agent hb sends:", [(round(g, 2), round(t, 2)) for g, t in gaps])
    for e in events:
        if e[1] != "LOST":
            continue
        t = e[0]
        print(f"\n=== LOST at {t:.2f} (silent {e[2]} s, gone {e[3]})")
        for x in events:
            if t - 4.5 <= x[0] <= t + 1.5 and x[1] != "recv" or (x[1] == "recv" and t - 4.5 <= x[0] <= t + 1.5
                                                                and x[3] == "hb"):
                print("   ", round(x[0] - t, 3), x[1:])
        last = {}
        for s in samples:
            if t - 4.5 <= s[0] <= t + 1.0 and s[1] == agent_pid:
                key = s[2]
                prev = last.get(key)
                if prev is None or prev[4:6] != s[4:6] or s[0] - prev[0] > 0.5:
                    print(f"    {s[0] - t:+.3f} tid {s[2]} {s[3]:<16} {s[4]} {s[5]:<24} "
                          f"run {s[6] / 1e9:.3f} wait {s[7] / 1e9:.3f}")
                    last[key] = s


if __name__ == "__main__":
    main()
