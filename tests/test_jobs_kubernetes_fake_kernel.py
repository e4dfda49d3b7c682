"""``%mesh connect --k8s`` interrupted through a REAL kernel (jupyter_client) against the
FAKE API server (tests/fake_k8s.py): the interrupt button while the pods wait must cancel
the request cleanly (issue 12: "the interrupt button cancels the request cleanly (nothing
left queued)"), as tests/test_jobs_notebook.py checks for Slurm."""
from __future__ import annotations

import os
import shutil
import signal
import threading
import time

import pytest

pytest.importorskip("kubernetes", reason="the kubernetes client is an extra: pip install 'monarch-kernel[kubernetes]'")
from fake_k8s import FakeKubernetes  # noqa: E402
from kernel_harness import KernelHarness, home_processes  # noqa: E402

INDEX_LABEL = "apps.kubernetes.io/pod-index"


class SlowPullKubernetes(FakeKubernetes):
    """The fake whose "kubelet" never finishes pulling the image of the pods whose
    pod-index is in ``hold``: they stay Pending (ContainerCreating), the others run."""

    hold: set[str] = {"1"}

    def _step(self, key, pod) -> None:
        if (pod["metadata"].get("labels") or {}).get(INDEX_LABEL) in self.hold:
            return
        super()._step(key, pod)


@pytest.fixture(scope="module")
def k8s():
    with SlowPullKubernetes(use_netns=os.geteuid() == 0 and bool(shutil.which("ip"))) as fake:
        yield fake


def _texts(r) -> str:
    return "\n".join(m["content"]["data"]["text/plain"] for m in r.outputs
                     if m["msg_type"] in ("display_data", "update_display_data"))


@pytest.mark.timeout(240)
def test_fake_cluster_interrupting_a_connect_cell_whose_pods_wait_deletes_everything_and_the_kernel_goes_on(k8s):
    session_home = os.environ["MONARCH_KERNEL_HOME"]   # the fake's pods run under it (their agents)
    before = home_processes(session_home)
    k = KernelHarness(env={"KUBECONFIG": k8s.kubeconfig})
    try:
        interrupted = []

        def watch(msg):
            text = msg["content"].get("data", {}).get("text/plain", "")
            # pod 0's agent is up, pod 1 still pulls its image: the interrupt button now
            if "agents up 1/2" in text and not interrupted:
                interrupted.append(text)
                k.km.interrupt_kernel()

        msg_id = k.submit("%mesh connect waiting --k8s default --image fake/monarch:1 --replicas 2")
        r = k.wait(msg_id, timeout=120, on_output=watch)
        shown = _texts(r)
        # the progress line said what the API server says about the pods, while they waited
        assert "pods: ContainerCreating 1, Running 1; agents up 1/2" in shown, shown
        assert interrupted, f"the cell never showed pod 0's agent up: {shown!r}"
        assert r.status == "error" and r.reply["content"]["ename"] == "KeyboardInterrupt", r.reply["content"]
        # a clear message, not only a traceback from inside the kubernetes client
        said = r.reply["content"]["evalue"] + "\n".join(r.error.get("traceback", [])) + r.stderr + r.stdout
        assert "interrupted" in said and "deleted" in said, said
        # nothing left: no pod, no Secret, no agent (pod 0's ran)
        assert not k8s.pods and not k8s.secrets and not getattr(k8s, "jobs", None), \
            (list(k8s.pods), list(k8s.secrets), list(getattr(k8s, "jobs", [])))
        assert not k8s.procs
        deadline = time.monotonic() + 10
        while home_processes(session_home) - before and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not home_processes(session_home) - before, "an agent of the interrupted job is still running"
        assert not os.path.exists(os.path.join(k.home, "meshes", "waiting.json")), "the job was cached"
        # the kernel is usable: a local mesh connects and runs a cell
        k.ok("%mesh connect after --procs 1", timeout=120)
        assert "2" in k.ok("%%on_mesh\n1 + 1").stdout + k.ok("%%on_mesh\n1 + 1").result
        k.ok("%mesh stop after", timeout=60)
    finally:
        k.close(stop_meshes=("after", "waiting"))
    assert not k8s.pods and not k8s.secrets


class SlowDeletes(FakeKubernetes):
    """The fake whose first pod DELETE from a client calls ``on_delete`` (the test presses
    the kernel's interrupt button there, twice) and answers 1.5 s late."""

    on_delete = None

    def delete_pod(self, ns, name):
        out = super().delete_pod(ns, name)
        if self.on_delete is not None and threading.current_thread().name != "fake-kubelet":
            hook, self.on_delete = self.on_delete, None
            hook()
            time.sleep(1.5)
        return out


@pytest.fixture(scope="module")
def k8s_slow_delete():
    with SlowDeletes(use_netns=os.geteuid() == 0 and bool(shutil.which("ip"))) as fake:
        yield fake


@pytest.mark.timeout(240)
def test_fake_cluster_pressing_interrupt_twice_while_mesh_stop_deletes_the_pods_leaves_nothing(k8s_slow_delete):
    k8s = k8s_slow_delete
    k = KernelHarness(env={"KUBECONFIG": k8s.kubeconfig})
    kernel_pid = k.km.provisioner.process.pid
    try:
        k.ok("%mesh connect pressed --k8s default --image fake/monarch:1 --replicas 2 --procs 1", timeout=120)
        k.ok("%%on_mesh\nx = rank")
        assert len(k8s.pods) == 2 and k8s.secrets
        pressed = []

        def press_twice():   # as jupyter_client's interrupt does: SIGINT to the kernel's process group
            for _ in range(2):
                os.killpg(os.getpgid(kernel_pid), signal.SIGINT)
                pressed.append(time.monotonic())
                time.sleep(0.4)

        k8s.on_delete = press_twice
        r = k.run("%mesh stop pressed", timeout=120)
        assert len(pressed) == 2, "the release never deleted a pod"
        assert r.status == "ok", f"%mesh stop was cut short: {r.error or r.stderr}"
        assert "mesh 'pressed' stopped" in r.stdout, r.stdout
        assert "the interrupt was held off until the job was released; nothing of it is left" in r.stderr, r.stderr
        assert not k8s.pods and not k8s.secrets and not k8s.jobs, (list(k8s.pods), list(k8s.secrets))
        assert not k8s.procs
        deadline = time.monotonic() + 10
        while home_processes(k.home) - {kernel_pid} and time.monotonic() < deadline:
            time.sleep(0.1)
        assert home_processes(k.home) - {kernel_pid} == set(), "an agent or proc of the job is left"
        assert not os.path.exists(os.path.join(k.home, "meshes", "pressed.json")), "the job is still cached"
        assert k.ok("1 + 1").result == "2"   # the kernel goes on
    finally:
        k8s.on_delete = None
        k.close(stop_meshes=("pressed",))
    assert not k8s.pods and not k8s.secrets
