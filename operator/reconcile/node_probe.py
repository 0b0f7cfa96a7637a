"""Whether a node still answers, asked directly: a TCP connection to its kubelet's port.

Kubernetes marks a dead node NotReady only after the controller-manager's node-monitor grace period (40 s by
default), while the lighthouse drops the node's groups within a heartbeat. When every group of a job on a node has
left the lighthouse, the reconciler asks the node itself: a kubelet that refuses or ignores a connection means the
node is gone for this job's purposes, and its groups are replaced at once (as for a NotReady node). Nothing here
decides on its own: a node that answers, or that has a group still in the lighthouse, is never called lost.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping

from ftjob.operator.planning.node_health import NodeView

CONNECT_TIMEOUT_S = 1.0  # a live kubelet accepts at once; a dead node's address refuses or stays silent
ANSWER_TTL_S = 2.0  # one probe per node per reconcile burst, however many jobs ask


class NodeProbe:
    """Asks nodes' kubelets whether they still accept connections, remembering each answer briefly."""

    def __init__(self, connect_timeout_s: float = CONNECT_TIMEOUT_S, ttl_s: float = ANSWER_TTL_S) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.ttl_s = ttl_s
        self._answers: dict[str, tuple[float, bool]] = {}  # node -> (when asked, answered)

    async def not_answering(self, nodes: Mapping[str, NodeView], names: Iterable[str]) -> set[str]:
        """The named nodes whose kubelet does not accept a connection. A node with no known address or kubelet
        port cannot be asked and is never reported."""
        names = [n for n in dict.fromkeys(names) if n in nodes and nodes[n].address and nodes[n].kubelet_port]
        answers = await asyncio.gather(*(self._answers_now(n, nodes[n]) for n in names))
        return {n for n, answered in zip(names, answers, strict=True) if not answered}

    async def _answers_now(self, name: str, node: NodeView) -> bool:
        now = time.monotonic()
        cached = self._answers.get(name)
        if cached is not None and now - cached[0] < self.ttl_s:
            return cached[1]
        answered = await self._connects(node.address, node.kubelet_port)
        self._answers[name] = (time.monotonic(), answered)
        return answered

    async def _connects(self, host: str, port: int) -> bool:
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), self.connect_timeout_s)
        except (TimeoutError, OSError):
            return False
        writer.close()
        try:
            await writer.wait_closed()
        except OSError:
            pass
        return True
