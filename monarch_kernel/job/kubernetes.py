"""``KubernetesJob``: host agents in pods, through the official ``kubernetes`` client
(``pip install 'monarch-kernel[kubernetes]'``).

    job = KubernetesJob(namespace="ml")
    job.add_mesh("trainers", 2, image_spec=ImageSpec("ghcr.io/me/train:1", {"nvidia.com/gpu": 8}))
    job.add_mesh("workers", 4, label_selector="app=my-statefulset")   # attach-only
    procs = job.state().trainers.spawn_procs(per_host={"gpus": 8})

Provisioning mode creates one core/v1 pod per host (labelled with the job and the mesh,
Monarch's labels) running ``python -m workers.agent`` with the image's own ``python``; the
mesh key reaches it through a Secret referenced by ``secretKeyRef``, never a literal in the
pod spec. After the lease the agents end and their pods show ``Succeeded`` (holding no
node resources); the pod objects and the Secret stay until ``kill()`` or ``%mesh stop``,
since a bare pod may not delete itself without API rights. With ``workload="jobs"`` each
host is instead a batch/v1 Job of one pod with ``ttlSecondsAfterFinished: 0`` that owns
the Secret (``ownerReferences``): after the lease Kubernetes deletes the finished Jobs, and
its garbage collector their pods and the Secret, so nothing is left and the agents need no
API rights (where RBAC refuses Jobs, or the API serves none, it falls back to bare pods
with a warning). ``kill()`` deletes everything at once. "Ready" is not "agent up": container
states are watched while waiting for the agent's port, and a pod that cannot start (CrashLoopBackOff, ErrImagePull, ...)
fails the job with its name and last log lines. Pod changes arrive through a watch from
the listed resourceVersion (no polling of the API server while pods are pending).

Attach-only mode (``label_selector``) attaches to pods something else runs, with
Monarch's conventions: rank from the ``apps.kubernetes.io/pod-index`` label, the agent on
port 26600 (``MONARCH_PORT`` in the container's env overrides), its key in the Secret
``monarch-worker-key`` (data ``key``, hex). Such a job cannot mix with provisioned meshes
(one key per job), and ``kill()`` deletes nothing it did not create.
"""
from __future__ import annotations

import base64
import hashlib
import os
import re
import socket
import time
from dataclasses import dataclass

from .base import JobError, JobGoneError, JobTrait, Progress, log

AGENT_PORT = 26600
APP_LABEL, APP = "app.kubernetes.io/name", "monarch-worker"
MESH_LABEL = "monarch.pytorch.org/mesh-name"
INDEX_LABEL = "apps.kubernetes.io/pod-index"
JOB_LABEL = "monarch-kernel.pytorch.org/job"
KEY_SECRET = "monarch-worker-key"
#: An agent that crashes is restarted (CrashLoopBackOff then names the pod), but one that
#: ends cleanly at its lease is not: its pod becomes Succeeded and holds no resources.
#: ("Always" would start a fresh, empty agent forever, keeping the GPUs.)
RESTART = "OnFailure"
#: A finished Job (its agent ended at its lease, or crashed past backoffLimit) is deleted at
#: once by the TTL-after-finished controller, and with it its pod and (owned) the Secret.
FINISHED_TTL_S = 0
#: ``KubernetesJob(workload=...)``: "pods" (the default: one core/v1 pod per host) or "jobs".
WORKLOADS = ("pods", "jobs")
_FAILING = {"CrashLoopBackOff", "ErrImagePull", "ImagePullBackOff", "InvalidImageName", "CreateContainerConfigError",
            "CreateContainerError", "RunContainerError", "ErrImageNeverPull"}


@dataclass
class ImageSpec:
    """The image of a provisioned mesh's pods, and what each pod asks for."""
    image: str
    resources: dict | None = None   # {"cpu": 8, "memory": "64Gi", "nvidia.com/gpu": 8}


def _dns(text: str, limit: int) -> str:
    s = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    return s[:limit].strip("-") or "x"


