"""The control plane itself: version, garbage collection, service-account controller."""

from __future__ import annotations

import json

import pytest
from kubernetes import client

from tests.support.cluster import Kube, kubectl
from tests.support.polling import wait_for

pytestmark = pytest.mark.cluster


def test_server_reports_v1_36_3(kube: Kube) -> None:
    version = json.loads(kubectl(kube.kubeconfig, "version", "-o", "json").stdout)
    assert version["serverVersion"]["gitVersion"] == "v1.36.3"


def test_namespace_gets_default_service_account(kube: Kube, namespace: str) -> None:
    # the `namespace` fixture already waited (30 s) for the serviceaccount controller to create it
    assert kube.core.read_namespaced_service_account("default", namespace)


def test_owner_reference_garbage_collection(kube: Kube, namespace: str) -> None:
    parent = kube.core.create_namespaced_config_map(
        namespace, client.V1ConfigMap(metadata=client.V1ObjectMeta(name="parent"), data={"k": "v"})
    )
    owner = client.V1OwnerReference(api_version="v1", kind="ConfigMap", name="parent", uid=parent.metadata.uid)
    for i in range(2):
        meta = client.V1ObjectMeta(name=f"child-{i}", owner_references=[owner])
        kube.core.create_namespaced_config_map(namespace, client.V1ConfigMap(metadata=meta, data={"i": str(i)}))
    orphan = client.V1ObjectMeta(name="unowned")
    kube.core.create_namespaced_config_map(namespace, client.V1ConfigMap(metadata=orphan))

    kube.core.delete_namespaced_config_map("parent", namespace, propagation_policy="Background")

    def children_left() -> list[str]:
        names = [cm.metadata.name for cm in kube.core.list_namespaced_config_map(namespace).items]
        return [n for n in names if n.startswith("child-")]

    wait_for(lambda: not children_left(), timeout=30, what="the garbage collector to delete both children")
    # the collector removes dependents only: an object without an owner stays
    assert kube.core.read_namespaced_config_map("unowned", namespace).metadata.name == "unowned"
