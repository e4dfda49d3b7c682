"""KubernetesJob through the official client against a FAKE API server (tests/fake_k8s.py:
no real one installs here) whose kubelet runs each pod's command as a local process in its
own network namespace. What the job creates is validated against the client's models."""
from __future__ import annotations

import base64
import json
import os
import sys
import time

import cloudpickle
import pytest

pytest.importorskip("kubernetes", reason="the kubernetes client is an extra: pip install 'monarch-kernel[kubernetes]'")
from fake_k8s import FakeKubernetes  # noqa: E402
from kubernetes import client  # noqa: E402

from monarch_kernel.actor import Actor, endpoint  # noqa: E402
from monarch_kernel.job import ImageSpec, JobError, JobGoneError, KubernetesJob  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def k8s():
    with FakeKubernetes(use_netns=os.geteuid() == 0 and bool(__import__("shutil").which("ip"))) as fake:
        yield fake


class Host(Actor):
    def __init__(self):
        self.calls = 0

    @endpoint
    def where(self) -> tuple:
        """(the pod's name, calls so far). A pod's hostname is its name; without root the fake's
        pods share this machine's hostname and have the name in HOSTNAME, as a real pod does."""
        import socket

        self.calls += 1
        return os.environ.get("HOSTNAME") or socket.gethostname(), self.calls


def _model(obj: dict, kind: str):
    """Deserialize as the client would: a missing required field or a wrong type raises."""
    return client.ApiClient().deserialize(json.dumps(obj), kind, "application/json")


def test_fake_cluster_pods_run_the_agents_with_the_key_only_in_a_secret_and_reattach(k8s):
    job = KubernetesJob(kubeconfig=k8s.kubeconfig).add_mesh("workers", 2, image_spec=ImageSpec("fake/monarch:1"))
    lines = []
    try:
        state = job.state(progress=lines.append)
        assert any("pods: Running 2; agents up 2/2" in line for line in lines), lines
        hosts = state.workers.spawn_procs(per_host={"gpus": 1}).spawn("hosts", Host)
        names = hosts.where.call().get(timeout=60).values()
        pods = [p for p in k8s.created if p.get("kind") == "Pod"]
        assert [n for n, _ in names] == [p["metadata"]["name"] for p in pods]
        key = job._key.hex()
        for pod in pods:
            model = _model(pod, "V1Pod")
            assert model.metadata.labels["app.kubernetes.io/name"] == "monarch-worker"
            assert model.metadata.labels["monarch.pytorch.org/mesh-name"] == "workers"
            c = model.spec.containers[0]
            assert c.command[:3] == ["python", "-m", "workers.agent"]   # the image's python
            env = {e.name: e for e in c.env}
            assert env["MONARCH_KERNEL_KEY"].value_from.secret_key_ref.key == "key"
            assert key not in json.dumps(pod)
        secret = _model(next(o for o in k8s.created if o.get("kind") == "Secret"), "V1Secret")
        assert base64.b64decode(secret.data["key"]).decode() == key
        # the default: one core/v1 pod per host, made by us, not by a controller
        assert not [o for o in k8s.created if o.get("kind") == "Job"] and not k8s.jobs
        assert [_model(p, "V1Pod").spec.restart_policy for p in pods] == ["OnFailure", "OnFailure"]
        job.disconnect()
        again = KubernetesJob(kubeconfig=k8s.kubeconfig).add_mesh("workers", 2,
                                                                 image_spec=ImageSpec("fake/monarch:1"))
        actors = again.state().workers.proc_mesh("procs").actor_mesh("hosts")
        assert [c for _, c in actors.where.call().get(timeout=20).values()] == [2, 2]
        again.disconnect()
        k8s.delete_pod("default", pods[1]["metadata"]["name"])
        with pytest.raises(JobGoneError, match=f"pod {pods[1]['metadata']['name']} was deleted"):
            job.state()
    finally:
        job.kill()
    assert not k8s.pods and not k8s.secrets and not k8s.jobs


@pytest.mark.parametrize("image, reason, log", [("fake/python-only:1", "CrashLoopBackOff", "No module named"),
                                               ("registry.invalid/nope:1", "Image", "")])
