"""KubernetesJob's release after an interrupt, against the FAKE API server (tests/fake_k8s.py):
what the API server made before the client heard back is deleted too."""
from __future__ import annotations

import os
import shutil
import signal
import threading
import time

import pytest

pytest.importorskip("kubernetes", reason="the kubernetes client is an extra: pip install 'monarch-kernel[kubernetes]'")
from fake_k8s import FakeKubernetes  # noqa: E402

from monarch_kernel.job import ImageSpec, KubernetesJob  # noqa: E402


class SlowAnswers(FakeKubernetes):
    """An API server that stores each pod or Job a client creates at once but answers the
    request only ``delay`` seconds later (a busy server, a slow link). With ``interrupt``,
    the first such create sends this process SIGINT (the user's interrupt lands while the
    client waits for the answer)."""

    delay = 3.0
    interrupt = False
    #: the first pod or Job deleted by a client sends SIGINT again, and answers 0.5 s later
    interrupt_delete = False

    def _slow(self) -> None:
        if threading.current_thread().name == "fake-kubelet":   # the fake's own Job controller
            return
        if self.interrupt:
            self.interrupt = False
            os.kill(os.getpid(), signal.SIGINT)
        time.sleep(self.delay)

    def create_pod(self, ns, body):
        pod = super().create_pod(ns, body)
        self._slow()
        return pod

    def create_job(self, ns, body):
        out = super().create_job(ns, body)
        self._slow()
        return out

    def _deleting(self) -> None:
        if self.interrupt_delete and threading.current_thread().name != "fake-kubelet":
            self.interrupt_delete = False
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.5)

    def delete_pod(self, ns, name):
        out = super().delete_pod(ns, name)
        self._deleting()
        return out

    def delete_job(self, ns, name, propagation="Background"):
        out = super().delete_job(ns, name, propagation)
        self._deleting()
        return out


@pytest.fixture(scope="module")
def k8s():
    with SlowAnswers(use_netns=os.geteuid() == 0 and bool(shutil.which("ip"))) as fake:
        yield fake


@pytest.mark.parametrize("workload", ["pods", "jobs"])
def test_fake_cluster_an_interrupt_before_the_api_server_answered_a_create_leaves_nothing(k8s, workload):
    job = KubernetesJob(kubeconfig=k8s.kubeconfig, name=f"half-made-{workload}", workload=workload).add_mesh(
        "w", 2, image_spec=ImageSpec("fake/monarch:1"))
    k8s.interrupt = True
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt, match="interrupted while it started"):
        job.state()
    took = time.monotonic() - t0
    assert not k8s.interrupt, "the interrupt was not sent"
    assert not k8s.pods and not k8s.secrets and not getattr(k8s, "jobs", None), \
        (list(k8s.pods), list(k8s.secrets), list(getattr(k8s, "jobs", [])))
    assert not k8s.procs and not job.active
    assert took < 15, f"the release waited {took:.0f} s for pods it had not deleted"


def test_fake_cluster_a_second_interrupt_while_the_release_runs_does_not_cut_it_short(k8s):
    """The user presses the interrupt button twice: the second press lands while the pods
    are being deleted, and must not leave the others behind."""
    job = KubernetesJob(kubeconfig=k8s.kubeconfig, name="pressed-twice").add_mesh(
        "w", 2, image_spec=ImageSpec("fake/monarch:1"))
    k8s.delay = 0.0
    try:
        k8s.interrupt_delete = True
        lines = []

        def progress(line):   # the first press once the pods exist and wait
            lines.append(line)
            if "agents up" in line and len(lines) == 2:
                os.kill(os.getpid(), signal.SIGINT)

        with pytest.raises(KeyboardInterrupt, match="interrupted while it started"):
            job.state(progress=progress)
        assert not k8s.interrupt_delete, f"the second interrupt was not sent: {lines}"
    finally:
        k8s.delay = SlowAnswers.delay
    assert not k8s.pods and not k8s.secrets and not getattr(k8s, "jobs", None), \
        (list(k8s.pods), list(k8s.secrets), list(getattr(k8s, "jobs", [])))
    assert not k8s.procs and not job.active
