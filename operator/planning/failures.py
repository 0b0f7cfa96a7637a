"""Failure policy: what counts as a failed replica group, which rule applies, and whether the budgets allow a restart.

Pure functions over PodViews: no clock, no client (the caller passes `now`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ftjob.operator.state.job_spec import ACTION_FAIL_JOB, ACTION_IGNORE, ACTION_RESTART_GROUP, FailurePolicy
from ftjob.operator.state.job_state import GroupState, PodView

# Failure reasons (also the keys of status.restartsByReason and the metrics' `reason` label)
REASON_EXIT_CODE = "ExitCode"
REASON_OOM_KILLED = "OOMKilled"  # a container exceeded its memory limit (the kernel's OOM killer, exit 137)
REASON_EVICTED = "Evicted"
REASON_NODE_LOST = "NodeLost"
REASON_POD_DELETED = "PodDeleted"
REASON_LIGHTHOUSE = "LighthouseFailed"
REASON_HEARTBEAT_LOST = "HeartbeatLost"  # pods run, but the group left the lighthouse (hung, or cut off)
# the lighthouse itself evicted the group (ftjob.operator.planning.integrity_evictions): repeated gradient-guard
# offences, or a state digest that differs from the majority's
REASON_GRADIENT_GUARD = "GradientGuard"
REASON_REPLICA_DIVERGENCE = "ReplicaDivergence"
REASON_STALLED = "Stalled"  # the lighthouse saw the group stop making progress while the others waited for it

# A pod still Terminating this long after its deletionTimestamp (grace already included) is force-deleted:
# its node is not going to confirm the deletion.
TERMINATING_SLACK_S = 10.0


@dataclass(frozen=True)
class Failure:
    reason: str
    message: str
    pod: str
    node: str | None
    exit_code: int | None
    action: str  # ACTION_RESTART_GROUP | ACTION_FAIL_JOB | ACTION_IGNORE
    node_lost: bool  # the pod's node is gone or NotReady: delete with no grace, avoid the node strictly
    avoid_strictly: bool = False  # the node is suspect though up (bad numbers came from it): required anti-affinity
    evicted_by_lighthouse: bool = False  # the lighthouse already dropped the group: no evict call needed


def node_is_lost(node: str | None, node_ready: Mapping[str, bool] | None) -> bool:
    """True when the pod's node is known to be NotReady/Unknown or gone. Unknowable (no node index) is not lost."""
    if node is None or node_ready is None:
        return False
    return not node_ready.get(node, False)


def detect_failure(
    pods: list[PodView],
    expected: Mapping[int, str],
    all_pods_seen: bool,
    deleting: set[str],
    node_ready: Mapping[str, bool] | None,
    policy: FailurePolicy | None,
) -> Failure | None:
    """The failure of one generation of a group (or of the lighthouse), or None while it is healthy.

    `expected` maps rank -> pod name of this generation; `pods` are the observed pods of this generation;
    `deleting` are pods this operator itself deleted (not a failure). A FailJob rule wins over everything else,
    so a fatal exit code is never hidden behind another pod's restartable failure. `policy` None: no rules apply.
    """
    failures: list[Failure] = []
    present = {p.name for p in pods}
    for pod in pods:
        if pod.phase == "Failed":
            if pod.reason == "Evicted":
                failures.append(_fail(REASON_EVICTED, f"pod {pod.name} was evicted", pod, ACTION_RESTART_GROUP))
                continue
            code = pod.exit_code if pod.exit_code is not None else -1
            action = policy.action_for_exit(pod.exit_container or "", code) if policy else ACTION_RESTART_GROUP
            if pod.exit_reason == "OOMKilled":
                msg = (
                    f"pod {pod.name} container {pod.exit_container} was OOMKilled (exit {code}): it went over its "
                    "memory limit; raise resources.limits.memory or use less memory per rank"
                )
                failures.append(_fail(REASON_OOM_KILLED, msg, pod, action))
                continue
            failures.append(
                _fail(REASON_EXIT_CODE, f"pod {pod.name} container {pod.exit_container} exited {code}", pod, action)
            )
        elif pod.phase != "Succeeded" and node_is_lost(pod.node, node_ready):
            msg = f"pod {pod.name} is on node {pod.node}, which is NotReady, gone or no longer answering"
            failures.append(_fail(REASON_NODE_LOST, msg, pod, ACTION_RESTART_GROUP, node_lost=True))
        elif pod.deletion_time is not None and pod.name not in deleting and pod.phase != "Succeeded":
            msg = f"pod {pod.name} is being deleted by someone else"
            failures.append(_fail(REASON_POD_DELETED, msg, pod, ACTION_RESTART_GROUP))
    if all_pods_seen:
        for rank, name in sorted(expected.items()):
            if name not in present and name not in deleting:
                failures.append(
                    Failure(REASON_POD_DELETED, f"pod {name} (rank {rank}) was deleted", name, None, None,
                            ACTION_RESTART_GROUP, False)
                )  # fmt: skip
    if not failures:
        return None
    for f in failures:
        if f.action == ACTION_FAIL_JOB:
            return f
    for f in failures:
        if f.action == ACTION_RESTART_GROUP:
            return f
    return failures[0]


def _fail(reason: str, message: str, pod: PodView, action: str, node_lost: bool = False) -> Failure:
    return Failure(reason, message, pod.name, pod.node, pod.exit_code, action, node_lost)


@dataclass(frozen=True)
class RestartDecision:
    allowed: bool
    delay_s: float  # back-off before the replacement's pods are created
    message: str  # why not, when not allowed


def decide_restart(
    group: GroupState, policy: FailurePolicy, budgeted_restarts: int, now: float, counted: bool
) -> RestartDecision:
    """Per-group budget within the window, the job-wide budget, and exponential back-off.

    The first failure of a group inside its window is replaced at once (delay 0); the k-th waits
    base * 2**(k-2) seconds, capped at the maximum. Ignored failures (`counted` False) spend no budget
    but still back off, so a crash loop cannot spin.
    """
    recent = [t for t in group.restart_times if t > now - policy.restart_window_s]
    if counted and len(recent) >= policy.max_restarts_per_group:
        return RestartDecision(
            False,
            0.0,
            f"replica group {group.index} failed {len(recent) + 1} times within {policy.restart_window_s:g}s "
            f"(failurePolicy.maxRestartsPerGroup={policy.max_restarts_per_group})",
        )
    if counted and budgeted_restarts >= policy.max_total_restarts:
        return RestartDecision(
            False,
            0.0,
            f"the job used all {policy.max_total_restarts} restarts of failurePolicy.maxTotalRestarts",
        )
    if not recent:
        return RestartDecision(True, 0.0, "")
    delay = min(policy.backoff_max_s, policy.backoff_base_s * 2 ** (len(recent) - 1))
    return RestartDecision(True, delay, "")


def prune_window(times: list[float], policy: FailurePolicy, now: float) -> list[float]:
    return [t for t in times if t > now - policy.restart_window_s]


def terminating_too_long(pod: PodView, now: float) -> bool:
    return pod.deletion_time is not None and now > pod.deletion_time + TERMINATING_SLACK_S


__all__ = [
    "ACTION_FAIL_JOB",
    "ACTION_IGNORE",
    "ACTION_RESTART_GROUP",
    "Failure",
    "RestartDecision",
    "decide_restart",
    "detect_failure",
    "node_is_lost",
    "prune_window",
    "terminating_too_long",
]
