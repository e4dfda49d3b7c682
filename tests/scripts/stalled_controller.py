"""A controller whose procs print while it cannot answer its agent (stopped or starved).

Run by tests/test_reliability_liveness.py as a subprocess: prints ``READY <pid>`` once its
proc is up, then ``CALLING`` as one proc starts printing a line every 50 ms for ``argv[1]``
seconds; the test stops or starves this process meanwhile. Ends with ``RESULT <json>``:
the lines that reached this controller, and the count of lines its procs said they kept
back (written on their host only), in all and when the long call's reply came.
"""
import json
import sys
import time

from monarch_kernel.actor import Actor, endpoint, this_host
from monarch_kernel.core.runtime import runtime


class Printer(Actor):
    @endpoint
    def ticks(self, seconds: float) -> int:
        n, t0 = 0, time.monotonic()
        while time.monotonic() - t0 < seconds:
            print(f"tick {n}", flush=True)
            n += 1
            time.sleep(0.05)
        return n


def main():
    got, kept = [], [0]

    def output(rank, stream, text):
        if stream == "skipped":
            kept[0] += int(text.split(" ", 1)[0])
        else:
            got.extend(line for line in text.splitlines() if line.startswith("tick "))

    hm = this_host("stalled-controller", lease=60)
    procs = hm.spawn_procs(per_host={"gpus": 1}, name="printer")
    p = procs.spawn("p", Printer)
    p.ticks.call_one(0.01).get(30)
    rt = runtime()
    rt.output = output
    print(f"READY {hm._agents[0]['pid']}", flush=True)
    sys.stdin.readline()
    print("CALLING", flush=True)
    n = p.ticks.call_one(float(sys.argv[1])).get(60)
    at_reply = {"got": len(got), "kept_back": kept[0]}   # what the call's own reply came after
    p.ticks.call_one(0.01).get(30)   # one line more: a count kept back goes with it
    time.sleep(0.5)
    procs.stop()
    print("RESULT " + json.dumps({"printed": n + 1, "got": len(got), "kept_back": kept[0], "call": n,
                                  "at_reply": at_reply}), flush=True)
    hm.shutdown()


if __name__ == "__main__":
    main()