def test_fake_cluster_a_pod_that_cannot_start_is_named_with_its_last_log_lines(k8s, image, reason, log):
    job = KubernetesJob(kubeconfig=k8s.kubeconfig, name=f"bad-{reason.lower()}").add_mesh(
        "w", 1, image_spec=ImageSpec(image))
    watches = k8s.watches
    with pytest.raises(JobError, match=rf"pod mk-bad-{reason.lower()}-\w+-w-0(?:-\w+)? cannot start: \w*{reason}") as e:
        job.state()
    assert log in str(e.value) and "last log lines" in str(e.value)
    if reason != "CrashLoopBackOff":   # (a container can crash twice before the first list, under load)
        assert k8s.watches > watches   # the pending pod was watched, not polled
    assert not k8s.pods and not k8s.secrets and not k8s.jobs   # nothing left behind


def test_fake_cluster_attach_only_finds_running_pods_by_monarch_labels_in_pod_index_order(k8s):
    api = KubernetesJob(kubeconfig=k8s.kubeconfig)._api()
    key = os.urandom(32).hex()
    api.create_namespaced_secret("default", client.V1Secret(
        metadata=client.V1ObjectMeta(name="monarch-worker-key"), data={"key": base64.b64encode(key.encode()).decode()}))
    for index in (1, 0):   # created out of order: rank comes from the pod-index label
        # pod 1's agent binds every interface and must still advertise an address we can reach
        bind = ["--bind", "0.0.0.0"] if index else ["--bind", "$(POD_IP)"]
        port = 26601 if index else 26600   # pod 1's agent listens elsewhere and says so in MONARCH_PORT
        api.create_namespaced_pod("default", client.V1Pod(
            metadata=client.V1ObjectMeta(name=f"trainer-{index}", labels={
                "app.kubernetes.io/name": "monarch-worker", "monarch.pytorch.org/mesh-name": "trainer",
                "apps.kubernetes.io/pod-index": str(index)}),
            spec=client.V1PodSpec(containers=[client.V1Container(
                name="worker", image="fake/monarch:1",
                command=["python", "-m", "workers.agent", *bind, "--port", str(port), "--persistent"],
                env=[*([client.V1EnvVar(name="MONARCH_PORT", value=str(port))] if index else
                       [client.V1EnvVar(name="POD_IP", value_from=client.V1EnvVarSource(
                           field_ref=client.V1ObjectFieldSelector(field_path="status.podIP")))]),
                     client.V1EnvVar(name="MONARCH_KERNEL_KEY", value_from=client.V1EnvVarSource(
                         secret_key_ref=client.V1SecretKeySelector(name="monarch-worker-key", key="key")))])])))
    job = KubernetesJob(kubeconfig=k8s.kubeconfig).add_mesh(
        "trainer", 2, label_selector="monarch.pytorch.org/mesh-name=trainer")
    try:
        hosts = job.state().trainer.spawn_procs(per_host={"gpus": 1}).spawn("hosts", Host)
        assert [n for n, _ in hosts.where.call().get(timeout=60).values()] == ["trainer-0", "trainer-1"]
        assert [a["addr"].rsplit(":", 1)[1] for a in job._agents] == ["26600", "26601"]
    finally:
        job.kill()
        assert set(k8s.pods) == {("default", "trainer-0"), ("default", "trainer-1")}   # not ours to delete
        for index in (0, 1):
            api.delete_namespaced_pod(f"trainer-{index}", "default")
        api.delete_namespaced_secret("monarch-worker-key", "default")


