"""A controller script whose actor class and helper function live in ``__main__``.

Run by tests/test_core_api.py as a subprocess: it prints what the test checks (worker
output arrives prefixed with the rank; the remote traceback of a raise shows this file's
real source line) and ends with a line ``RESULT <json>``.
"""
import json
import sys

from monarch_kernel.actor import Actor, ActorError, current_rank, endpoint, this_host


def square(x):
    return x * x


class Worker(Actor):
    def __init__(self, f):
        self.f = f

    @endpoint
    def apply(self, x):
        return self.f(x) + current_rank().rank

    @endpoint
    def hello(self, n):
        for i in range(n):
            print(f"hello {i} from rank {current_rank().rank}")
        return n

    @endpoint
    def fail(self):
        raise RuntimeError("failing on purpose in __main__")  # MARKER-LINE


def main():
    procs = this_host().spawn_procs(per_host={"gpus": 2})
    w = procs.spawn("w", Worker, square)
    result = {"apply": w.apply.call(3).get(30).values(),
              "hello": w.hello.call(int(sys.argv[1])).get(30).values()}
    try:
        w.slice(gpus=1).fail.call_one().get(30)
    except ActorError as e:
        result["traceback"] = e.remote_traceback
        result["rank"] = e.rank
    procs.stop()
    sys.stdout.flush()
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
