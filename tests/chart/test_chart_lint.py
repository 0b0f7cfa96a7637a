"""`helm lint` (also --strict) is clean for the default values and for every mode the chart offers."""

from __future__ import annotations

import pytest
from ftjob import contract

from tests.support.helm import CHART, ok, render, set_args

MODES = {
    "defaults": {},
    "namespaced": {"watchNamespaces": "{team-a,team-b}"},
    "ha": {"replicaCount": "2"},
    "everything-on": {
        "watchNamespaces": "{team-a}",
        "networkPolicy.enabled": "true",
        "metrics.serviceMonitor.enabled": "true",
        "logLevel": "debug",
        "image.digest": "sha256:" + "a" * 64,
    },
    "single-no-lease": {"leaderElection.enabled": "false"},
}


@pytest.mark.parametrize("strict", [False, True], ids=["lint", "lint-strict"])
@pytest.mark.parametrize("mode", MODES, ids=list(MODES))
def test_helm_lint_is_clean(mode: str, strict: bool) -> None:
    out = ok(["helm", "lint", str(CHART), *(["--strict"] if strict else []), *set_args(MODES[mode])])
    assert "0 chart(s) failed" in out
    assert "[WARNING]" not in out and "[ERROR]" not in out, out


def _deployment(objs: list[dict]) -> dict:
    return next(o for o in objs if o["kind"] == "Deployment")


def test_operator_pod_is_locked_down() -> None:
    pod = _deployment(render("lock", "ops"))["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] > 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (container,) = pod["containers"]
    sc = container["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert container["resources"]["requests"] and container["resources"]["limits"]
    health = next(p["containerPort"] for p in container["ports"] if p["name"] == "health")
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"]["port"] == "health", probe
    assert f"--health-port={health}" in container["args"]
    assert pod["serviceAccountName"] == "lock-ftjob-operator"


def test_mode_flags() -> None:
    args = _deployment(render("m", "ops"))["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--all-namespaces" in args and "--leader-election" in args and "--lease-namespace=ops" in args
    ns_args = _deployment(render("m", "ops", {"watchNamespaces": "{a,b}", "leaderElection.enabled": "false"}))
    args = ns_args["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=a" in args and "--namespace=b" in args and "--all-namespaces" not in args
    assert "--no-leader-election" in args
    assert ns_args["spec"]["strategy"] == {"type": "Recreate"}, "without a Lease two pods must never overlap"


def test_every_object_carries_the_standard_labels() -> None:
    objs = render("lab", "ops", MODES["everything-on"])
    for o in objs:
        if o["kind"] == "CustomResourceDefinition":
            continue  # the CRD is shared by every release: no release labels
        labels = o["metadata"].get("labels", {})
        for key in (
            "app.kubernetes.io/name",
            "app.kubernetes.io/instance",
            "app.kubernetes.io/version",
            "app.kubernetes.io/managed-by",
            "helm.sh/chart",
        ):
            assert key in labels, f"{o['kind']}/{o['metadata']['name']} lacks label {key}"


def test_optional_objects_are_off_by_default_and_render_when_enabled() -> None:
    kinds = {o["kind"] for o in render("opt", "ops")}
    assert "ServiceMonitor" not in kinds and "NetworkPolicy" not in kinds
    objs = render("opt", "ops", MODES["everything-on"])
    monitor = next(o for o in objs if o["kind"] == "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    # The operator's `namespace` label is the job's, not the scrape target's: Prometheus must keep it.
    assert all(e["honorLabels"] is True for e in monitor["spec"]["endpoints"])
    policy = next(o for o in objs if o["kind"] == "NetworkPolicy")
    assert policy["metadata"]["namespace"] == "team-a"
    # The policy must select what the operator labels lighthouse pods with, and open exactly the lighthouse port.
    assert policy["spec"]["podSelector"]["matchLabels"] == {contract.LABEL_ROLE: contract.ROLE_LIGHTHOUSE}
    assert policy["spec"]["podSelector"]["matchExpressions"] == [{"key": contract.LABEL_JOB, "operator": "Exists"}]
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": contract.LIGHTHOUSE_PORT}]
    workers, operator = rule["from"]
    assert workers["podSelector"]["matchLabels"] == {contract.LABEL_ROLE: contract.ROLE_WORKER}
    assert operator["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "ops"}
