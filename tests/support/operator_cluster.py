"""Helpers for the operator's cluster tests: job manifests, the operator as a real subprocess, and queries."""

from __future__ import annotations

import base64
import http.client
import json
import os
import signal
import subprocess
import sys
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ftjob import contract
from ftjob.contract import pki
from ftjob.contract.lighthouse_api import DroppedEvent, StatusResponse
from ftjob.contract.tls import NamedHTTPSConnection, client_context
from ftjob.operator.state import names
from kubernetes import client

from tests.support.cluster import TRAINER_IMAGE, container_pids
from tests.support.paths import REPO
from tests.support.polling import wait_for
from tests.support.ports import free_port

CRD = REPO / "crds" / "ftjob.dev_faulttoleranttrainingjobs.yaml"
OPERATOR = Path(sys.executable).parent / "ftjob-operator"

# A stand-in for a replica group that is not about training: rank 0 heartbeats to the real lighthouse (so the
# lighthouse knows the group and can be seen evicting it); every rank then idles until killed.
HEARTBEATER = r"""
import json, os, ssl, sys, time, urllib.request, uuid
env = os.environ
# a TLS job (the default): the lighthouse is verified against the job's CA, mounted at FTJOB_TLS_CA_FILE
ctx = ssl.create_default_context(cafile=env["FTJOB_TLS_CA_FILE"]) if env.get("FTJOB_TLS_CA_FILE") else None
print("group", env["FTJOB_REPLICA_GROUP"], "rank", env["RANK"], "of", env["WORLD_SIZE"],
      "master", env["MASTER_ADDR"], "advertise", env["FTJOB_ADVERTISE_ADDR"], flush=True)
if env["RANK"] != "0":
    while True:
        time.sleep(3600)
url = env["FTJOB_LIGHTHOUSE_URL"] + "/v1/heartbeat"
body = json.dumps({"group": env["FTJOB_REPLICA_GROUP"], "incarnation": uuid.uuid4().hex, "step": 0}).encode()
headers = {"Authorization": "Bearer " + env["FTJOB_TOKEN"], "Content-Type": "application/json"}
while True:
    try:
        urllib.request.urlopen(urllib.request.Request(url, data=body, headers=headers), timeout=2, context=ctx).read()
    except Exception as e:
        print("heartbeat:", e, flush=True)
    time.sleep(0.5)
"""


def job_manifest(name: str, *, command: list[str] | None = None, **spec: Any) -> dict[str, Any]:
    """A job whose workers run `command` (default: the heartbeating stand-in) with fast failure settings."""
    container = {
        "name": "trainer",
        "image": TRAINER_IMAGE,
        "command": command or ["python", "-u", "-c", HEARTBEATER],
    }
    body: dict[str, Any] = {
        "replicas": 2,
        "minReplicas": 1,
        "podsPerReplica": 1,
        "template": {"spec": {"terminationGracePeriodSeconds": 2, "containers": [container]}},
        "lighthouse": {"heartbeatTimeoutSeconds": 600},  # so only the operator's eviction can drop a group
        "failurePolicy": {"backoff": {"baseSeconds": 0, "maxSeconds": 0}},
        "nodeHealth": {"cordoned": False},  # tests place pods by cordoning nodes: that must not move groups
    }
    for key, value in spec.items():
        if isinstance(value, dict) and isinstance(body.get(key), dict):
            body[key] = {**body[key], **value}
        else:
            body[key] = value
    return {
        "apiVersion": f"{contract.API_GROUP}/{contract.API_VERSION}",
        "kind": contract.KIND,
        "metadata": {"name": name},
        "spec": body,
    }


