"""Which nodes are going bad before they fail: the node facts the operator watches, the job's `nodeHealth` policy
(node conditions and taints that mean "degrading", cordoned nodes) and the verdict for one node. Pure data, no
Kubernetes client: the planner migrates a group off a node this module calls degrading (make-before-break).

Also the opt-in, operator-wide rule "cordon a node after K group failures on it within a window" (across jobs).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# NoExecute taints the node lifecycle controller sets on a lost node: that is a lost node (replaced at once), not a
# degrading one.
LOST_NODE_TAINTS = frozenset({"node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable"})
CORDON_TAINT = "node.kubernetes.io/unschedulable"


@dataclass(frozen=True)
class NodeView:
    """What the operator keeps of a Node object."""

    ready: bool
    unschedulable: bool = False
    conditions: tuple[tuple[str, str, str], ...] = ()  # (type, status, message)
    taints: tuple[tuple[str, str, str], ...] = ()  # (key, value, effect)
    address: str = ""  # its InternalIP: where the operator asks the kubelet whether the node still answers
    kubelet_port: int = 0  # status.daemonEndpoints.kubeletEndpoint.Port

    @classmethod
    def from_node(cls, spec: Mapping[str, Any], status: Mapping[str, Any]) -> NodeView:
        conds = status.get("conditions") or []
        return cls(
            ready=any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds),
            unschedulable=bool(spec.get("unschedulable", False)),
            conditions=tuple(
                (str(c.get("type", "")), str(c.get("status", "")), str(c.get("message") or "")[:200]) for c in conds
            ),
            taints=tuple(
                (str(t.get("key", "")), str(t.get("value") or ""), str(t.get("effect", "")))
                for t in spec.get("taints") or []
            ),
            address=next(
                (str(a.get("address", "")) for a in status.get("addresses") or [] if a.get("type") == "InternalIP"), ""
            ),
            kubelet_port=int(((status.get("daemonEndpoints") or {}).get("kubeletEndpoint") or {}).get("Port") or 0),
        )


@dataclass(frozen=True)
class NodeHealthPolicy:
    """`spec.nodeHealth` as the planner reads it: what makes a node degrading for this job, and whether its groups
    move off it. No defaults here: ftjob.operator.state.job_spec.NodeHealthSpec declares them (next to the CRD's) and
    builds this policy."""

    migrate: bool
    conditions: tuple[tuple[str, str], ...]  # (type, status) pairs
    taints: tuple[tuple[str, str], ...]  # (key, effect); effect "" matches any effect
    no_execute_taints: bool
    cordoned: bool

    def degraded(self, node: NodeView) -> str | None:
        """Why this node is degrading (a line for Events and status), or None while it is healthy."""
        if not self.migrate:
            return None
        for ctype, status, message in node.conditions:
            if (ctype, status) in self.conditions:
                return f"condition {ctype}={status}" + (f" ({message})" if message else "")
        for key, value, effect in node.taints:
            if key in LOST_NODE_TAINTS or (key == CORDON_TAINT and not self.cordoned):
                continue
            listed = any(k == key and (not e or e == effect) for k, e in self.taints)
            if listed or (self.no_execute_taints and effect == "NoExecute"):
                return f"taint {key}{'=' + value if value else ''}:{effect}"
        if self.cordoned and node.unschedulable:
            return "cordoned (spec.unschedulable)"
        return None


def degraded_nodes(policy: NodeHealthPolicy, nodes: Mapping[str, NodeView] | None) -> dict[str, str]:
    """node -> why it is degrading, for the nodes this policy calls degrading."""
    out: dict[str, str] = {}
    for name, node in (nodes or {}).items():
        why = policy.degraded(node)
        if why is not None:
            out[name] = why
    return out


@dataclass
class NodeFailureTracker:
    """Group failures per node within a sliding window, across every job of this operator; ``record`` says when a
    node reached ``threshold`` (once per node until it is forgotten)."""

    threshold: int
    window_s: float
    _failures: dict[str, deque[float]] = field(default_factory=dict)
    _flagged: set[str] = field(default_factory=set)

    def record(self, node: str, now: float) -> bool:
        times = self._failures.setdefault(node, deque())
        times.append(now)
        while times and times[0] < now - self.window_s:
            times.popleft()
        if len(times) >= self.threshold and node not in self._flagged:
            self._flagged.add(node)
            return True
        return False

    def count(self, node: str) -> int:
        return len(self._failures.get(node, ()))