def test_fake_cluster_with_workload_jobs_the_lease_leaves_no_pod_job_or_secret(k8s):
    """``workload="jobs"``, no notebook attached for the lease: the agents end cleanly, their
    pods succeed and are not restarted with fresh, empty agents; Kubernetes then deletes the
    finished Jobs (ttlSecondsAfterFinished: 0), their pods and the Secret they own, with no
    kill() or %mesh stop, and no API rights for the agents. state() says what happened."""
    job = KubernetesJob(kubeconfig=k8s.kubeconfig, name="leased", lease=2.0, workload="jobs").add_mesh(
        "w", 2, image_spec=ImageSpec("fake/monarch:1"))
    try:
        job.state().w.spawn_procs(per_host={"gpus": 1})
        assert len(k8s.pods) == 2 and len(k8s.jobs) == 2 and len(k8s.secrets) == 1
        jobs = [_model(j, "V1Job") for j in k8s.created if j.get("kind") == "Job"]
        assert [j.spec.ttl_seconds_after_finished for j in jobs] == [0, 0]
        assert [j.spec.template.spec.restart_policy for j in jobs] == ["OnFailure", "OnFailure"]
        secret = next(iter(k8s.secrets.values()))   # it goes with the last of the Jobs
        assert sorted(r.name for r in _model(secret, "V1Secret").metadata.owner_references) == \
            sorted(j.metadata.name for j in jobs)
        phases = set()
        job.disconnect()
        deadline = time.monotonic() + 30
        while (k8s.pods or k8s.jobs or k8s.secrets) and time.monotonic() < deadline:
            phases |= {p["status"]["phase"] for p in list(k8s.pods.values())}
            time.sleep(0.02)
        assert not k8s.pods and not k8s.jobs and not k8s.secrets, "left after the lease"
        assert "Failed" not in phases, phases
        assert not k8s.procs, "an agent's container was restarted after its lease"
        with pytest.raises(JobGoneError, match="ended at their lease"):
            job.state()
    finally:
        job.kill()
    assert not k8s.pods and not k8s.secrets and not k8s.jobs


def test_fake_cluster_pods_no_node_can_take_are_deleted_at_job_start_timeout_and_on_interrupt(k8s):
    import signal
    import threading

    big = ImageSpec("fake/monarch:1", resources={"nvidia.com/gpu": 9})   # the fake node has 8
    job = KubernetesJob(kubeconfig=k8s.kubeconfig, name="too-big", job_start_timeout=1.0).add_mesh(
        "w", 1, image_spec=big)
    lines = []
    with pytest.raises(JobError, match=r"not every agent was up after 1 s \(pods: Pending \(Unschedulable\) 1; "
                                       r"agents up 0/1; pod mk-too-big-\w+-w-0(?:-\w+)?: Unschedulable: 0/1 nodes are "
                                       r"available: 1 Insufficient nvidia.com/gpu\.\); its pods were deleted"):
        job.state(progress=lines.append)
    assert "pods: Pending (Unschedulable) 1; agents up 0/1" in lines, lines
    assert not k8s.pods and not k8s.secrets and not k8s.jobs
    # The interrupt button while the pods wait: the same clean-up, nothing left.
    job = KubernetesJob(kubeconfig=k8s.kubeconfig, name="interrupted", job_start_timeout=None).add_mesh(
        "w", 1, image_spec=big)
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            job.state()
    finally:
        timer.cancel()
    assert not k8s.pods and not k8s.secrets and not k8s.jobs and not job.active


def test_fake_cluster_pods_from_a_pod_template_keep_its_labels_and_env_and_get_the_agent(k8s):
    tmpl = client.V1PodTemplateSpec(
        metadata=client.V1ObjectMeta(labels={"team": "ml"}),
        spec=client.V1PodSpec(containers=[client.V1Container(
            name="worker", image="fake/monarch:1", env=[client.V1EnvVar(name="TEAM", value="vision")])]))
    job = KubernetesJob(kubeconfig=k8s.kubeconfig, name="templated").add_mesh("w", 2, pod_template=tmpl)
    try:
        procs = job.state().w.spawn_procs(per_host={"gpus": 1})
        assert procs.spawn("env", Env).team.call().get(timeout=60).values() == ["vision", "vision"]
        for pod in [p for p in k8s.created if p.get("kind") == "Pod" and "templated" in p["metadata"]["name"]]:
            model = _model(pod, "V1Pod")
            assert model.metadata.labels["team"] == "ml"
            assert model.metadata.labels["monarch.pytorch.org/mesh-name"] == "w"
            assert model.spec.restart_policy == "OnFailure"
            env = {e.name: e for e in model.spec.containers[0].env}
            assert env["MONARCH_KERNEL_KEY"].value_from.secret_key_ref is not None and env["TEAM"].value == "vision"
            assert job._key.hex() not in json.dumps(pod)
    finally:
        job.kill()
    assert not k8s.pods and not k8s.secrets and not k8s.jobs


class Env(Actor):
    @endpoint
    def team(self) -> str:
        return os.environ.get("TEAM", "")


