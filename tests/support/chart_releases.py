"""Real `helm install`s and scratch namespaces for the chart tests, as context managers that always clean up."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from kubernetes import client

from tests.support.cluster import OPERATOR_IMAGE
from tests.support.helm import CHART, ok, release_name, run, service_account, set_args


@dataclass
class Release:
    name: str
    namespace: str
    service_account: str

    @property
    def user(self) -> str:
        return f"system:serviceaccount:{self.namespace}:{self.service_account}"


@contextlib.contextmanager
def scratch_namespace(kube: Any, stem: str = "chart-other") -> Iterator[str]:
    """A fresh namespace (e.g. one the operator must NOT be able to touch), deleted afterwards."""
    name = f"{stem}-{uuid.uuid4().hex[:6]}"
    kube.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    try:
        yield name
    finally:
        kube.core.delete_namespace(name, propagation_policy="Background")


@contextlib.contextmanager
def helm_release(
    kube: Any, namespace: str, values: dict[str, str] | None = None, wait: bool = False, timeout_s: int = 180
) -> Iterator[Release]:
    """`helm install` the chart into `namespace`; `helm uninstall` afterwards even if the test failed."""
    rel = Release(release_name(), namespace, "")
    rel.service_account = service_account(rel.name)
    repository, tag = OPERATOR_IMAGE.rsplit(":", 1)  # the image hack/cluster built from this checkout
    values = {"image.repository": repository, "image.tag": tag, **(values or {})}
    args = ["helm", "install", rel.name, str(CHART), "-n", namespace, *set_args(values)]
    if wait:
        args += ["--wait", "--timeout", f"{timeout_s}s"]
    try:
        ok(args, kube.kubeconfig, timeout=timeout_s + 60)
        yield rel
    finally:
        run(["helm", "uninstall", rel.name, "-n", namespace, "--wait", "--timeout", "120s"], kube.kubeconfig)
