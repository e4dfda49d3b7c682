"""A fake Kubernetes API server for the tests (no real one installs here; see RECIPES.md):
core/v1 pods and secrets (create, get, list with label selectors, delete; secrets patched
with a JSON merge patch), watches of pods from a resourceVersion, pod logs, batch/v1 jobs
(create, get, list, delete with a propagationPolicy), and
a "kubelet" that runs each pod's container command as a local process in its own network
namespace with its own IP (so the fixed agent port behaves as on a cluster), and restarts
it as the pod's restartPolicy says (Always, OnFailure, Never).

The controllers a real cluster runs, as far as the jobs use them: the Job controller (one
pod per Job, named ``<job>-<5 chars>``, labelled ``job-name`` and owned by the Job; a new pod
when it is deleted before the Job finished; ``Complete`` when it succeeds, ``Failed`` past
``backoffLimit`` restarts), the TTL-after-finished controller (a finished Job is deleted
``ttlSecondsAfterFinished`` after it finished) and the garbage collector (pods and secrets
whose every owner, by uid, is gone are deleted). Like the API server, a Job whose pod
template says ``restartPolicy: Always`` is refused (422).

Images the kubelet knows:
  fake/monarch:*        ``python`` is this venv's interpreter (the project installed)
  fake/python-only:*    ``python`` is the system one without the project: the container
                        exits at once and the pod goes into CrashLoopBackOff
  anything else         ErrImagePull / ImagePullBackOff, the pod stays Pending
A pod requesting more than NODE_CAPACITY (e.g. 9 nvidia.com/gpu) stays Pending, Unschedulable.
Without root (no namespaces) pods run on loopback with distinct 127.0.0.x addresses.
Every object created is kept in ``created`` for the tests to validate.
"""
from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

from netns_hosts import BridgedHosts

#: what the one fake node offers: a pod requesting more stays Pending (Unschedulable)
NODE_CAPACITY = {"nvidia.com/gpu": 8}
SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin") or "/usr/bin/python3"


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _matches(labels: dict, selector: str) -> bool:
    for term in filter(None, (selector or "").split(",")):
        k, _, v = term.partition("=")
        if labels.get(k.strip()) != v.strip():
            return False
    return True


