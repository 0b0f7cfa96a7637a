"""The rendered chart (CRD included) passes the real apiserver's validation: `kubectl apply --dry-run=server`."""

from __future__ import annotations

import pytest

from tests.support.chart_releases import scratch_namespace
from tests.support.helm import CHART, ok, render, set_args

pytestmark = pytest.mark.cluster


def server_dry_run(kube, release_namespace: str, values: dict[str, str]) -> set[str]:
    """Every rendered object must come back from the apiserver as validated; a rejection fails `kubectl apply`."""
    # Server-side dry run runs admission and validation but stores nothing; it needs the target namespaces to exist.
    rendered = ok(["helm", "template", "dry", str(CHART), "-n", release_namespace, "--include-crds", *set_args(values)])
    out = ok(["kubectl", "apply", "--dry-run=server", "-f", "-"], kube.kubeconfig, stdin=rendered)
    validated = {line.split(" ")[0] for line in out.splitlines() if line.endswith("(server dry run)")}
    wanted = set()
    for obj in render("dry", release_namespace, values):
        group = obj["apiVersion"].rpartition("/")[0]
        kind = obj["kind"].lower() + (f".{group}" if group else "")
        wanted.add(f"{kind}/{obj['metadata']['name']}")
    assert wanted <= validated, f"not validated by the server: {sorted(wanted - validated)}\n{out}"
    return wanted


def test_cluster_wide_mode_passes_server_validation(kube, namespace: str) -> None:
    objs = server_dry_run(kube, namespace, {})
    kinds = {o.split("/")[0].split(".")[0] for o in objs}
    assert kinds >= {
        "serviceaccount",
        "clusterrole",
        "clusterrolebinding",
        "role",
        "rolebinding",
        "service",
        "deployment",
        "customresourcedefinition",
    }, kinds


def test_namespaced_mode_with_every_option_passes_server_validation(kube, namespace: str) -> None:
    with scratch_namespace(kube, "chart-watched") as watched:
        values = {
            "watchNamespaces": f"{{{namespace},{watched}}}",
            "networkPolicy.enabled": "true",
            "replicaCount": "2",
            "logLevel": "debug",
            "image.digest": "sha256:" + "0" * 64,
        }
        objs = server_dry_run(kube, namespace, values)
        assert "networkpolicy.networking.k8s.io/dry-ftjob-operator-lighthouse" in objs, objs
        assert "clusterrole.rbac.authorization.k8s.io/dry-ftjob-operator" not in objs, "namespaced: no job ClusterRole"
