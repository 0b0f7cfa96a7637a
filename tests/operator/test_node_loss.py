"""A node lost under a running job (its network cut: the pods' processes live on but the node stops reporting): the
operator replaces only the group on that node, on another node, and does not leave its pod Terminating forever."""

from __future__ import annotations

import pytest

from tests.support.cluster import cluster
from tests.support.operator_cluster import (
    get_job,
    job_manifest,
    place_by_cordoning,
    running_groups,
)
from tests.support.polling import wait_for

pytestmark = pytest.mark.cluster


def test_lost_node_replaces_only_its_group_elsewhere(kube, namespace, operators, two_nodes):
    node_a, node_b = two_nodes
    operators()
    # the lighthouse and group 0 on node A, group 1 alone on node B
    before = place_by_cordoning(kube, namespace, job_manifest("nl", replicas=1), node_a, node_b, replicas=2)
    victim = before[1][0].metadata.name

    cluster("cut-node", node_b)

    after = wait_for(lambda: (g := running_groups(kube.core, namespace, "nl")) and len(g) == 2
                     and g[1][0].metadata.name != victim and g, 120, "group 1 replaced")  # fmt: skip
    assert after[1][0].spec.node_name == node_a, "the replacement must avoid the lost node"
    assert after[0][0].metadata.uid == before[0][0].metadata.uid, "group 0 must not be touched"
    # Node B cannot confirm a graceful deletion: the operator deletes the old pod with no grace instead.
    names = lambda: {p.metadata.name for p in kube.core.list_namespaced_pod(namespace).items}  # noqa: E731
    wait_for(lambda: victim not in names(), 60, f"{victim} gone from the API although its node is cut off")
    status = get_job(kube.custom, namespace, "nl")["status"]
    assert status["restartsByReason"] == {"NodeLost": 1}, status
