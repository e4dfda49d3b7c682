"""A host agent that reads nothing must not stop the controller's I/O thread.

A lost host is heartbeaten for as long as the process lives (so it can come back). Its
DEALER queue fills after SNDHWM (1000) messages; a blocking send then stopped the I/O
thread, and with it every reply and every other agent of the process: in the full suite,
test_sync hung some minutes after test_scale_256 cut a host off.
"""
from __future__ import annotations

import socket
import threading

import pytest

from monarch_kernel.core.errors import HostUnreachableError
from monarch_kernel.core.runtime import Runtime


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_an_agent_that_reads_nothing_fails_requests_and_keeps_the_io_thread_serving():
    rt = Runtime()
    try:
        addr, key = f"tcp://127.0.0.1:{_closed_port()}", b"k" * 32
        for _ in range(1500):   # more than the link's queue holds (SNDHWM 1000)
            rt.agent_send(addr, key, "hb", rt.address)
        fut = rt.agent_request(addr, key, "status")
        with pytest.raises(HostUnreachableError, match="queue is full"):
            fut.get(timeout=10)
        served = threading.Event()
        rt.call_in_io(served.set)
        assert served.wait(10), "the I/O thread is stuck sending to an agent that reads nothing"
    finally:
        rt.close()
