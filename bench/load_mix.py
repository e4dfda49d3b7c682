"""A mixed load for liveness work: CPU, fork/exec storms, disk writes with fsync, tmp-dir
churn (as pytest makes) and memory held and re-dirtied. Plain busy loops alone did not
make a same-machine agent look lost; this mixes what several test suites do at once.

    .venv/bin/python bench/load_mix.py [--cpu 4] [--fork 2] [--disk 2] [--tmp 2] [--mem-gb 4]
                                       [--seconds 600]

Every worker is a child of this process (one process group); SIGTERM/SIGINT or the end
of ``--seconds`` stops them all. It prints one line a second: load average, dirty and
writeback kB (from /proc/meminfo), fsyncs and forks done.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

BASE = ""   # every file of this run is under it; removed at the end


def cpu(_i, _n):
    x = 0
    while True:
        x += 1


def fork_storm(_i, n):
    """exec a short python (reads many files, maps libraries) and fork children that touch
    memory, back to back."""
    while True:
        subprocess.run([sys.executable, "-c", "import json, email.parser, decimal"], check=False)
        pid = os.fork()
        if pid == 0:
            b = bytearray(32 << 20)
            for k in range(0, len(b), 4096):
                b[k] = 1
            os._exit(0)
        os.waitpid(pid, 0)
        with n.get_lock():
            n.value += 2


def disk(i, n):
    """4 MiB writes with fsync, into one file rewritten over and over."""
    d = tempfile.mkdtemp(prefix=f"disk{i}-", dir=BASE)
    chunk = os.urandom(1 << 20)
    try:
        while True:
            with open(os.path.join(d, "f"), "wb") as f:
                for _ in range(4):
                    f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
            with n.get_lock():
                n.value += 1
    finally:
        shutil.rmtree(d, ignore_errors=True)


def tmp_churn(i, n):
    """What a test suite's tmp_path does: trees of small files made, fsynced, removed."""
    base = tempfile.mkdtemp(prefix=f"tmp{i}-", dir=BASE)
    try:
        k = 0
        while True:
            k += 1
            d = os.path.join(base, f"t{k}")
            os.makedirs(d)
            for j in range(200):
                with open(os.path.join(d, f"f{j}.py"), "w") as f:
                    f.write("x = 1\n" * 50)
            fd = os.open(d, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
            shutil.rmtree(d)
            with n.get_lock():
                n.value += 1
    finally:
        shutil.rmtree(base, ignore_errors=True)


def mem(gb, _n):
    """Hold ``gb`` GiB and dirty a page in every MiB of it, round and round."""
    blocks = [bytearray(1 << 30) for _ in range(int(gb))]
    while True:
        for b in blocks:
            for k in range(0, len(b), 1 << 20):
                b[k] = (b[k] + 1) & 255
        time.sleep(0.2)


def meminfo() -> dict:
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, v = line.split(":", 1)
            out[k] = int(v.split()[0])
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu", type=int, default=4)
    p.add_argument("--fork", type=int, default=2)
    p.add_argument("--disk", type=int, default=2)
    p.add_argument("--tmp", type=int, default=2)
    p.add_argument("--mem-gb", type=float, default=0)
    p.add_argument("--seconds", type=float, default=600)
    a = p.parse_args(argv)
    global BASE
    BASE = tempfile.mkdtemp(prefix="loadmix-")
    forks, syncs = mp.Value("l", 0), mp.Value("l", 0)
    workers = ([(cpu, i, forks) for i in range(a.cpu)] + [(fork_storm, i, forks) for i in range(a.fork)]
               + [(disk, i, syncs) for i in range(a.disk)] + [(tmp_churn, i, syncs) for i in range(a.tmp)])
    if a.mem_gb:
        workers.append((mem, a.mem_gb, None))
    procs = [mp.Process(target=f, args=(i, n), daemon=True) for f, i, n in workers]
    for w in procs:
        w.start()
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    signal.signal(signal.SIGINT, lambda *_: stop.update(now=True))
    end = time.monotonic() + a.seconds
    try:
        while not stop["now"] and time.monotonic() < end:
            time.sleep(1)
            m = meminfo()
            print(f"{time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.1f} dirty {m['Dirty']} kB "
                  f"writeback {m['Writeback']} kB avail {m['MemAvailable'] >> 10} MB "
                  f"forks {forks.value} fsyncs {syncs.value}", flush=True)
    finally:
        for w in procs:
            w.terminate()
        for w in procs:
            w.join(5)
            if w.is_alive():
                w.kill()
        shutil.rmtree(BASE, ignore_errors=True)


if __name__ == "__main__":
    main()
