"""The chart grants exactly what docs/operations/rbac.md says the operator uses: no verb more (least privilege),
no verb less (the operator would fail with 403 in-cluster). The one deliberate extra is documented in the page's
notes."""

from __future__ import annotations

import re

from tests.support.helm import render
from tests.support.paths import REPO

RBAC_DOC = REPO / "docs" / "operations" / "rbac.md"
# The page's notes: with OwnerReferencesPermissionEnforcement on, blockOwnerDeletion needs this. We grant it so the
# chart works on such clusters too; it allows nothing but setting owner references to jobs.
DOCUMENTED_EXTRAS = {("ftjob.dev", "faulttoleranttrainingjobs/finalizers", "update")}


def documented() -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) for every row of the table in docs/operations/rbac.md."""
    rows = set()
    for line in RBAC_DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`"):
            continue
        group = cells[0].split("`")[1].strip('"')
        resource = cells[1].split("`")[1]
        for verb in re.findall(r"`([a-z*]+)`", cells[2]):
            rows.add((group, resource, verb))
    assert rows, f"no API table found in {RBAC_DOC}"
    return rows


def granted(objs: list[dict]) -> set[tuple[str, str, str]]:
    grants = set()
    for o in objs:
        if o["kind"] in ("Role", "ClusterRole"):
            for rule in o["rules"]:
                for g in rule["apiGroups"]:
                    for r in rule["resources"]:
                        for v in rule["verbs"]:
                            grants.add((g, r, v))
    return grants


def test_cluster_wide_grants_equal_the_operator_doc() -> None:
    assert granted(render("doc", "ops")) == documented() | DOCUMENTED_EXTRAS


def test_namespaced_grants_equal_the_operator_doc() -> None:
    assert granted(render("doc", "ops", {"watchNamespaces": "{a,b}"})) == documented() | DOCUMENTED_EXTRAS


def test_the_opt_in_cordon_rule_adds_exactly_node_patch() -> None:
    on = {"nodeHealth.cordonAfterFailures": "3"}
    assert granted(render("doc", "ops", on)) == documented() | DOCUMENTED_EXTRAS | {("", "nodes", "patch")}
    args = next(o for o in render("doc", "ops", on) if o["kind"] == "Deployment")["spec"]["template"]["spec"]
    flags = args["containers"][0]["args"]
    assert "--cordon-after-failures=3" in flags and "--cordon-window=3600" in flags


def test_no_wildcards_anywhere() -> None:
    for g, r, v in granted(render("doc", "ops")):
        assert "*" not in (g, r, v), (g, r, v)
