"""Workloads on the real nodes: scheduling, ReplicaSet replacement, and service-account authorization in a pod."""

from __future__ import annotations

import pytest
from kubernetes import client

from tests.support.cluster import Kube
from tests.support.podspecs import IMAGE, SLEEPER, describe_pods, python_pod, wait_exit_code
from tests.support.polling import wait_for

pytestmark = pytest.mark.cluster


def _running_pods(kube: Kube, namespace: str, selector: str) -> list[client.V1Pod]:
    pods = kube.core.list_namespaced_pod(namespace, label_selector=selector).items
    return [p for p in pods if p.status.phase == "Running" and not p.metadata.deletion_timestamp]


def test_deployment_pod_is_scheduled_and_replaced_after_deletion(kube: Kube, namespace: str) -> None:
    labels = {"app": "sleeper"}
    container = client.V1Container(name="main", image=IMAGE, command=["python", "-c", SLEEPER])
    template = client.V1PodTemplateSpec(
        metadata=client.V1ObjectMeta(labels=labels),
        spec=client.V1PodSpec(containers=[container], termination_grace_period_seconds=2),
    )
    spec = client.V1DeploymentSpec(replicas=1, selector=client.V1LabelSelector(match_labels=labels), template=template)
    kube.apps.create_namespaced_deployment(
        namespace, client.V1Deployment(metadata=client.V1ObjectMeta(name="sleeper"), spec=spec)
    )

    first = wait_for(
        lambda: _running_pods(kube, namespace, "app=sleeper"),
        60,
        "the deployment's pod to run",
        describe=lambda: describe_pods(kube.core, namespace),
    )[0]
    assert first.spec.node_name, "a Running pod must have been bound to a node by the scheduler"
    assert first.status.pod_ip

    kube.core.delete_namespaced_pod(first.metadata.name, namespace)
    replacement = wait_for(
        lambda: [p for p in _running_pods(kube, namespace, "app=sleeper") if p.metadata.uid != first.metadata.uid],
        60,
        "a replacement pod to run",
        describe=lambda: describe_pods(kube.core, namespace),
    )[0]
    assert replacement.metadata.name != first.metadata.name
    wait_for(
        lambda: all(p.metadata.uid != first.metadata.uid for p in kube.core.list_namespaced_pod(namespace).items),
        60,
        "the deleted pod to be gone",
    )


# Lists pods in its own namespace with the in-pod service account token; exit 0 = allowed, 1 = forbidden.
LIST_PODS_WITH_TOKEN = """
import json, os, ssl, sys, urllib.error, urllib.request
sa = "/var/run/secrets/kubernetes.io/serviceaccount"
token = open(f"{sa}/token").read().strip()
ns = open(f"{sa}/namespace").read().strip()
host = os.environ["KUBERNETES_SERVICE_HOST"]
port = os.environ["KUBERNETES_SERVICE_PORT"]
ctx = ssl.create_default_context(cafile=f"{sa}/ca.crt")
req = urllib.request.Request(f"https://{host}:{port}/api/v1/namespaces/{ns}/pods",
                             headers={"Authorization": f"Bearer {token}"})
try:
    with urllib.request.urlopen(req, timeout=10, context=ctx) as resp:
        print("allowed:", len(json.load(resp)["items"]), "pods")
        sys.exit(0)
except urllib.error.HTTPError as e:
    print("HTTP", e.code, e.read()[:200])
    sys.exit(1 if e.code == 403 else 2)
"""


def test_service_account_token_is_forbidden_without_role_and_allowed_with_one(kube: Kube, namespace: str) -> None:
    kube.core.create_namespaced_service_account(
        namespace, client.V1ServiceAccount(metadata=client.V1ObjectMeta(name="reader"))
    )

    def exit_code(name: str) -> int:
        pod = python_pod(name, LIST_PODS_WITH_TOKEN, service_account_name="reader")
        kube.core.create_namespaced_pod(namespace, pod)
        return wait_exit_code(kube.core, namespace, name, timeout=90)

    assert exit_code("without-role") == 1, "the API must answer 403 to a service account without a Role"

    rule = client.V1PolicyRule(api_groups=[""], resources=["pods"], verbs=["list"])
    kube.rbac.create_namespaced_role(
        namespace, client.V1Role(metadata=client.V1ObjectMeta(name="pod-reader"), rules=[rule])
    )
    kube.rbac.create_namespaced_role_binding(
        namespace,
        client.V1RoleBinding(
            metadata=client.V1ObjectMeta(name="reader-can-list"),
            role_ref=client.V1RoleRef(api_group="rbac.authorization.k8s.io", kind="Role", name="pod-reader"),
            subjects=[client.RbacV1Subject(kind="ServiceAccount", name="reader", namespace=namespace)],
        ),
    )
    assert exit_code("with-role") == 0, "the Role bound to the service account must allow listing pods"
