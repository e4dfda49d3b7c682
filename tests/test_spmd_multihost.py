"""A process group across two hosts (two host agents in two network namespaces): rank 0's
address is the one the other host reaches (not the hostname, which both namespaces share),
gloo talks on the mesh's own interface, and torchrun's per-host variables are right.

Needs root and iproute2 (CI has both); skipped with the reason otherwise.
"""
from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time

from test_multihost import A_IP, B_IP, ROOT, _read_json, _start_agent, two_hosts  # noqa: F401


def test_process_group_across_two_hosts_uses_reachable_addresses(two_hosts, tmp_path):  # noqa: F811
    key_file = tmp_path / "key"
    key_file.write_text(secrets.token_hex(32))
    key_file.chmod(0o600)
    agents, ctl = [], None
    try:
        agents.append(_start_agent(two_hosts["a"], A_IP, str(key_file)))
        agents.append(_start_agent(two_hosts["b"], B_IP, str(key_file)))
        env = dict(os.environ, PYTHONPATH=str(ROOT), MONARCH_KERNEL_BIND=A_IP)
        ctl = subprocess.Popen(["ip", "netns", "exec", two_hosts["a"], sys.executable,
                                str(ROOT / "tests/scripts/spmd_multihost_controller.py"),
                                ",".join(addr for _, addr in agents), key_file.read_text()],
                               stdout=subprocess.PIPE, text=True, env=env, cwd=str(ROOT))
        seen = _read_json(ctl, timeout=120)
        envs = seen["envs"]
        assert [e["RANK"] for e in envs] == ["0", "1", "2", "3"]
        assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "0", "1"]
        assert [e["GROUP_RANK"] for e in envs] == ["0", "0", "1", "1"]
        assert {e["LOCAL_WORLD_SIZE"] for e in envs} == {"2"} and {e["GROUP_WORLD_SIZE"] for e in envs} == {"2"}
        assert {e["MASTER_ADDR"] for e in envs} == {A_IP}
        assert [e["GLOO_SOCKET_IFNAME"] for e in envs] == [two_hosts["va"]] * 2 + [two_hosts["vb"]] * 2
        assert all(e["sum"] == [10.0] * 4 for e in envs)      # 1 + 2 + 3 + 4 across the link
        assert seen["matmul_equal"] and seen["placements"] == ["Shard(dim=0)", "Shard(dim=1)"]
        assert ctl.wait(30) == 0
    finally:
        if ctl is not None and ctl.poll() is None:
            ctl.kill()
            ctl.wait()
        for p, _ in agents:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
            p.wait()
        time.sleep(0.3)