@dataclass
class OperatorProc:
    """`ftjob-operator` running as a real process against the test cluster."""

    proc: subprocess.Popen[bytes]
    log: Path
    health_port: int
    metrics_port: int
    args: list[str] = field(default_factory=list)

    def health(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/healthz", timeout=2) as r:
            return json.loads(r.read())

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=2) as r:
            return r.read().decode()

    def logs(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def kill(self) -> None:
        """SIGKILL: no cleanup at all, as when a node dies under the operator."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()


def start_operator(kubeconfig: Path, log: Path, *args: str) -> OperatorProc:
    health, metrics = free_port(), free_port()
    argv = [str(OPERATOR), "--health-port", str(health), "--metrics-port", str(metrics), *args]
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    out = open(log, "ab")  # noqa: SIM115 - the child owns it for its lifetime
    proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    op = OperatorProc(proc, log, health, metrics, argv)

    def up() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"ftjob-operator exited {proc.returncode}:\n{op.logs()[-3000:]}")
        return bool(op.health())

    wait_for(up, 60, "the operator's health endpoint")
    return op


# --- queries --------------------------------------------------------------------------------------------------------
def get_job(custom: client.CustomObjectsApi, ns: str, name: str) -> dict[str, Any]:
    return custom.get_namespaced_custom_object(contract.API_GROUP, contract.API_VERSION, ns, contract.PLURAL, name)


def create_job(custom: client.CustomObjectsApi, ns: str, manifest: dict[str, Any]) -> dict[str, Any]:
    return custom.create_namespaced_custom_object(contract.API_GROUP, contract.API_VERSION, ns, contract.PLURAL,
                                                  manifest)  # fmt: skip


def patch_job(custom: client.CustomObjectsApi, ns: str, name: str, patch: dict[str, Any]) -> None:
    custom.patch_namespaced_custom_object(contract.API_GROUP, contract.API_VERSION, ns, contract.PLURAL, name, patch)


def condition(job: dict[str, Any], ctype: str) -> dict[str, Any] | None:
    for c in (job.get("status") or {}).get("conditions") or []:
        if c.get("type") == ctype and c.get("status") == "True":
            return c
    return None


def worker_pods(core: client.CoreV1Api, ns: str, job: str, live_only: bool = True) -> list[client.V1Pod]:
    sel = f"{contract.LABEL_JOB}={job},{contract.LABEL_ROLE}={contract.ROLE_WORKER}"
    pods = core.list_namespaced_pod(ns, label_selector=sel).items
    if live_only:
        pods = [p for p in pods if p.metadata.deletion_timestamp is None and p.status.phase in ("Pending", "Running")]
    return pods


def running_groups(core: client.CoreV1Api, ns: str, job: str, pods_per_replica: int = 1) -> dict[int, list]:
    """group -> its live pods, for groups whose every rank is Running (one generation)."""
    groups: dict[int, list] = {}
    for p in worker_pods(core, ns, job):
        groups.setdefault(int(p.metadata.labels[contract.LABEL_GROUP]), []).append(p)
    return {
        g: ps
        for g, ps in groups.items()
        if len(ps) == pods_per_replica and all(p.status.phase == "Running" for p in ps)
    }


def set_unschedulable(core: client.CoreV1Api, node: str, value: bool) -> None:
    core.patch_node(node, {"spec": {"unschedulable": value}})


def lighthouse_pod(core: client.CoreV1Api, ns: str, job: str) -> client.V1Pod:
    sel = f"{contract.LABEL_JOB}={job},{contract.LABEL_ROLE}={contract.ROLE_LIGHTHOUSE}"
    pods = [p for p in core.list_namespaced_pod(ns, label_selector=sel).items if p.status.phase == "Running"]
    assert len(pods) == 1, f"expected one running lighthouse pod, found {[p.metadata.name for p in pods]}"
    return pods[0]


def node_ready(core: client.CoreV1Api, node: str) -> bool:
    """Whether the API reports the node Ready (what Kubernetes believes, not whether the node answers)."""
    return any(c.type == "Ready" and c.status == "True" for c in core.read_node(node).status.conditions or [])


def lighthouse_scheduled(core: client.CoreV1Api, ns: str, job: str) -> client.V1Pod | None:
    """The job's one lighthouse pod once the scheduler has placed it (None before, or while there are two)."""
    sel = f"{contract.LABEL_JOB}={job},{contract.LABEL_ROLE}={contract.ROLE_LIGHTHOUSE}"
    pods = [p for p in core.list_namespaced_pod(ns, label_selector=sel).items if p.spec.node_name]
    return pods[0] if len(pods) == 1 else None


def place_by_cordoning(kube: Any, ns: str, manifest: dict[str, Any], node_a: str, node_b: str, replicas: int
                       ) -> dict[int, list[client.V1Pod]]:  # fmt: skip
    """Create the job so that its lighthouse and group 0 run on ``node_a`` and groups 1.. on ``node_b``: one group with
    ``node_b`` cordoned, then scaled to ``replicas`` with ``node_a`` cordoned. Returns the running groups."""
    job = manifest["metadata"]["name"]
    manifest["spec"]["replicas"] = 1
    set_unschedulable(kube.core, node_b, True)
    create_job(kube.custom, ns, manifest)
    wait_for(lambda: len(running_groups(kube.core, ns, job)) == 1, 120, "group 0 running")
    # The lighthouse starts beside group 0, not before it: wait for it too (it is on node A once scheduled).
    lighthouse = wait_for(lambda: lighthouse_scheduled(kube.core, ns, job), 120, "the lighthouse scheduled")
    assert lighthouse.spec.node_name == node_a
    set_unschedulable(kube.core, node_a, True)
    set_unschedulable(kube.core, node_b, False)
    patch_job(kube.custom, ns, job, {"spec": {"replicas": replicas}})
    groups = wait_for(lambda: (g := running_groups(kube.core, ns, job)) and len(g) == replicas and g, 120,
                      f"groups 1..{replicas - 1} running on node B")  # fmt: skip
    assert [groups[i][0].spec.node_name for i in range(replicas)] == [node_a] + [node_b] * (replicas - 1)
    set_unschedulable(kube.core, node_a, False)
    return groups


def secret_value(core: client.CoreV1Api, ns: str, name: str, key: str) -> str | None:
    """A key of a Secret, decoded; None when the Secret does not exist."""
    try:
        secret = core.read_namespaced_secret(name, ns)
    except client.ApiException as e:
        if e.status == 404:
            return None
        raise
    raw = (secret.data or {}).get(key)
    return base64.b64decode(raw).decode() if raw else None


def lighthouse_connection(core: client.CoreV1Api, ns: str, job: str, ip: str, timeout: float = 3
                          ) -> http.client.HTTPConnection:  # fmt: skip
    """A connection to the job's lighthouse at pod IP ``ip``, as the operator makes it: for a TLS job (its Secret
    <job>-tls exists) verified against the job's CA and the lighthouse Service's DNS name; else plain HTTP."""
    ca = secret_value(core, ns, names.tls_secret(job), pki.CA_CERT)
    if ca is None:
        return http.client.HTTPConnection(ip, contract.LIGHTHOUSE_PORT, timeout=timeout)
    server_name = names.lighthouse_dns_names(job, ns)[0]
    return NamedHTTPSConnection(ip, contract.LIGHTHOUSE_PORT, context=client_context(ca_data=ca),
                                server_name=server_name, timeout=timeout)  # fmt: skip


def lighthouse_status(core: client.CoreV1Api, ns: str, job: str) -> StatusResponse:
    """GET /v1/status from the job's lighthouse, by pod IP (the test host reaches pod IPs), with the job's token."""
    pod = lighthouse_pod(core, ns, job)
    token = secret_value(core, ns, names.token_secret(job), contract.TOKEN_SECRET_KEY)
    conn = lighthouse_connection(core, ns, job, pod.status.pod_ip)
    try:
        conn.request("GET", contract.PATH_STATUS, headers={"Authorization": f"Bearer {token}"})
        resp = conn.getresponse()
        body = resp.read()
        assert resp.status == 200, f"lighthouse status answered {resp.status}: {body[:300]!r}"
        return StatusResponse.model_validate_json(body)
    except http.client.HTTPException as e:  # callers retry on OSError, as for a refused connection
        raise OSError(f"lighthouse status: {e!r}") from e
    finally:
        conn.close()


def kill_pod_processes(pod: client.V1Pod) -> int:
    """SIGKILL every process of a pod's containers, as when the trainer crashes or is OOM-killed; the kubelet then
    reports the container terminated with exit code 137. Returns how many were killed."""
    pids = container_pids(pod)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return len(pids)


def pod_log(core: client.CoreV1Api, ns: str, name: str) -> str:
    return core.read_namespaced_pod_log(name, ns)


def dropped_reasons(status: StatusResponse) -> dict[str, str]:
    """group -> why the lighthouse dropped it (the last time), from its history."""
    return {h.group: h.reason for h in status.history if isinstance(h, DroppedEvent)}
