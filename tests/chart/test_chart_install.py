"""A real `helm install`: the operator runs as a pod under its own ServiceAccount, holds its Lease and reconciles a job
in its namespace; `helm uninstall` then leaves nothing of the release behind (the CRD stays: Helm never deletes CRDs,
which protects every job in the cluster)."""

from __future__ import annotations

import json

import pytest
from ftjob import contract
from kubernetes import client

from tests.support.chart_releases import helm_release
from tests.support.cluster import TRAINER_IMAGE
from tests.support.helm import ok
from tests.support.polling import wait_for

pytestmark = pytest.mark.cluster

# Present in every namespace regardless of the release; events expire on their own.
NAMESPACE_BASELINE = {"serviceaccounts/default", "configmaps/kube-root-ca.crt"}
IGNORED_KINDS = {"events", "events.events.k8s.io"}


def namespaced_objects(kube, namespace: str) -> set[str]:
    kinds = ok(["kubectl", "api-resources", "--verbs=list", "--namespaced", "-o", "name"], kube.kubeconfig).split()
    kinds = [k for k in kinds if k not in IGNORED_KINDS]
    out = ok(["kubectl", "get", ",".join(kinds), "-n", namespace, "-o", "json"], kube.kubeconfig)
    items = json.loads(out)["items"]
    return {f"{resource_of(o)}/{o['metadata']['name']}" for o in items}


def resource_of(obj: dict) -> str:
    group = obj["apiVersion"].rpartition("/")[0]
    plural = obj["kind"].lower() + ("es" if obj["kind"].endswith("s") else "s")
    return plural + (f".{group}" if group else "")


def release_cluster_objects(kube, release: str) -> list[str]:
    sel = f"app.kubernetes.io/instance={release}"
    out = ok(["kubectl", "get", "clusterroles,clusterrolebindings", "-l", sel, "-o", "name"], kube.kubeconfig)
    return out.split()


def tiny_job(name: str) -> dict:
    """A job whose workers only sleep: this test is about the operator acting under its ServiceAccount."""
    worker = {
        "name": "worker",
        "image": TRAINER_IMAGE,
        "command": ["python", "-c", "import time; time.sleep(600)"],
    }
    return {
        "apiVersion": f"{contract.API_GROUP}/{contract.API_VERSION}",
        "kind": contract.KIND,
        "metadata": {"name": name},
        "spec": {"replicas": 2, "minReplicas": 1, "podsPerReplica": 1, "template": {"spec": {"containers": [worker]}}},
    }


def test_install_runs_the_operator_in_cluster_and_uninstall_leaves_nothing(kube, namespace: str) -> None:
    before = wait_for(lambda: namespaced_objects(kube, namespace), 30, "the fresh namespace's default objects")
    assert before <= NAMESPACE_BASELINE, before

    with helm_release(kube, namespace, {"watchNamespaces": f"{{{namespace}}}"}, wait=True) as rel:
        pods = kube.core.list_namespaced_pod(namespace, label_selector=f"app.kubernetes.io/instance={rel.name}").items
        (pod,) = pods
        assert pod.status.phase == "Running"
        assert pod.spec.service_account_name == rel.service_account
        # It is the in-cluster pod (not some other operator) that holds the Lease, with its own token and RBAC.
        lease_name = f"{rel.name}-ftjob-operator-leader"
        leases = client.CoordinationV1Api(kube.api)
        wait_for(
            lambda: leases.read_namespaced_lease(lease_name, namespace).spec.holder_identity == pod.metadata.name,
            60,
            "the operator pod to hold its leader Lease",
        )
        # And it acts: a job in its namespace gets its lighthouse and worker pods from the in-cluster operator.
        kube.custom.create_namespaced_custom_object(
            contract.API_GROUP, contract.API_VERSION, namespace, contract.PLURAL, tiny_job("tiny")
        )
        selector = f"{contract.LABEL_JOB}=tiny"
        made = wait_for(
            lambda: (
                {
                    p.metadata.labels.get(contract.LABEL_ROLE)
                    for p in kube.core.list_namespaced_pod(namespace, label_selector=selector).items
                }
                >= {contract.ROLE_LIGHTHOUSE, contract.ROLE_WORKER}
            ),
            90,
            "the in-cluster operator to create the job's lighthouse and worker pods",
        )
        assert made
        assert release_cluster_objects(kube, rel.name), "the release should own its cluster-read ClusterRole"
        kube.custom.delete_namespaced_custom_object(
            contract.API_GROUP, contract.API_VERSION, namespace, contract.PLURAL, "tiny"
        )
        wait_for(
            lambda: not kube.core.list_namespaced_pod(namespace, label_selector=selector).items,
            90,
            "the job's pods to be garbage-collected",
        )

    # helm_release has run `helm uninstall --wait`.
    assert release_cluster_objects(kube, rel.name) == []

    def only_defaults_left() -> bool:
        left = namespaced_objects(kube, namespace) - NAMESPACE_BASELINE
        if left:
            raise AssertionError(f"left behind: {sorted(left)}")  # wait_for reports the last one on timeout
        return True

    wait_for(only_defaults_left, 60, "the namespace to hold nothing but its defaults")
    crd = ok(["kubectl", "get", "crd", f"{contract.PLURAL}.{contract.API_GROUP}", "-o", "name"], kube.kubeconfig)
    assert crd.strip(), "the CRD must outlive the release (Helm never deletes CRDs)"
