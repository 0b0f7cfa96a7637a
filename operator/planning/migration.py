"""Make-before-break migration of replica groups off degrading nodes (spec.nodeHealth), what a drain of such a node
does to a group the migration did not reach first, and the opt-in scheduling deadline
(failurePolicy.unschedulableTimeoutSeconds): pieces of the planner, pure logic."""

from __future__ import annotations

from ftjob.operator.planning.actions import Actions, Event, Observed
from ftjob.operator.planning.failures import Failure, node_is_lost
from ftjob.operator.state.job_spec import ACTION_IGNORE, FailurePolicy, JobSpec
from ftjob.operator.state.job_state import GroupState, JobState, PodView

# A migrating group's old generation leaves by itself once its replacement registers with the lighthouse; if it still
# runs this long after the migration began and the replacement runs, it is deleted.
MIGRATION_HANDOVER_TIMEOUT_S = 300.0
REASON_NODE_DEGRADED = "NodeDegraded"


def unschedulable_too_long(pods: list[PodView], policy: FailurePolicy, now: float, a: Actions) -> str | None:
    """failurePolicy.unschedulableTimeoutSeconds: the scheduler's message once a pod waited longer than that."""
    limit = policy.unschedulable_timeout_s
    if limit is None:
        return None
    for p in pods:
        if p.unschedulable and p.phase == "Pending" and p.created is not None:
            if now - p.created >= limit:
                return (
                    f"pod {p.name} could not be scheduled for {now - p.created:.0f}s "
                    f"(failurePolicy.unschedulableTimeoutSeconds={limit:g}): {p.unschedulable}"
                )
            a.requeue(p.created + limit - now)
    return None


def should_migrate(g: GroupState, current: list[PodView], spec: JobSpec, s: JobState, obs: Observed) -> bool:
    if g.migrating_from is not None or s.completing_since is not None or not g.all_pods_seen:
        return False
    if len(current) != spec.pods_per_replica or not all(p.phase == "Running" for p in current):
        return False
    return any(p.node in obs.degraded_nodes for p in current if p.node)


def drained(current: list[PodView], obs: Observed) -> Failure | None:
    """The group's current generation is going because a pod of it is being deleted, by someone other than this
    operator, on a degrading node: `kubectl drain` cordons (spec.nodeHealth calls a cordoned node degrading) and then
    evicts. Normally the job's PodDisruptionBudget holds the eviction until the migration's replacement has taken
    over, so such a pod is the old generation and no failure at all; this is the rest (a pod evicted before the
    migration reached its group: not in a quorum, or with the operator down). The group leaves the node as a migration
    would, only break-before-make, so its restart spends no budget, and the node is avoided strictly. Whatever else
    the generation's pods show follows from the eviction: the group's other ranks exited 143 with it (it left the job
    together), or failed because it went. None when no pod of the generation was evicted so."""
    for p in current:
        if p.deletion_time is not None and p.name not in obs.deleting and p.node in obs.degraded_nodes:
            why = f"pod {p.name} was evicted from node {p.node}, which is degrading: {obs.degraded_nodes[p.node]}"
            return Failure(REASON_NODE_DEGRADED, why, p.name, p.node, p.exit_code, ACTION_IGNORE, False, True)
    return None


def migrate_group(s: JobState, g: GroupState, current: list[PodView], obs: Observed, a: Actions) -> None:
    """Make-before-break: the replacement generation starts on another node while this one trains on; the lighthouse
    is told first, so the old generation leaves at a step boundary once the new one registers (no abort)."""
    node = next(p.node for p in current if p.node in obs.degraded_nodes)
    why = f"node {node} is degrading: {obs.degraded_nodes[node]}"
    a.handover.append((g.index, why))
    g.migrating_from, g.migrating_since = g.generation, obs.now
    g.generation += 1
    g.generation_since = obs.now
    g.all_pods_seen = False
    g.restarts += 1  # a new generation, but no failure: no budget spent and no back-off
    g.avoid_node, g.avoid_required = node, True
    g.last_failure, g.last_failure_reason = why, REASON_NODE_DEGRADED
    s.restarts_by_reason[REASON_NODE_DEGRADED] = s.restarts_by_reason.get(REASON_NODE_DEGRADED, 0) + 1
    a.restarts.append(REASON_NODE_DEGRADED)
    a.persist_first = True
    a.events.append(
        Event("Warning", "GroupMigrating", f"{why}: replica group {g.index} moves to another node; generation "
              f"{g.generation} starts there first and takes over from generation {g.migrating_from}")
    )  # fmt: skip


def migration_progress(g: GroupState, pods: list[PodView], a: Actions, now: float) -> bool:
    """True while the old generation of a migrating group still runs; ends the migration once it is gone."""
    if g.migrating_from is None:
        return False
    old = [p for p in pods if p.generation == g.migrating_from]
    if not old:
        a.events.append(Event("Normal", "GroupMigrated", f"replica group {g.index} left its degrading node: "
                              f"generation {g.generation} took over"))  # fmt: skip
        g.migrating_from = g.migrating_since = None
        a.persist_first = True
        return False
    a.requeue(5.0)  # notice the old generation's exit, or the hand-over timeout
    return any(p.phase == "Running" and p.deletion_time is None for p in old)


def keep_while_migrating(g: GroupState, p: PodView, new_running: bool, obs: Observed) -> bool:
    """The old generation of a migrating group is left to leave by itself (it exits at a step boundary)."""
    if g.migrating_from is None or p.generation != g.migrating_from or p.terminal:
        return False
    if node_is_lost(p.node, obs.node_ready):
        return False
    since = g.migrating_since or obs.now
    return not (new_running and obs.now - since > MIGRATION_HANDOVER_TIMEOUT_S)
