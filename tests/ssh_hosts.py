"""Real sshd on hosts that are really different: one network namespace (own address and
hostname) per host, key-based login only, with an ssh client config naming them.

    with SSHHosts(["h1", "h2"]) as hosts:
        SSHJob(hosts=["h1", "h2"], ssh_args=["-F", hosts.config])

``hosts.config`` also names ``nowhere``, an address on the bridge where nothing listens.
Needs root, iproute2 and openssh-server (scripts/setup.sh installs it): ``unavailable()``
says what is missing.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time

from netns_hosts import BridgedHosts

SSHD = "/usr/sbin/sshd"


def unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces, sshd)"
    missing = [t for t in ("ip", "nsenter", "unshare", "ssh", "ssh-keygen") if not shutil.which(t)]
    if not os.path.exists(SSHD):
        missing.append(SSHD)
    if missing:
        return f"missing {', '.join(missing)} (scripts/setup.sh installs openssh-server)"
    return None


class SSHHosts:
    def __init__(self, names: list[str]):
        self.names = names
        self.net = BridgedHosts(names)
        self.dir = tempfile.mkdtemp(prefix="mk-sshd-")
        self.config = os.path.join(self.dir, "ssh_config")
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> SSHHosts:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc):
        self.stop()

    def start(self) -> None:
        d = self.dir
        self.net.open()
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)   # sshd's privilege separation dir
        for k in ("host_key", "client_key"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", f"{d}/{k}"], check=True)
        shutil.copy(f"{d}/client_key.pub", f"{d}/authorized_keys")
        denv = {k: v for k, v in os.environ.items() if not k.startswith("MONARCH_")}
        for name in self.names:
            conf = f"{d}/sshd_{name}"
            with open(conf, "w") as f:
                f.write(f"Port 22\nListenAddress {self.net.ip[name]}\nHostKey {d}/host_key\n"
                        f"PidFile {d}/sshd_{name}.pid\nAuthorizedKeysFile {d}/authorized_keys\n"
                        "PermitRootLogin prohibit-password\nPasswordAuthentication no\n"
                        "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
                        "AcceptEnv MONARCH_KERNEL_HOME\n")
            self.procs.append(subprocess.Popen(self.net.enter(name, [SSHD, "-D", "-e", "-f", conf]), env=denv,
                                               stdout=subprocess.DEVNULL, stderr=open(f"{d}/sshd_{name}.err", "wb")))
        nowhere = self.net.bridge_ip.rsplit(".", 1)[0] + ".99"
        with open(self.config, "w") as f:
            for name, ip in [*self.net.ip.items(), ("nowhere", nowhere)]:
                f.write(f"Host {name}\n  HostName {ip}\n  User root\n  IdentityFile {d}/client_key\n"
                        "  IdentitiesOnly yes\n  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n"
                        "  LogLevel ERROR\n")
        deadline = time.monotonic() + 10
        for name in self.names:
            while True:
                try:
                    socket.create_connection((self.net.ip[name], 22), timeout=0.5).close()
                    break
                except OSError:
                    if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                        raise RuntimeError(f"sshd on {name} did not start; see {d}") from None
                    time.sleep(0.05)

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs.clear()
        self.net.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def hosts_fixture(names=("h1", "h2")):
    """Body of a module-scoped pytest fixture."""
    import pytest

    why = unavailable()
    if why:
        pytest.skip(f"no sshd test hosts: {why}")
    try:
        h = SSHHosts(list(names)).__enter__()
    except (RuntimeError, subprocess.CalledProcessError) as e:
        pytest.skip(f"cannot start sshd test hosts here: {getattr(e, 'stderr', '') or e}")
    try:
        yield h
    finally:
        h.stop()