class FakeKubernetes:
    def __init__(self, use_netns: bool = True, backoff: float = 0.3):
        self.pods: dict[tuple[str, str], dict] = {}
        self.secrets: dict[tuple[str, str], dict] = {}
        self.jobs: dict[tuple[str, str], dict] = {}
        #: resources the fake user may not create ("jobs"): 403, as RBAC says it
        self.forbidden: set[str] = set()
        #: API groups the fake does not serve ("batch"): 404, as an API server without them
        self.unserved: set[str] = set()
        self.created: list[dict] = []
        self.rv = 1                      # resourceVersion, bumped on every pod change
        self.events: list[tuple[int, str, dict]] = []   # (rv, type, pod) for watches
        self.watches = 0                 # watch requests served
        self.procs: dict[tuple[str, str], subprocess.Popen] = {}
        self.lock = threading.RLock()
        self.dir = tempfile.mkdtemp(prefix="mk-fake-k8s-")
        self.backoff = backoff
        self.net = BridgedHosts([]) if use_netns else None
        self._loop_ip = 1
        self._stop = threading.Event()
        handler = type("Handler", (_Handler,), {"api": self})
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.kubeconfig = os.path.join(self.dir, "kubeconfig")

    def __enter__(self) -> FakeKubernetes:
        if self.net is not None:
            self.net.open()
        with open(self.kubeconfig, "w") as f:
            json.dump({"apiVersion": "v1", "kind": "Config", "current-context": "fake",
                       "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
                       "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake",
                                                                 "namespace": "default"}}],
                       "users": [{"name": "fake", "user": {"token": "fake-token"}}]}, f)
        threading.Thread(target=self.server.serve_forever, daemon=True, name="fake-k8s").start()
        threading.Thread(target=self._kubelet, daemon=True, name="fake-kubelet").start()
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        self._stop.set()
        self.server.shutdown()
        self.server.server_close()
        with self.lock:
            for key in list(self.procs):
                self._kill(key)
        if self.net is not None:
            self.net.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    # ------------------------------------------------------------------ API objects
    def create_pod(self, ns: str, body: dict) -> dict:
        name = body["metadata"]["name"]
        pod = json.loads(json.dumps(body))
        pod.setdefault("apiVersion", "v1")
        pod.setdefault("kind", "Pod")
        meta = pod["metadata"]
        meta.update(namespace=ns, uid=str(uuid.uuid4()), creationTimestamp=_now())
        c = pod["spec"]["containers"][0]
        pod["status"] = {"phase": "Pending", "conditions": [], "containerStatuses": [
            {"name": c["name"], "image": c["image"], "imageID": "", "ready": False, "restartCount": 0,
             "state": {"waiting": {"reason": "ContainerCreating"}}}]}
        with self.lock:
            if (ns, name) in self.pods:
                return None
            self.pods[(ns, name)] = pod
            self.created.append(pod)
            self._changed(pod, "ADDED")
        return pod

    def _changed(self, pod: dict, kind: str) -> None:
        self.rv += 1
        pod["metadata"]["resourceVersion"] = str(self.rv)
        self.events.append((self.rv, kind, json.loads(json.dumps(_public(pod)))))

    def delete_pod(self, ns: str, name: str) -> dict | None:
        with self.lock:
            pod = self.pods.pop((ns, name), None)
            self._kill((ns, name))
            if pod is not None:
                self._changed(pod, "DELETED")
                if self.net is not None:
                    self.net.remove(name)
        return pod

    def create_job(self, ns: str, body: dict) -> tuple[int, dict]:
        job = json.loads(json.dumps(body))
        name = job["metadata"]["name"]
        policy = job["spec"]["template"]["spec"].get("restartPolicy")
        if policy not in ("OnFailure", "Never"):
            return 422, {"reason": "Invalid", "message": f'Job.batch "{name}" is invalid: spec.template.spec.'
                         f'restartPolicy: Required value: valid values: "OnFailure", "Never"'}
        if len(name) > 63:
            return 422, {"reason": "Invalid", "message": f'Job.batch "{name}" is invalid: metadata.name: must be no '
                         "more than 63 characters"}
        job.setdefault("apiVersion", "batch/v1")
        job.setdefault("kind", "Job")
        job["metadata"].update(namespace=ns, uid=str(uuid.uuid4()), creationTimestamp=_now())
        job["spec"].setdefault("backoffLimit", 6)
        job["status"] = {}
        with self.lock:
            if (ns, name) in self.jobs:
                return 409, {"reason": "AlreadyExists", "message": f'jobs.batch "{name}" already exists'}
            self.jobs[(ns, name)] = job
            self.created.append(job)
        return 201, job

    def delete_job(self, ns: str, name: str, propagation: str = "Background") -> dict | None:
        with self.lock:
            job = self.jobs.pop((ns, name), None)
            if job is not None and propagation != "Orphan":
                self._collect()
        return job

    def _owners_alive(self, obj: dict) -> bool:
        refs = obj["metadata"].get("ownerReferences") or []
        if not refs:
            return True
        uids = {o["metadata"]["uid"] for store in (self.jobs, self.pods, self.secrets) for o in store.values()}
        return any(r["uid"] in uids for r in refs)

    def _collect(self) -> None:
        """The garbage collector: delete what every owner of has gone."""
        for (ns, name), pod in list(self.pods.items()):
            if not self._owners_alive(pod):
                self.delete_pod(ns, name)
        for key, sec in list(self.secrets.items()):
            if not self._owners_alive(sec):
                del self.secrets[key]

    def _job_controller(self) -> None:
        now = time.time()
        for (ns, name), job in list(self.jobs.items()):
            st, spec = job["status"], job["spec"]
            if "completionTime" in st or any(c["type"] == "Failed" for c in st.get("conditions", [])):
                ttl = spec.get("ttlSecondsAfterFinished")
                if ttl is not None and now >= job["_finished"] + ttl:
                    self.delete_job(ns, name)   # the TTL-after-finished controller
                continue
            mine = [p for p in self.pods.values() if any(r["uid"] == job["metadata"]["uid"]
                                                          for r in p["metadata"].get("ownerReferences") or [])]
            for pod in mine:
                cs = pod["status"]["containerStatuses"][0]
                if pod["status"]["phase"] == "Succeeded":
                    st.update(succeeded=1, active=0, completionTime=_now())
                    st["conditions"] = [{"type": "Complete", "status": "True", "lastTransitionTime": _now()}]
                    job["_finished"] = now
                elif pod["status"]["phase"] == "Failed" or cs["restartCount"] > spec["backoffLimit"]:
                    st["failed"] = st.get("failed", 0) + 1
                    self.delete_pod(ns, pod["metadata"]["name"])
                    if st["failed"] > spec["backoffLimit"] or cs["restartCount"] > spec["backoffLimit"]:
                        st["conditions"] = [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded",
                                             "lastTransitionTime": _now()}]
                        job["_finished"] = now
            if "_finished" in job or any(p["status"]["phase"] in ("Pending", "Running")
                                         for p in self.pods.values() if p in mine):
                continue
            tmpl = spec["template"]
            labels = {**(tmpl.get("metadata", {}).get("labels") or {}), "job-name": name,
                      "batch.kubernetes.io/job-name": name, "controller-uid": job["metadata"]["uid"],
                      "batch.kubernetes.io/controller-uid": job["metadata"]["uid"]}
            pod_name = f"{name}-{uuid.uuid4().hex[:5]}"
            self.create_pod(ns, {"apiVersion": "v1", "kind": "Pod", "metadata": {
                "name": pod_name, "labels": labels, "ownerReferences": [{
                    "apiVersion": "batch/v1", "kind": "Job", "name": name, "uid": job["metadata"]["uid"],
                    "controller": True, "blockOwnerDeletion": True}]}, "spec": json.loads(json.dumps(tmpl["spec"]))})
            st["active"] = 1
            st.setdefault("startTime", _now())

    def log(self, ns: str, name: str, tail: int | None) -> str | None:
        path = os.path.join(self.dir, f"{ns}_{name}.log")
        if (ns, name) not in self.pods:
            return None
        try:
            with open(path, errors="replace") as f:
                lines = f.read().splitlines()
        except FileNotFoundError:
            lines = []
        return "\n".join(lines[-tail:] if tail else lines) + ("\n" if lines else "")

    # ------------------------------------------------------------------ kubelet
    def _kubelet(self) -> None:
        while not self._stop.wait(0.05):
            with self.lock:
                pods = list(self.pods.items())   # a pod the Job controller makes now starts next tick
                try:
                    self._job_controller()
                    self._collect()
                except Exception as e:
                    print(f"fake job controller: {e}", file=sys.stderr)
                for key, pod in pods:
                    if key not in self.pods:
                        continue
                    before = json.dumps(pod["status"], sort_keys=True)
                    try:
                        self._step(key, pod)
                    except Exception as e:  # a broken pod must not stop the others
                        print(f"fake kubelet: {key}: {e}", file=sys.stderr)
                    if json.dumps(pod["status"], sort_keys=True) != before:
                        self._changed(pod, "MODIFIED")

    def _step(self, key, pod) -> None:
        st = pod["status"]
        cs = st["containerStatuses"][0]
        c = pod["spec"]["containers"][0]
        image = c["image"]
        proc = self.procs.get(key)
        if proc is None and "terminated" in cs["state"]:
            return   # ended for good (restartPolicy Never, or OnFailure after a clean exit)
        if proc is None and "running" not in cs["state"]:
            short = [r for r, n in ((c.get("resources") or {}).get("requests") or {}).items()
                     if r in NODE_CAPACITY and int(n) > NODE_CAPACITY[r]]
            if short:   # as the scheduler says it: no node has room, the pod stays Pending
                st["conditions"] = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                     "message": f"0/1 nodes are available: 1 Insufficient {short[0]}."}]
                cs["state"] = {"waiting": {}}
                return
            if not image.startswith(("fake/monarch:", "fake/python-only:")):
                # A pull takes a while in a real cluster: the pod waits ContainerCreating for 1 s
                # first, so the client's first list sees it pending (under load the kubelet
                # thread could fail the pull before that list: the client then had nothing to watch).
                pull_at = pod.setdefault("_pull_at", time.monotonic() + 1.0)
                if time.monotonic() < pull_at:
                    cs["state"] = {"waiting": {"reason": "ContainerCreating"}}
                    return
                reason = "ErrImagePull" if cs["state"].get("waiting", {}).get("reason") != "ErrImagePull" \
                    else "ImagePullBackOff"
                cs["state"] = {"waiting": {"reason": reason, "message": f'failed to pull image "{image}": '
                                                                          "not found"}}
                return
            if cs["state"].get("waiting", {}).get("reason") == "CrashLoopBackOff" and \
                    time.monotonic() < pod.get("_restart_at", 0):
                return
            self._start(key, pod)
            cs["state"] = {"running": {"startedAt": _now()}}
            cs["ready"] = True
            st.update(phase="Running", podIP=pod["_ip"], startTime=_now())
            return
        if proc is not None and proc.poll() is not None:
            code = proc.returncode
            del self.procs[key]
            policy = pod["spec"].get("restartPolicy") or "Always"   # the API server's default
            if policy == "Never" or (policy == "OnFailure" and code == 0):
                cs["state"] = {"terminated": {"exitCode": code, "reason": "Error" if code else "Completed",
                                              "finishedAt": _now()}}
                cs["ready"] = False
                st["phase"] = "Failed" if code else "Succeeded"
                return
            cs["lastState"] = {"terminated": {"exitCode": code, "reason": "Error" if code else "Completed"}}
            cs["restartCount"] += 1
            cs["ready"] = False
            cs["state"] = {"waiting": {"reason": "CrashLoopBackOff",
                                       "message": f"back-off restarting failed container {c['name']}"}}
            pod["_restart_at"] = time.monotonic() + self.backoff

    def _start(self, key, pod) -> None:
        ns, name = key
        c = pod["spec"]["containers"][0]
        if "_ip" not in pod:
            if self.net is not None:
                pod["_ip"] = self.net.add(name)
            else:
                self._loop_ip += 1
                pod["_ip"] = f"127.0.0.{self._loop_ip}"
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOSTNAME": name}
        for var in ("MONARCH_KERNEL_HOME", "MONARCH_KERNEL_HOST_TIMEOUT_S"):   # the tests' orphan check
            if os.environ.get(var):
                env[var] = os.environ[var]
        for e in c.get("env") or []:
            if "value" in e:
                env[e["name"]] = e["value"]
            elif "valueFrom" in e:
                vf = e["valueFrom"]
                if "fieldRef" in vf and vf["fieldRef"]["fieldPath"] == "status.podIP":
                    env[e["name"]] = pod["_ip"]
                elif "fieldRef" in vf and vf["fieldRef"]["fieldPath"] == "metadata.name":
                    env[e["name"]] = name
                elif "secretKeyRef" in vf:
                    ref = vf["secretKeyRef"]
                    sec = self.secrets.get((ns, ref["name"]))
                    if sec is None:
                        raise RuntimeError(f"secret {ref['name']} not found")
                    env[e["name"]] = base64.b64decode(sec["data"][ref["key"]]).decode()
        argv = [*(c.get("command") or []), *(c.get("args") or [])]
        argv = [re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), a) for a in argv]
        if argv and argv[0] == "python":
            argv[0] = sys.executable if c["image"].startswith("fake/monarch:") else SYSTEM_PYTHON
        if self.net is not None:
            argv = self.net.enter(name, argv)
        log = open(os.path.join(self.dir, f"{ns}_{name}.log"), "ab")
        # cwd "/" as in an image: the project is importable only where the image installed it
        self.procs[key] = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd="/",
                                           stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()

    def _kill(self, key) -> None:
        p = self.procs.pop(key, None)
        if p is not None and p.poll() is None:
            p.terminate()
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _merge(target: dict, patch: dict) -> None:
    for k, v in patch.items():
        if v is None:
            target.pop(k, None)
        elif isinstance(v, dict) and isinstance(target.get(k), dict):
            _merge(target[k], v)
        else:
            target[k] = v


