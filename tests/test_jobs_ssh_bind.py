"""Where the controller listens for a job's hosts (issue 12, "Addresses"): on the local
address that routes to them, found automatically on a machine with several interfaces, or
the one ``MONARCH_KERNEL_BIND`` names. Through a real kernel (jupyter_client) and real
ssh hosts, each in its own network namespace on a bridge (tests/ssh_hosts.py). Skipped
with the reason without root/sshd."""
from __future__ import annotations

import ipaddress
import re
import secrets
import time

import psutil
import pytest
from kernel_harness import KernelHarness, home_processes
from netns_hosts import ip_cmd
from ssh_hosts import hosts_fixture


@pytest.fixture(scope="module")
def hosts():
    yield from hosts_fixture()


@pytest.fixture(scope="module")
def second_address(hosts):
    """A second address of this machine on the hosts' bridge (a login node's alias): the
    hosts reach it, but the route to them goes out from the bridge's first address."""
    net = hosts.net
    ip = net.bridge_ip.rsplit(".", 1)[0] + ".2"
    ip_cmd("addr", "add", f"{ip}/24", "dev", net.bridge)
    yield ip
    ip_cmd("addr", "del", f"{ip}/24", "dev", net.bridge, check=False)


@pytest.fixture
def other_interface():
    """Another interface of this machine (a bridge with no port), on a network that does
    not lead to the hosts."""
    name = f"mkd{secrets.token_hex(3)}"
    ip = f"10.214.{secrets.randbelow(250) + 1}.1"
    ip_cmd("link", "add", name, "type", "bridge")
    try:
        ip_cmd("addr", "add", f"{ip}/24", "dev", name)
        ip_cmd("link", "set", name, "up")
        yield ip
    finally:
        ip_cmd("link", "del", name, check=False)


def _connect(k: KernelHarness, hosts, timeout: float = 120):
    ssh_args = f"-F {hosts.config} -o SetEnv=MONARCH_KERNEL_HOME={k.home}"
    return k.run(f'%mesh connect far --ssh h1,h2 --ssh-args "{ssh_args}" --per-host gpus=1', timeout=timeout)


def _listening(pid: int) -> set[str]:
    """The addresses a process accepts tcp connections on, loopback left out."""
    out = set()
    for c in psutil.Process(pid).net_connections(kind="inet"):
        if c.status == psutil.CONN_LISTEN and not ipaddress.ip_address(c.laddr.ip).is_loopback:
            out.add(c.laddr.ip)
    return out


def _procs_answer(k: KernelHarness) -> None:
    out = k.ok("%%on_mesh\nimport socket\nf'{socket.gethostname()} rank {rank}'", timeout=60)
    shown = out.stdout + out.result
    assert "h1 rank 0" in shown and "h2 rank 1" in shown, shown


def _stop(k: KernelHarness, kernel_pid: int) -> None:
    assert "stopped" in k.ok("%mesh stop far", timeout=60).stdout
    deadline = time.monotonic() + 10
    while home_processes(k.home) - {kernel_pid} and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not home_processes(k.home) - {kernel_pid}, "agents or procs left on the hosts"


def test_bind_names_the_controllers_address_for_the_job_and_it_listens_there_alone(hosts, second_address):
    k = KernelHarness(env={"MONARCH_KERNEL_BIND": second_address})
    try:
        r = _connect(k, hosts)
        assert r.status == "ok", r.error or r.stderr
        assert re.search(r"mesh 'far': 2 procs \(hosts=2, gpus=1\) on ssh job ssh-\w+ started", r.stdout), r.stdout
        kernel = k.value("__import__('os').getpid()")
        _procs_answer(k)
        # the job listener is on the address the variable names, not on the one the route
        # to the hosts would have picked (the bridge's first), nor on any other interface
        assert _listening(kernel) == {second_address}, _listening(kernel)
        _stop(k, kernel)
    finally:
        k.close(stop_meshes=("far",))


def test_without_bind_the_controller_listens_on_the_one_interface_that_routes_to_the_hosts(hosts, other_interface):
    k = KernelHarness()
    try:
        r = _connect(k, hosts)
        assert r.status == "ok", r.error or r.stderr
        kernel = k.value("__import__('os').getpid()")
        _procs_answer(k)
        assert _listening(kernel) == {hosts.net.bridge_ip}, (_listening(kernel), other_interface)
        _stop(k, kernel)
    finally:
        k.close(stop_meshes=("far",))


@pytest.mark.parametrize("when", [
    "kernel start",
    "cell"])
def test_a_bind_address_this_machine_does_not_have_is_a_clear_error_at_once(hosts, when):
    """The variable set in the kernel's environment, or in a cell before the connect (as the
    README shows): either way an error that names it and says what to do, not a hang or a
    bare zmq error; nothing is started on the hosts, and unsetting it is enough."""
    absent = hosts.net.bridge_ip.rsplit(".", 1)[0] + ".250"   # on the hosts' network, but no one's
    k = KernelHarness(env={"MONARCH_KERNEL_BIND": absent} if when == "kernel start" else None)
    try:
        kernel = k.value("__import__('os').getpid()")
        if when == "cell":
            k.ok("%mesh connect local --procs 1", timeout=120)   # the runtime is up, on loopback
            k.ok(f"import os; os.environ['MONARCH_KERNEL_BIND'] = {absent!r}")
        before = home_processes(k.home)
        t0 = time.monotonic()
        r = _connect(k, hosts, timeout=60)
        took = time.monotonic() - t0
        said = r.reply["content"].get("evalue", "") + "\n".join(r.error.get("traceback", [])) + r.stderr
        assert r.status == "error", r.stdout
        assert f"MONARCH_KERNEL_BIND={absent}" in said and "not an address of this machine" in said, said
        assert hosts.net.bridge_ip in said, said   # what to set it to: the address that routes to the hosts
        assert took < 20, took
        assert not home_processes(k.home) - before, "something was started on the hosts"
        k.ok("import os; os.environ.pop('MONARCH_KERNEL_BIND', None)")
        if when == "kernel start":
            r = _connect(k, hosts)
            assert r.status == "ok", r.error or r.stderr
            _procs_answer(k)
            _stop(k, kernel)
    finally:
        k.close(stop_meshes=("far", "local"))