@pytest.mark.parametrize("refusal", ["forbidden", "unserved"])
def test_fake_cluster_workload_jobs_without_rights_or_api_falls_back_to_bare_pods_and_says_what_stays(
        k8s, caplog, refusal):
    """``workload="jobs"`` where RBAC refuses batch Jobs (403), or the API server serves no
    batch group (404): bare pods, a warning naming what stays after the lease (their
    Succeeded pods and the Secret, until kill() or %mesh stop) and the rights to grant."""
    if refusal == "forbidden":
        k8s.forbidden.add("jobs")
    else:
        k8s.unserved.add("batch")
    job = KubernetesJob(kubeconfig=k8s.kubeconfig, name="no-jobs", lease=2.0, workload="jobs").add_mesh(
        "w", 1, image_spec=ImageSpec("fake/monarch:1"))
    lines = []
    try:
        with caplog.at_level("WARNING", logger="monarch_kernel.job"):
            job.state(progress=lines.append).w.spawn_procs(per_host={"gpus": 1})
        assert "no rights on batch Jobs; creating bare pods" in " ".join(lines), lines
        assert "stay until kill() or %mesh stop (grant create, list, delete on jobs.batch" in caplog.text
        assert not k8s.jobs and [n for _, n in k8s.pods] == [job._agents[0]["host"]]
    finally:
        k8s.forbidden.discard("jobs")
        k8s.unserved.discard("batch")
        job.kill()
    assert not k8s.pods and not k8s.secrets and not k8s.jobs


def test_fake_cluster_default_pods_after_the_lease_succeed_and_are_not_restarted(k8s):
    """The default (one core/v1 pod per host): after the lease the agents end, their pods are
    Succeeded (holding nothing) and not restarted; the objects and the Secret stay until
    kill(), which deletes them; state() says the agents ended."""
    job = KubernetesJob(kubeconfig=k8s.kubeconfig, name="leased-pods", lease=2.0).add_mesh(
        "w", 1, image_spec=ImageSpec("fake/monarch:1"))
    try:
        job.state().w.spawn_procs(per_host={"gpus": 1})
        assert not k8s.jobs and len(k8s.pods) == 1
        job.disconnect()
        deadline = time.monotonic() + 30
        while any(p["status"]["phase"] != "Succeeded" for p in k8s.pods.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [p["status"]["phase"] for p in k8s.pods.values()] == ["Succeeded"]   # not restarted
        assert not k8s.procs, "an agent's container was restarted after its lease"
        with pytest.raises(JobGoneError, match="is Succeeded: its agent ended"):
            job.state()
    finally:
        job.kill()
    assert not k8s.pods and not k8s.secrets and not k8s.jobs


def test_fake_cluster_an_unknown_workload_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="use 'pods' .* or 'jobs'"):
        KubernetesJob(workload="deployment")


def test_fake_cluster_a_pod_deleted_or_cut_off_mid_run_fails_its_ranks_the_other_keeps_its_state(k8s):
    """Issue 12's faults: a node lost mid-run (its link down) fails its ranks and the others
    keep their state; pods deleted from outside are reported on the next interaction, no
    hang."""
    from monarch_kernel.actor import SupervisionError

    job = KubernetesJob(kubeconfig=k8s.kubeconfig, name="lost-pods").add_mesh(
        "w", 2, image_spec=ImageSpec("fake/monarch:1"))
    try:
        hosts = job.state().w.spawn_procs(per_host={"gpus": 1}).spawn("hosts", Host)
        pods = [n for n, _ in hosts.where.call().get(timeout=60).values()]
        if k8s.net is not None:   # pod 1's link down: its ranks fail, pod 0's keep their state
            k8s.net.link(pods[1], up=False)
            try:
                with pytest.raises(SupervisionError, match="host lost"):
                    hosts.slice(hosts=1).where.call().get(timeout=30)
                assert hosts.slice(hosts=0).where.call().get(timeout=10).values() == [(pods[0], 2)]
            finally:
                k8s.net.link(pods[1], up=True)
        job.disconnect()
        hosts = job.state().w.proc_mesh("procs").actor_mesh("hosts")
        k8s.delete_pod("default", pods[1])   # from outside (kubectl delete pod): its agent and procs end
        with pytest.raises(SupervisionError):
            hosts.where.call().get(timeout=30)
        with pytest.raises(JobGoneError, match=f"pod {pods[1]} was deleted"):
            job.state()
    finally:
        job.kill()
    assert not k8s.pods and not k8s.secrets and not k8s.jobs and not k8s.procs