def _public(obj: dict) -> dict:
    return {k: v for k, v in obj.items() if not k.startswith("_")}


class _Handler(BaseHTTPRequestHandler):
    api: FakeKubernetes

    def log_message(self, *a):
        pass

    def _send(self, code: int, body, content_type="application/json"):
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _status(self, code: int, reason: str, message: str):
        self._send(code, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": reason,
                          "message": message, "code": code})

    def _body(self) -> dict:
        n = int(self.headers.get("Content-Length") or 0)
        return json.loads(self.rfile.read(n) or b"{}")

    def _route(self):
        u = urlparse(self.path)
        return u.path.rstrip("/").split("/"), {k: v[-1] for k, v in parse_qs(u.query).items()}

    def do_GET(self):
        parts, q = self._route()
        api = self.api
        if parts == ["", "version"]:
            return self._send(200, {"major": "1", "minor": "30", "gitVersion": "v1.30.0-fake"})
        if len(parts) in (7, 8) and parts[1:5] == ["apis", "batch", "v1", "namespaces"] and parts[6] == "jobs":
            ns = parts[5]
            with api.lock:
                if len(parts) == 7:
                    items = [_public(o) for (n, _), o in api.jobs.items()
                             if n == ns and _matches(o["metadata"].get("labels") or {}, q.get("labelSelector"))]
                    return self._send(200, {"kind": "JobList", "apiVersion": "batch/v1",
                                            "metadata": {"resourceVersion": str(api.rv)}, "items": items})
                obj = api.jobs.get((ns, parts[7]))
                if obj is None:
                    return self._status(404, "NotFound", f'jobs.batch "{parts[7]}" not found')
                return self._send(200, _public(obj))
        if len(parts) >= 6 and parts[1:3] == ["api", "v1"] and parts[3] == "namespaces":
            ns, kind = parts[4], parts[5]
            store = api.pods if kind == "pods" else api.secrets if kind == "secrets" else None
            if store is None:
                return self._status(404, "NotFound", f"unknown resource {kind}")
            if len(parts) == 6 and kind == "pods" and q.get("watch") in ("true", "1"):
                return self._watch(ns, q)
            with api.lock:
                if len(parts) == 6:
                    items = [_public(o) for (n, _), o in store.items()
                             if n == ns and _matches(o["metadata"].get("labels") or {}, q.get("labelSelector"))]
                    return self._send(200, {"kind": "PodList" if kind == "pods" else "SecretList",
                                            "apiVersion": "v1", "metadata": {"resourceVersion": str(api.rv)},
                                            "items": items})
                obj = store.get((ns, parts[6]))
                if obj is None:
                    return self._status(404, "NotFound", f'{kind[:-1]} "{parts[6]}" not found')
                if len(parts) == 8 and parts[7] == "log":
                    text = api.log(ns, parts[6], int(q["tailLines"]) if "tailLines" in q else None)
                    return self._send(200, text or "", "text/plain")
                return self._send(200, _public(obj))
        return self._status(404, "NotFound", f"no route {self.path}")

    def _watch(self, ns: str, q: dict) -> None:
        """Stream pod events after ``resourceVersion`` (one JSON line each) until
        ``timeoutSeconds``; HTTP/1.0, so the stream ends when the connection closes."""
        api = self.api
        api.watches += 1
        since = int(q.get("resourceVersion") or 0)
        deadline = time.monotonic() + float(q.get("timeoutSeconds") or 30)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        try:
            while time.monotonic() < deadline and not api._stop.is_set():
                with api.lock:
                    new = [(rv, t, o) for rv, t, o in api.events if rv > since and o["metadata"]["namespace"] == ns
                           and _matches(o["metadata"].get("labels") or {}, q.get("labelSelector"))]
                for rv, kind, obj in new:
                    self.wfile.write(json.dumps({"type": kind, "object": obj}).encode() + b"\n")
                    since = max(since, rv)
                if new:
                    self.wfile.flush()
                time.sleep(0.02)
        except (BrokenPipeError, ConnectionResetError):
            pass
        self.close_connection = True

    def do_POST(self):
        parts, _ = self._route()
        api = self.api
        if len(parts) == 7 and parts[1:5] == ["apis", "batch", "v1", "namespaces"] and parts[6] == "jobs":
            if "batch" in api.unserved:
                return self._status(404, "NotFound", "the server could not find the requested resource")
            if "jobs" in api.forbidden:
                return self._status(403, "Forbidden", f'jobs.batch is forbidden: User "fake" cannot create resource '
                                                      f'"jobs" in API group "batch" in the namespace "{parts[5]}"')
            code, obj = api.create_job(parts[5], self._body())
            if code != 201:
                return self._status(code, obj["reason"], obj["message"])
            return self._send(201, _public(obj))
        if len(parts) == 6 and parts[1:4] == ["api", "v1", "namespaces"]:
            ns, kind, body = parts[4], parts[5], self._body()
            if kind == "pods":
                pod = api.create_pod(ns, body)
                if pod is None:
                    return self._status(409, "AlreadyExists", f'pods "{body["metadata"]["name"]}" already exists')
                return self._send(201, _public(pod))
            if kind == "secrets":
                name = body["metadata"]["name"]
                with api.lock:
                    if (ns, name) in api.secrets:
                        return self._status(409, "AlreadyExists", f'secrets "{name}" already exists')
                    body["metadata"].update(namespace=ns, uid=str(uuid.uuid4()), creationTimestamp=_now())
                    api.secrets[(ns, name)] = body
                    api.created.append(body)
                return self._send(201, body)
        return self._status(404, "NotFound", f"no route {self.path}")

    def do_PATCH(self):
        """Secrets: a JSON merge patch (what the jobs send: metadata.ownerReferences)."""
        parts, _ = self._route()
        api = self.api
        if len(parts) == 7 and parts[1:4] == ["api", "v1", "namespaces"] and parts[5] == "secrets":
            patch = self._body()
            with api.lock:
                obj = api.secrets.get((parts[4], parts[6]))
                if obj is None:
                    return self._status(404, "NotFound", f'secrets "{parts[6]}" not found')
                _merge(obj, patch)
                return self._send(200, _public(obj))
        return self._status(404, "NotFound", f"no route {self.path}")

    def do_DELETE(self):
        parts, q = self._route()
        api = self.api
        if len(parts) == 8 and parts[1:5] == ["apis", "batch", "v1", "namespaces"] and parts[6] == "jobs":
            body = self._body()
            job = api.delete_job(parts[5], parts[7], body.get("propagationPolicy") or q.get("propagationPolicy")
                                 or "Background")
            if job is None:
                return self._status(404, "NotFound", f'jobs.batch "{parts[7]}" not found')
            return self._send(200, _public(job))
        if len(parts) == 7 and parts[1:4] == ["api", "v1", "namespaces"]:
            ns, kind, name = parts[4], parts[5], parts[6]
            if kind == "pods":
                pod = api.delete_pod(ns, name)
            else:
                with api.lock:
                    pod = api.secrets.pop((ns, name), None)
            if pod is None:
                return self._status(404, "NotFound", f'{kind[:-1]} "{name}" not found')
            return self._send(200, _public(pod))
        return self._status(404, "NotFound", f"no route {self.path}")
