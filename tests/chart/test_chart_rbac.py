"""The operator's ServiceAccount can do exactly what the operator needs: an RBAC matrix checked by the real apiserver
with `kubectl auth can-i --as=system:serviceaccount:<ns>:<sa>` after a real `helm install`."""

from __future__ import annotations

import json

import pytest

from tests.support.chart_releases import Release, helm_release, scratch_namespace
from tests.support.helm import ok, run

pytestmark = pytest.mark.cluster

FTJ = "faulttoleranttrainingjobs.ftjob.dev"
# RBAC is judged on the objects alone: no operator pod runs, so a cluster-wide one never acts on other tests' jobs.
NO_POD = {"replicaCount": "0"}
LEASES = "leases.coordination.k8s.io"

# (verb, what): `what` is kubectl's TYPE[/NAME] plus an optional ` --subresource=X`
# (never TYPE/X for a subresource: kubectl reads that as the object named X).
MUST_IN_WATCHED = [  # operator/RBAC.md
    ("create", "pods"),
    ("delete", "pods"),
    ("list", "pods"),
    ("watch", "pods"),
    ("patch", "pods --subresource=status"),  # the readiness gate's condition
    ("create", "poddisruptionbudgets.policy"),
    ("patch", "poddisruptionbudgets.policy"),
    ("create", "services"),
    ("delete", "services"),
    ("create", "secrets"),
    ("get", "secrets"),
    ("list", FTJ),
    ("watch", FTJ),
    ("delete", FTJ),
    ("patch", f"{FTJ} --subresource=status"),
    ("update", f"{FTJ} --subresource=finalizers"),
    ("create", "events"),
]
MUST_NOT_ANYWHERE = [
    ("list", "secrets"),  # it reads only its jobs' Secrets, by name
    ("delete", "secrets"),
    ("patch", "pods"),
    ("update", "pods"),
    ("update", "pods --subresource=status"),
    ("delete", "poddisruptionbudgets.policy"),  # the garbage collector removes it with its job
    ("patch", FTJ),  # the spec belongs to the user
    ("update", FTJ),
    ("create", "pods --subresource=exec"),
    ("create", "pods --subresource=attach"),
    ("get", "pods --subresource=log"),
    ("create", "roles.rbac.authorization.k8s.io"),
    ("create", "rolebindings.rbac.authorization.k8s.io"),
    ("*", "*"),
    ("create", "serviceaccounts --subresource=token"),
    ("update", f"{FTJ} --subresource=scale"),
    ("delete", "persistentvolumeclaims"),
    ("create", "deployments.apps"),
]
MUST_NOT_CLUSTER = [
    ("update", "nodes"),
    ("patch", "nodes"),
    ("delete", "nodes"),
    ("create", "clusterrolebindings.rbac.authorization.k8s.io"),
    ("escalate", "clusterroles.rbac.authorization.k8s.io"),
    ("bind", "clusterroles.rbac.authorization.k8s.io"),
    ("impersonate", "users"),
    ("impersonate", "serviceaccounts"),
    ("create", "customresourcedefinitions.apiextensions.k8s.io"),
    ("delete", "namespaces"),
    ("list", "namespaces"),
    ("create", "certificatesigningrequests.certificates.k8s.io"),
    ("create", "validatingwebhookconfigurations.admissionregistration.k8s.io"),
]
MUST_CLUSTER = [("list", "nodes"), ("watch", "nodes")]


def can_i(kube, rel: Release, verb: str, resource: str, namespace: str | None) -> bool:
    """The apiserver's answer for the release's ServiceAccount (exit 0 = yes, 1 = no, anything else = broken)."""
    where = ["-n", namespace] if namespace else []
    args = ["kubectl", "auth", "can-i", verb, *resource.split(), f"--as={rel.user}", *where]
    proc = run(args, kube.kubeconfig)
    answer = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert answer in ("yes", "no"), f"kubectl auth can-i {verb} {resource} gave no answer: {proc.stdout}{proc.stderr}"
    return answer == "yes"