class KubernetesJob(JobTrait):
    kind = "kubernetes"
    _meshes_later = True
    _released_what = "its pods and Secret were deleted"

    def __init__(self, namespace: str = "default", kubeconfig: str | None = None, context: str | None = None,
                 job_start_timeout: float | None = 600.0, *, name: str | None = None, lease: float | None = None,
                 workload: str = "pods"):
        if workload not in WORKLOADS:
            raise ValueError(f"KubernetesJob(workload={workload!r}): use 'pods' (one core/v1 pod per host; after "
                             "the lease its Succeeded pods and Secret stay until kill()) or 'jobs' (one batch/v1 "
                             "Job per host, which Kubernetes deletes with its pod and the Secret after the lease)")
        self.namespace, self.kubeconfig, self.context = namespace, kubeconfig, context
        self.workload = workload
        self.job_start_timeout = job_start_timeout
        self._mesh_specs: dict[str, dict] = {}
        super().__init__({}, name=name, lease=lease)

    def add_mesh(self, name: str, num_replicas: int, image_spec: ImageSpec | None = None,
                 pod_template: dict | None = None, label_selector: str | None = None) -> KubernetesJob:
        given = [x for x in (image_spec, pod_template, label_selector) if x is not None]
        if len(given) != 1:
            raise ValueError(f"add_mesh({name!r}): give exactly one of image_spec= (create pods), pod_template= "
                             "(create pods from your spec) or label_selector= (attach to running pods)")
        if not isinstance(num_replicas, int) or isinstance(num_replicas, bool) or num_replicas < 1:
            raise ValueError(f"add_mesh({name!r}): num_replicas must be a positive int, got {num_replicas!r}")
        if not name.isidentifier() or name.startswith("_"):
            raise ValueError(f"mesh name {name!r} must be an identifier like 'trainers'")
        if isinstance(image_spec, ImageSpec):
            image_spec = {"image": image_spec.image, "resources": image_spec.resources}
        if pod_template is not None and not isinstance(pod_template, dict):
            from kubernetes import client

            pod_template = client.ApiClient().sanitize_for_serialization(pod_template)
        self._mesh_specs[name] = {"num_replicas": num_replicas, "image_spec": image_spec,
                                  "pod_template": pod_template, "label_selector": label_selector}
        self._meshes[name] = num_replicas
        attach = {bool(s["label_selector"]) for s in self._mesh_specs.values()}
        if len(attach) > 1:
            raise ValueError("a KubernetesJob either creates its pods or attaches to running ones (one mesh key "
                             "per job): make two jobs")
        return self

    def spec(self) -> dict:
        return {"namespace": self.namespace, "kubeconfig": self.kubeconfig, "context": self.context,
                "job_start_timeout": self.job_start_timeout, "mesh_specs": self._mesh_specs,
                "workload": self.workload}

    @classmethod
    def _from_spec(cls, spec: dict, *, name: str, lease: float | None) -> KubernetesJob:
        job = cls(spec["namespace"], spec["kubeconfig"], spec["context"], spec["job_start_timeout"], name=name,
                  lease=lease, workload=spec.get("workload", "pods"))
        for mesh, ms in spec["mesh_specs"].items():
            job.add_mesh(mesh, **ms)
        return job

    @property
    def _attach_only(self) -> bool:
        return any(s["label_selector"] for s in self._mesh_specs.values())

    # ------------------------------------------------------------------ API
    def _api(self):
        try:
            from kubernetes import client, config
        except ImportError:
            raise JobError("KubernetesJob needs the kubernetes client: pip install 'monarch-kernel[kubernetes]'") \
                from None
        cfg = client.Configuration()
        if self.kubeconfig or not os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_kube_config(config_file=self.kubeconfig, context=self.context, client_configuration=cfg)
        else:
            config.load_incluster_config(client_configuration=cfg)
        return client.CoreV1Api(client.ApiClient(cfg))

    def _prefix(self) -> str:
        # short enough that a Job's name stays a label value (63) with the pod's 6 more
        return f"mk-{_dns(self.name, 30)}-{hashlib.sha1(self.name.encode()).hexdigest()[:5]}"

    def _job_name(self, mesh: str, index: int) -> str:
        return f"{self._prefix()}-{_dns(mesh, 12)}-{index}"

    def job_manifest(self, mesh: str, index: int, secret: str):
        """The batch/v1 Job of host ``index`` of ``mesh``: one pod (``pod_manifest``), not
        restarted once it succeeds, deleted with its pod as soon as it finishes."""
        from kubernetes import client

        pod = self.pod_manifest(mesh, index, secret)
        if not isinstance(pod, dict):
            pod = client.ApiClient().sanitize_for_serialization(pod)
        if pod["spec"].get("restartPolicy") not in ("OnFailure", "Never"):   # a Job allows only these
            pod["spec"]["restartPolicy"] = RESTART
        meta = pod["metadata"]
        return {"apiVersion": "batch/v1", "kind": "Job",
                "metadata": {"name": meta["name"], "labels": meta["labels"]},
                "spec": {"completions": 1, "parallelism": 1, "ttlSecondsAfterFinished": FINISHED_TTL_S,
                         "template": {"metadata": {"labels": meta["labels"]}, "spec": pod["spec"]}}}

    def pod_manifest(self, mesh: str, index: int, secret: str):
        """The pod of host ``index`` of ``mesh``: a ``kubernetes.client.V1Pod`` (or, from a
        pod_template, the template with the agent's command and env added); its Job's
        template (``job_manifest``)."""
        from kubernetes import client

        spec = self._mesh_specs[mesh]
        pod_name = self._job_name(mesh, index)
        labels = {APP_LABEL: APP, MESH_LABEL: mesh, INDEX_LABEL: str(index), JOB_LABEL: self._prefix()}
        command = ["python", "-m", "workers.agent", "--bind", "$(POD_IP)", "--port", str(AGENT_PORT), "--persistent",
                   "--lease", str(self.lease), "--name", pod_name]
        env = [client.V1EnvVar(name="POD_IP", value_from=client.V1EnvVarSource(
                   field_ref=client.V1ObjectFieldSelector(field_path="status.podIP"))),
               client.V1EnvVar(name="MONARCH_KERNEL_KEY", value_from=client.V1EnvVarSource(
                   secret_key_ref=client.V1SecretKeySelector(name=secret, key="key")))]
        meta = client.V1ObjectMeta(name=pod_name, labels=labels)
        if spec["image_spec"]:
            res = spec["image_spec"].get("resources")
            res = {k: str(v) for k, v in res.items()} if res else None
            container = client.V1Container(
                name="worker", image=spec["image_spec"]["image"], command=command, env=env,
                ports=[client.V1ContainerPort(container_port=AGENT_PORT, name="monarch")],
                resources=client.V1ResourceRequirements(limits=res, requests=res) if res else None)
            return client.V1Pod(api_version="v1", kind="Pod", metadata=meta,
                                spec=client.V1PodSpec(containers=[container], restart_policy=RESTART))
        tmpl = dict(spec["pod_template"])
        pod_spec = dict(tmpl.get("spec", tmpl))   # a PodTemplateSpec or a PodSpec
        containers = [dict(c) for c in pod_spec["containers"]]
        c0 = containers[0]
        c0.setdefault("command", command)
        c0["env"] = [*(c0.get("env") or []), *client.ApiClient().sanitize_for_serialization(env)]
        pod_spec["containers"] = containers
        pod_spec.setdefault("restartPolicy", RESTART)
        meta_d = client.ApiClient().sanitize_for_serialization(meta)
        meta_d["labels"] = {**(tmpl.get("metadata", {}).get("labels") or {}), **labels}
        return {"apiVersion": "v1", "kind": "Pod", "metadata": meta_d, "spec": pod_spec}

    # ------------------------------------------------------------------ create / wait
    def _create(self, key: bytes, progress: Progress) -> list[dict]:
        from kubernetes.client import V1ObjectMeta, V1Secret
        from kubernetes.client.rest import ApiException

        api = self._api()
        if self._attach_only:
            return self._attach_running(api, progress)
        prefix = self._prefix()
        secret = f"{prefix}-key"
        self._handle = {"id": prefix, "jobs": [], "secret": secret}
        body = V1Secret(api_version="v1", kind="Secret", type="Opaque",
                        metadata=V1ObjectMeta(name=secret, labels={JOB_LABEL: prefix}),
                        data={"key": base64.b64encode(key.hex().encode()).decode()})
        try:
            api.create_namespaced_secret(self.namespace, body)
        except ApiException as e:
            if e.status != 409:
                raise JobError(f"kubernetes refused the secret {secret}: {_reason(e)}") from None
            api.delete_namespaced_secret(secret, self.namespace)
            api.create_namespaced_secret(self.namespace, body)
        if self.workload == "pods":
            return self._create_pods(api, secret, progress)
        want, owners = [], []
        batch = self._batch_api(api)
        for mesh, n in self._meshes.items():
            for i in range(n):
                body = self.job_manifest(mesh, i, secret)
                name = body["metadata"]["name"]
                try:
                    made = batch.create_namespaced_job(self.namespace, body)
                except ApiException as e:
                    if e.status in (403, 404) and not want:   # no rights on (or no API for) Jobs: bare pods
                        log.warning("kubernetes refused to create jobs (%s): creating bare pods instead; after "
                                    "their lease their Succeeded pods and the Secret stay until kill() or "
                                    "%%mesh stop (grant create, list, delete on jobs.batch to have Kubernetes "
                                    "remove them)", _reason(e))
                        progress("kubernetes: no rights on batch Jobs; creating bare pods")
                        return self._create_pods(api, secret, progress)
                    raise JobError(f"kubernetes refused job {name}: {_reason(e)}") from None
                self._handle["jobs"].append(name)
                owners.append({"apiVersion": "batch/v1", "kind": "Job", "name": name, "uid": made.metadata.uid})
                want.append((mesh, i, name))
        try:   # the Secret goes with the last of them (the garbage collector deletes it)
            api.patch_namespaced_secret(secret, self.namespace, {"metadata": {"ownerReferences": owners}})
        except ApiException as e:
            log.warning("could not make the jobs own secret %s (%s): it stays after their lease, until "
                        "kill() or %%mesh stop", secret, _reason(e))
        progress(f"kubernetes: created {len(want)} jobs in namespace {self.namespace}")
        pods = self._wait_for_agents(api, [w[2] for w in want], f"{JOB_LABEL}={prefix}", {}, progress,
                                     key=_job_of)
        return [{"addr": f"tcp://{pods[name][1]}:{AGENT_PORT}", "host": pods[name][0], "pid": None, "mesh": mesh,
                 "rank": i} for mesh, i, name in want]

    def _create_pods(self, api, secret: str, progress: Progress) -> list[dict]:
        """One bare pod per host (the default, and where the user may not create batch Jobs)."""
        from kubernetes.client.rest import ApiException

        self._handle["pods"] = []
        want = []
        for mesh, n in self._meshes.items():
            for i in range(n):
                pod = self.pod_manifest(mesh, i, secret)
                name = pod.metadata.name if hasattr(pod, "metadata") else pod["metadata"]["name"]
                try:
                    api.create_namespaced_pod(self.namespace, pod)
                except ApiException as e:
                    raise JobError(f"kubernetes refused pod {name}: {_reason(e)}") from None
                self._handle["pods"].append(name)
                want.append((mesh, i, name))
        progress(f"kubernetes: created {len(want)} pods in namespace {self.namespace}")
        ips = self._wait_for_agents(api, [w[2] for w in want], f"{JOB_LABEL}={self._handle['id']}", {}, progress)
        return [{"addr": f"tcp://{ips[name][1]}:{AGENT_PORT}", "host": name, "pid": None, "mesh": mesh, "rank": i}
                for mesh, i, name in want]

    def _batch_api(self, core):
        from kubernetes import client

        return client.BatchV1Api(core.api_client)

    def _wait_for_agents(self, api, names: list[str], selector: str, ports: dict, progress: Progress,
                         key=lambda pod: pod.metadata.name) -> dict:
        """Wait until each of ``names`` (pod names, or for our Jobs their names: ``key``
        maps a pod to one) has a Running pod whose agent's port is open: {name: (pod, ip)}."""
        start = time.monotonic()
        last = ""
        while True:
            listed = api.list_namespaced_pod(self.namespace, label_selector=selector)
            pods = {}
            for p in sorted(listed.items, key=lambda p: str(p.metadata.creation_timestamp or "")):
                if p.metadata.deletion_timestamp is None:
                    pods[key(p)] = p   # a Job's newest pod
            counts: dict[str, int] = {}
            ips: dict[str, tuple] = {}
            for name in names:
                pod = pods.get(name)
                if pod is None:
                    if key is not _job_of:
                        raise JobGoneError(f"pod {name} was deleted while the job started")
                    counts["Pending"] = counts.get("Pending", 0) + 1   # its Job has not made it yet
                    continue
                state = self._check_pod(api, pod)
                counts[state] = counts.get(state, 0) + 1
                ip = pod.status.pod_ip
                if state == "Running" and ip and _port_open(ip, ports.get(name, AGENT_PORT)):
                    ips[name] = (pod.metadata.name, ip)
            line = "pods: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) + \
                f"; agents up {len(ips)}/{len(names)}"
            if line != last:
                progress(line)
                last = line
            if len(ips) == len(names):
                return ips
            if self.job_start_timeout is not None and time.monotonic() - start > self.job_start_timeout:
                why = "".join(f"; pod {pods[n].metadata.name}: {_unschedulable(pods[n])}" for n in names
                              if n in pods and _unschedulable(pods[n]))
                raise JobError(f"kubernetes job {self.name!r}: not every agent was up after "
                               f"{self.job_start_timeout:g} s ({line}{why}); its pods were deleted. Raise "
                               "job_start_timeout or ask for what a node has")
            if set(counts) == {"Running"}:
                time.sleep(0.1)   # only the agents' ports to wait for: no pod event will say so
            else:
                self._next_pod_event(api, selector, listed.metadata.resource_version)

    def _next_pod_event(self, api, selector: str, since: str | None, timeout: int = 1) -> None:
        """Block until one of the job's pods changes after ``since`` (a watch), or ``timeout``."""
        from kubernetes import watch

        w = watch.Watch()
        try:
            for _ in w.stream(api.list_namespaced_pod, self.namespace, label_selector=selector,
                              resource_version=since, timeout_seconds=timeout, _request_timeout=timeout + 5):
                break
        except Exception as e:   # an API server that cannot watch: fall back to polling
            log.debug("pod watch failed (%s); polling", e)
            time.sleep(0.2)
        finally:
            w.stop()

    def _check_pod(self, api, pod) -> str:
        """The pod's state for the progress line; raises when it cannot start."""
        name = pod.metadata.name
        for cs in pod.status.container_statuses or []:
            waiting = cs.state.waiting if cs.state else None
            term = cs.last_state.terminated if cs.last_state else None
            if waiting is not None and waiting.reason in _FAILING or (cs.restart_count and term is not None):
                why = waiting.reason if waiting is not None and waiting.reason in _FAILING else \
                    "CrashLoopBackOff (its container exited and was restarted)"
                detail = (waiting.message if waiting is not None else "") or ""
                if term is not None:
                    detail += f" (last exit code {term.exit_code})"
                raise JobError(f"pod {name} cannot start: {why}{': ' + detail.strip() if detail.strip() else ''}\n"
                               f"last log lines of {name}:\n{self._logs(api, name)}")
            if waiting is not None and waiting.reason:
                return waiting.reason
        if _unschedulable(pod):
            return "Pending (Unschedulable)"
        return pod.status.phase or "Pending"

    def _logs(self, api, name: str, lines: int = 20) -> str:
        try:
            text = api.read_namespaced_pod_log(name, self.namespace, tail_lines=lines)
        except Exception as e:
            return f"(no logs: {_reason(e)})"
        return "\n".join("  " + line for line in (text or "").rstrip().splitlines()) or "  (empty)"

    def _attach_running(self, api, progress: Progress) -> list[dict]:
        from kubernetes.client.rest import ApiException

        try:
            sec = api.read_namespaced_secret(KEY_SECRET, self.namespace)
            key = bytes.fromhex(base64.b64decode(sec.data["key"]).decode().strip())
        except ApiException as e:
            raise JobError(f"attach-only job: cannot read Secret {KEY_SECRET} in {self.namespace}: {_reason(e)}; the "
                           "pods' agents take their key from it (data 'key', hex)") from None
        self._handle = {"id": f"attach-{self._prefix()}", "jobs": [], "secret": None}
        self._key_from_create = key
        agents = []
        for mesh, spec in self._mesh_specs.items():
            sel = ",".join(filter(None, [spec["label_selector"]]))
            pods = [p for p in api.list_namespaced_pod(self.namespace, label_selector=sel).items
                    if p.metadata.deletion_timestamp is None]
            pods.sort(key=lambda p: (int((p.metadata.labels or {}).get(INDEX_LABEL, "0") or 0), p.metadata.name))
            if len(pods) < spec["num_replicas"]:
                raise JobError(f"mesh {mesh!r}: {len(pods)} pods match {sel!r} in {self.namespace}, "
                               f"{spec['num_replicas']} wanted")
            pods = pods[:spec["num_replicas"]]
            ports = {p.metadata.name: _agent_port(p) for p in pods}
            ips = self._wait_for_agents(api, list(ports), sel, ports, progress)
            agents += [{"addr": f"tcp://{ips[p.metadata.name][1]}:{ports[p.metadata.name]}", "host": p.metadata.name,
                        "pid": None, "mesh": mesh, "rank": i} for i, p in enumerate(pods)]
        return agents

    # ------------------------------------------------------------------ liveness / release
    def _gone_reason(self) -> str | None:
        try:
            api = self._api()
            pods = {p.metadata.name: p for p in api.list_namespaced_pod(self.namespace).items}
        except Exception as e:
            return f"the Kubernetes API does not answer ({_reason(e)})"
        for a in self._agents:
            pod = pods.get(a["host"])
            if pod is None:
                if self._handle and self._handle.get("jobs"):
                    try:
                        jobs = {j.metadata.name for j in self._batch_api(api).list_namespaced_job(
                            self.namespace, label_selector=f"{JOB_LABEL}={self._handle['id']}").items}
                    except Exception:
                        jobs = None
                    if jobs is not None and not jobs:
                        return (f"pod {a['host']} was deleted, with its Job: the agents ended at their lease "
                                "(no notebook attached) and Kubernetes removed the finished Jobs, or they were "
                                "deleted")
                return f"pod {a['host']} was deleted"
            if pod.status.phase == "Succeeded":
                return f"pod {a['host']} is Succeeded: its agent ended (its lease ran out with no notebook attached)"
            if pod.status.phase != "Running" or not a["addr"].startswith(f"tcp://{pod.status.pod_ip}:"):
                return f"pod {a['host']} is {pod.status.phase} (or was replaced: its agent and procs are new)"
        return None

    def _release(self) -> None:
        if not self._handle or self._attach_only:
            return
        from kubernetes.client.rest import ApiException

        api = self._api()
        batch = self._batch_api(api)
        sel = f"{JOB_LABEL}={self._handle['id']}"
        # Also what the API server made but we never heard back about (an interrupt while
        # a create waited for its answer): our label finds it.
        jobs = list(self._handle.get("jobs", []))
        if "pods" not in self._handle:   # Jobs were asked for (bare pods never touch the batch API)
            try:
                jobs += [j.metadata.name for j in batch.list_namespaced_job(self.namespace, label_selector=sel).items
                         if j.metadata.name not in jobs]
            except ApiException:   # no rights on (or no API for) batch Jobs
                pass
        for name in jobs:
            try:   # their pods are deleted below at once, not left to the garbage collector
                batch.delete_namespaced_job(name, self.namespace, grace_period_seconds=0,
                                            propagation_policy="Background")
            except ApiException as e:
                if e.status != 404:
                    raise JobError(f"could not delete job {name}: {_reason(e)}") from None
        pods = list(self._handle.get("pods", []))   # a job cached by an older version made bare pods
        pods += [p.metadata.name for p in api.list_namespaced_pod(self.namespace, label_selector=sel).items
                 if p.metadata.name not in pods]
        for name in pods:
            try:
                api.delete_namespaced_pod(name, self.namespace, grace_period_seconds=0)
            except ApiException as e:
                if e.status != 404:
                    raise JobError(f"could not delete pod {name}: {_reason(e)}") from None
        if self._handle.get("secret"):
            try:
                api.delete_namespaced_secret(self._handle["secret"], self.namespace)
            except ApiException as e:
                if e.status != 404:
                    raise JobError(f"could not delete secret {self._handle['secret']}: {_reason(e)}") from None
        deadline = time.monotonic() + 30
        while api.list_namespaced_pod(self.namespace, label_selector=sel).items and time.monotonic() < deadline:
            time.sleep(0.1)

    def describe(self) -> dict:
        out = {"scheduler": "kubernetes", "id": self.job_id, "hosts": len(self._agents),
               "nodes": ",".join(a["host"] for a in self._agents)}
        reason = self._gone_reason() if self._agents else None
        out["state"] = reason or f"pods Running {len(self._agents)}/{len(self._agents)}"
        return out


