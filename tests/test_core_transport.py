"""Same-host peers are reached over ipc, found through their tcp address. A tcp port that a
new proc reuses must lead to the new proc, not to a cached socket of the old one."""
from __future__ import annotations

import zmq

from monarch_kernel.core import wire
from monarch_kernel.core.runtime import ProcRef, ipc_name, runtime


def _inbox(ctx):
    s = ctx.socket(zmq.PULL)
    name = ipc_name("test")
    s.bind(name)
    return s, name


def test_a_reused_tcp_address_reaches_the_new_procs_ipc_inbox():
    rt = runtime()
    key = b"k" * 32
    ctx = zmq.Context.instance()
    old, old_ipc = _inbox(ctx)
    new, new_ipc = _inbox(ctx)
    try:
        tcp = "tcp://127.0.0.1:1"   # never bound: only the ipc names carry messages
        ref = ProcRef("old", 0, "h", 1, tcp, tcp, "a", old_ipc, old_ipc, rt.host_id)
        rt.register_procs([ref], key)
        rt.keyring.accept("test inbox", wire.dest_id(tcp))   # messages name the tcp address
        rt.send(tcp, key, ("ping", 1))
        assert old.poll(5000) and rt.keyring.open(old.recv_multipart(), "test inbox") == ("ping", 1)
        # a new proc on this host got the same tcp port, with a new ipc name
        rt.register_procs([ref._replace(key="new", work_ipc=new_ipc, ctrl_ipc=new_ipc)], key)
        rt.send(tcp, key, ("ping", 2))
        assert new.poll(5000) and rt.keyring.open(new.recv_multipart(), "test inbox") == ("ping", 2)
        assert not old.poll(200)
    finally:
        old.close(0)
        new.close(0)
        for k in ("old", "new"):
            rt.procs.pop(k, None)


def test_a_peer_on_another_host_is_reached_over_tcp():
    rt = runtime()
    ref = ProcRef("far", 0, "h", 1, "tcp://10.9.9.9:5", "tcp://10.9.9.9:6", "a", "ipc://@x", "ipc://@y",
                  "another-host")
    rt.register_procs([ref], b"k" * 32)
    try:
        assert "tcp://10.9.9.9:5" not in rt.transport.ipc_alias
    finally:
        rt.procs.pop("far", None)
