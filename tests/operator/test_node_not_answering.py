"""A node that dies under a running job is acted on when the lighthouse has dropped its groups and the node no longer
answers, not when Kubernetes marks it NotReady: with the controller-manager's stock node-monitor grace period (40 s)
the node is still Ready in the API when the replacements already exist on the other node."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from ftjob import contract
from kubernetes import client

from tests.support.cluster import cluster
from tests.support.operator_cluster import (
    get_job,
    node_ready,
    place_by_cordoning,
    running_groups,
)
from tests.support.polling import wait_for
from tests.support.trainer_runs import training_job

pytestmark = pytest.mark.cluster

STOCK_NODE_MONITOR_GRACE_S = "40"  # kube-controller-manager's default
STEPS = 5000  # far more than the test lasts: the job is still training when the node dies


@pytest.fixture
def stock_node_grace() -> Iterator[None]:
    cluster("node-grace", STOCK_NODE_MONITOR_GRACE_S)
    try:
        yield
    finally:
        cluster("node-grace", "default")


def test_a_dead_node_is_replaced_while_kubernetes_still_calls_it_ready(
    kube, namespace, operators, two_nodes, stock_node_grace, records
):
    node_a, node_b = two_nodes
    operators()
    # the lighthouse and group 0 on node A, groups 1 and 2 on node B
    manifest = training_job("dn", STEPS, records, replicas=1, minReplicas=1)
    before = place_by_cordoning(kube, namespace, manifest, node_a, node_b, replicas=3)

    # every group in the operator's view of the quorum: it has seen each one join before the node dies
    def quorum_size() -> int | None:
        return ((get_job(kube.custom, namespace, "dn").get("status") or {}).get("quorum") or {}).get("size")

    wait_for(lambda: quorum_size() == 3, 300, "all three groups training in one quorum")
    victims = {before[1][0].metadata.name, before[2][0].metadata.name}

    cluster("kill-node", node_b)

    def replaced() -> list[client.V1Pod] | None:
        pods = kube.core.list_namespaced_pod(namespace, label_selector=f"{contract.LABEL_JOB}=dn").items
        new = [p for p in pods if p.metadata.labels.get(contract.LABEL_ROLE) != contract.ROLE_LIGHTHOUSE
               and p.metadata.name not in victims and p.metadata.name != before[0][0].metadata.name]  # fmt: skip
        return new if len(new) == 2 else None

    replacements = wait_for(replaced, 60, "replacements of groups 1 and 2 created")
    assert node_ready(kube.core, node_b), "the replacements must not wait for Kubernetes to mark the node NotReady"
    for pod in replacements:  # the node is lost, not merely where a group failed: avoided strictly
        affinity = pod.spec.affinity.node_affinity if pod.spec.affinity else None
        required = affinity.required_during_scheduling_ignored_during_execution if affinity else None
        terms = required.node_selector_terms if required else []
        assert any(e.values == [node_b] and e.operator == "NotIn" for t in terms for e in t.match_expressions or []), (
            f"{pod.metadata.name} must avoid {node_b} strictly: {pod.spec.affinity}"
        )
    after = wait_for(lambda: (g := running_groups(kube.core, namespace, "dn")) and len(g) == 3
                     and all(g[i][0].metadata.name not in victims for i in (1, 2)) and g, 120,
                     "groups 1 and 2 running again")  # fmt: skip
    assert all(after[i][0].spec.node_name == node_a for i in range(3))
    assert after[0][0].metadata.uid == before[0][0].metadata.uid, "group 0 must not be touched"
    status = get_job(kube.custom, namespace, "dn")["status"]
    assert status["restartsByReason"] == {"NodeLost": 2}, status
    events = kube.core.list_namespaced_event(namespace, field_selector="involvedObject.name=dn").items
    assert any(e.reason == "NodeNotAnswering" for e in events), [(e.reason, e.message) for e in events]