def check_matrix(kube, rel: Release, expectations: list[tuple[str, str, str | None, bool]]) -> None:
    """All answers are collected first so one run shows every wrong permission, not just the first."""
    wrong = []
    for verb, resource, ns, want in expectations:
        got = can_i(kube, rel, verb, resource, ns)
        if got != want:
            wrong.append(f"{'CAN' if got else 'CANNOT'} {verb} {resource} in {ns or 'cluster scope'} (want {want})")
    assert not wrong, "RBAC differs from least privilege:\n  " + "\n  ".join(wrong)


def assert_not_bound_to_admin_roles(kube, rel: Release) -> None:
    """No (Cluster)RoleBinding anywhere hands this ServiceAccount cluster-admin, admin or edit."""
    bindings = json.loads(
        ok(["kubectl", "get", "clusterrolebindings,rolebindings", "-A", "-o", "json"], kube.kubeconfig)
    )
    for b in bindings["items"]:
        subjects = b.get("subjects") or []
        ours = any(
            s.get("kind") == "ServiceAccount"
            and s.get("name") == rel.service_account
            and s.get("namespace") == rel.namespace
            for s in subjects
        )
        if ours:
            assert b["roleRef"]["name"] not in ("cluster-admin", "admin", "edit"), b["metadata"]


def lease_expectations(rel: Release) -> list[tuple[str, str, str | None, bool]]:
    lease = f"{LEASES}/{rel.name}-ftjob-operator-leader"
    return [
        ("get", lease, rel.namespace, True),
        ("update", lease, rel.namespace, True),
        ("create", LEASES, rel.namespace, True),  # re-creates its Lease should someone delete it
        ("update", f"{LEASES}/someone-elses-lease", rel.namespace, False),
        ("delete", lease, rel.namespace, False),
        ("update", lease, "kube-system", False),
        ("create", LEASES, "kube-system", False),
    ]


def test_namespaced_mode_grants_only_the_watched_namespace(kube, namespace: str) -> None:
    # The operator lives in `namespace` and watches only `namespace`; `other` is someone else's.
    with (
        scratch_namespace(kube) as other,
        helm_release(kube, namespace, {"watchNamespaces": f"{{{namespace}}}", **NO_POD}) as rel,
    ):
        watched = namespace
        expect = [(v, r, watched, True) for v, r in MUST_IN_WATCHED]
        expect += [(v, r, other, False) for v, r in MUST_IN_WATCHED]  # nothing at all outside its namespaces
        expect += [(v, r, "kube-system", False) for v, r in MUST_IN_WATCHED]
        expect += [(v, r, ns, False) for v, r in MUST_NOT_ANYWHERE for ns in (watched, other)]
        expect += [("get", "secrets", other, False), ("get", "secrets", "kube-system", False)]
        expect += [("list", FTJ, None, False)]  # not cluster-wide
        expect += [(v, r, None, False) for v, r in MUST_NOT_CLUSTER]
        expect += [(v, r, None, True) for v, r in MUST_CLUSTER]
        expect += lease_expectations(rel)
        check_matrix(kube, rel, expect)
        assert_not_bound_to_admin_roles(kube, rel)


def test_cluster_wide_mode_manages_jobs_everywhere_but_nothing_more(kube, namespace: str) -> None:
    with scratch_namespace(kube) as other, helm_release(kube, namespace, NO_POD) as rel:
        expect = [(v, r, ns, True) for v, r in MUST_IN_WATCHED for ns in (namespace, other)]
        expect += [(v, r, ns, False) for v, r in MUST_NOT_ANYWHERE for ns in (namespace, other, "kube-system")]
        expect += [(v, r, None, False) for v, r in MUST_NOT_CLUSTER]
        expect += [(v, r, None, True) for v, r in MUST_CLUSTER]
        expect += [("list", "secrets", None, False), ("list", FTJ, None, True)]
        expect += lease_expectations(rel)
        check_matrix(kube, rel, expect)
        assert_not_bound_to_admin_roles(kube, rel)
