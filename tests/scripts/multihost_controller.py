"""Controller for tests/test_multihost.py, run inside network namespace A.

Reads agent addresses and the key from argv, drives a mesh spanning both hosts, prints
one JSON line per check, and waits for "cut" on stdin before timing host loss.
"""
import json
import sys
import time

from monarch_kernel.actor import Actor, SupervisionError, attach_to_workers, endpoint


class Where(Actor):
    @endpoint
    def addr(self) -> str:
        import monarch_kernel.node.proc as p

        return p.WORKER.work_addr.split("//")[1].split(":")[0]

    @endpoint
    def ask(self, other) -> list:
        """Proc-to-proc: call another mesh (on the other host) from this actor."""
        return other.addr.call().get(timeout=10).values()

    @endpoint
    def sleep(self, s: float) -> float:
        time.sleep(s)
        return s


def out(**kw):
    print(json.dumps(kw), flush=True)


def main():
    addrs, key = sys.argv[1].split(","), sys.argv[2]
    hosts = attach_to_workers(addrs, key)
    procs = hosts.spawn_procs(per_host={"gpus": 2})
    out(sizes=procs.sizes)
    where = procs.spawn("where", Where)
    out(all=where.addr.call().get(timeout=20).values())
    out(host1=where.slice(hosts=1).addr.call().get(timeout=20).values())
    out(cross=where.slice(hosts=0, gpus=0).ask.call_one(where.slice(hosts=1)).get(timeout=20))
    out(ready_for_cut=True)
    sys.stdin.readline()
    fut = where.slice(hosts=1).sleep.call(30)
    t0 = time.monotonic()
    try:
        fut.get(timeout=20)
        out(lost_after=None)
    except SupervisionError as e:
        out(lost_after=round(time.monotonic() - t0, 2), error=str(e))
    out(host0_after=where.slice(hosts=0).addr.call().get(timeout=10).values())


if __name__ == "__main__":
    main()