def _job_of(pod) -> str | None:
    """The Job a pod of ours belongs to (its name: our labels give it, whoever made the pod)."""
    labels = pod.metadata.labels or {}
    for ref in pod.metadata.owner_references or []:
        if ref.kind == "Job":
            return ref.name
    return labels.get("batch.kubernetes.io/job-name") or labels.get("job-name")


def _unschedulable(pod) -> str | None:
    """The scheduler's word on a pod no node can take (``0/3 nodes are available: ...``)."""
    for c in pod.status.conditions or []:
        if c.type == "PodScheduled" and c.status == "False" and c.reason == "Unschedulable":
            return f"Unschedulable: {c.message or 'no node fits it'}"
    return None


def _agent_port(pod) -> int:
    for c in pod.spec.containers or []:
        for e in c.env or []:
            if e.name == "MONARCH_PORT" and e.value and e.value.isdigit():
                return int(e.value)
    return AGENT_PORT


def _port_open(ip: str, port: int) -> bool:
    try:
        socket.create_connection((ip, port), timeout=0.3).close()
        return True
    except OSError:
        return False


def _reason(e) -> str:
    import json

    body = getattr(e, "body", None)
    try:
        return json.loads(body)["message"]
    except Exception:
        return str(getattr(e, "reason", None) or e)
