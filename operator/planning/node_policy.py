"""The opt-in, operator-wide node rule: cordon a node after K replica-group failures on it within a window, counted
across every job this operator runs, with an Event on the Node. Off unless ``--cordon-after-failures`` is given."""

from __future__ import annotations

import logging
import time

from ftjob.operator.planning.node_health import NodeFailureTracker
from ftjob.operator.resources.kubeapi import KubeApi

log = logging.getLogger("ftjob.operator.nodes")


class NodePolicy:
    def __init__(self, kube: KubeApi, threshold: int | None = None, window_s: float = 3600.0) -> None:
        self.kube = kube
        self.tracker = NodeFailureTracker(threshold, window_s) if threshold else None

    async def group_failed(self, node: str, namespace: str, job: str) -> None:
        if self.tracker is None or not self.tracker.record(node, time.time()):
            return
        why = (
            f"{self.tracker.count(node)} replica-group failures on this node within {self.tracker.window_s:g}s "
            f"(the last: job {namespace}/{job}); cordoned by ftjob-operator --cordon-after-failures "
            f"{self.tracker.threshold}: uncordon it (kubectl uncordon {node}) once it is repaired"
        )
        log.warning("cordoning node %s: %s", node, why)
        if await self.kube.cordon_node(node):
            await self.kube.post_node_event(namespace, node, "Warning", "CordonedByFtjob", why)
