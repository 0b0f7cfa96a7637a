"""The reconcile planner: (spec, remembered state, observed pods) -> (new state, actions). Pure and deterministic.

Level-based: it looks only at what exists now, so running it twice, or after an operator restart, plans the same
idempotent actions. Anything that changes a generation sets `persist_first`: the executor writes status before
touching pods, so a crash between the two can never forget a restart (budgets never reset) or reuse a name.
"""

from __future__ import annotations

from ftjob import contract
from ftjob.operator.planning.actions import Actions, Event, Observed, Result
from ftjob.operator.planning.failures import (
    REASON_HEARTBEAT_LOST,
    REASON_LIGHTHOUSE,
    Failure,
    decide_restart,
    detect_failure,
    node_is_lost,
    prune_window,
    terminating_too_long,
)
from ftjob.operator.planning.integrity_evictions import eviction_of_generation, integrity_failure
from ftjob.operator.planning.migration import (
    REASON_NODE_DEGRADED,
    drained,
    keep_while_migrating,
    migrate_group,
    migration_progress,
    should_migrate,
    unschedulable_too_long,
)
from ftjob.operator.state import names
from ftjob.operator.state.job_spec import ACTION_FAIL_JOB, ACTION_IGNORE, ACTION_RESTART_GROUP, JobSpec
from ftjob.operator.state.job_state import OUTCOME_FAILED, OUTCOME_SUCCEEDED, GroupState, JobState, PodView

# After the first group finishes, stragglers (e.g. a spare still waiting for a quorum) get this long to finish.
COMPLETION_GRACE_S = 60.0

PHASE_PENDING = "Pending"
PHASE_STARTING = "Starting"
PHASE_RUNNING = "Running"
PHASE_RESTARTING = "Restarting"
PHASE_BACKING_OFF = "BackingOff"
PHASE_SUCCEEDED = "Succeeded"
PHASE_FAILED = "Failed"
PHASE_SUSPENDED = "Suspended"
SURVIVOR_PHASES = (PHASE_RUNNING, PHASE_SUCCEEDED)  # groups that hold the committed state in memory


def plan(job: str, spec: JobSpec, state: JobState, obs: Observed) -> Result:
    s = state.copy()
    a = Actions()
    phases: dict[int, str] = {}
    now = obs.now
    if s.start_time is None:
        s.start_time = now
        a.persist_first = True
    workers = [p for p in obs.pods if p.role == contract.ROLE_WORKER]
    lighthouses = [p for p in obs.pods if p.role == contract.ROLE_LIGHTHOUSE]

    if s.outcome is None:
        _suspend_transitions(spec, s, a, now)
        _scale(job, spec, s, a, now)
        _lighthouse(job, spec, s, lighthouses, obs, a)
    if s.outcome is None:
        _completion_start(job, spec, s, workers, obs, a)
        _groups(job, spec, s, workers, obs, a, phases)
    if s.outcome is None:
        _completion(spec, s, a, phases, now)
    if s.outcome is not None:
        _terminal(job, spec, s, workers, lighthouses, obs, a, phases)
    else:
        _delete_strays(job, spec, s, workers, lighthouses, obs, a)
    return Result(s, a, phases)


# --- pieces -------------------------------------------------------------------------------------------------------
def _suspend_transitions(spec: JobSpec, s: JobState, a: Actions, now: float) -> None:
    if spec.suspend and not s.suspended:
        # Bump every generation now, so resume creates fresh pods and never reuses a name still terminating.
        s.suspended = True
        for g in s.groups.values():
            g.generation += 1
            g.generation_since = now
            g.all_pods_seen = False
            g.failed_at = None
        a.persist_first = True
        a.events.append(Event("Normal", "Suspended", "spec.suspend is true: worker pods deleted, lighthouse kept"))
    elif not spec.suspend and s.suspended:
        s.suspended = False
        a.persist_first = True
        a.events.append(Event("Normal", "Resumed", "spec.suspend is false: recreating worker pods"))


def _scale(job: str, spec: JobSpec, s: JobState, a: Actions, now: float) -> None:
    initial = not s.groups
    for idx in sorted(s.groups, reverse=True):
        if idx < spec.total_groups:
            continue
        g = s.groups.pop(idx)
        s.retired_generations[idx] = g.generation
        a.evict.append((idx, "scaled down"))
        a.delete_group_services.append(idx)
        a.persist_first = True
        a.events.append(Event("Normal", "ScaledDown", f"removed replica group {idx} (spec.replicas={spec.replicas})"))
    for idx in range(spec.total_groups):
        if idx in s.groups:
            continue
        previous = s.retired_generations.pop(idx, None)
        s.groups[idx] = GroupState(index=idx, generation=0 if previous is None else previous + 1, generation_since=now)
        a.persist_first = True
        if not initial:
            a.events.append(Event("Normal", "ScaledUp", f"added replica group {idx} (spec.replicas={spec.replicas})"))
    a.group_services.extend(range(spec.total_groups))


def _lighthouse(job: str, spec: JobSpec, s: JobState, pods: list[PodView], obs: Observed, a: Actions) -> None:
    name = names.lighthouse_pod(job, s.lighthouse_generation)
    current = [p for p in pods if p.generation == s.lighthouse_generation and p.name == name]
    failure = detect_failure(current, {0: name}, s.lighthouse_seen, obs.deleting, obs.node_ready, None)
    if failure is None and current and current[0].phase == "Succeeded":
        failure = Failure(REASON_LIGHTHOUSE, f"lighthouse pod {name} exited", name, None, 0, "", False)
    if failure is not None:
        if s.total_restarts >= spec.failure_policy.max_total_restarts:
            _fail_job(
                s,
                a,
                "RestartBudgetExhausted",
                f"the lighthouse failed ({failure.message}) and the job used all "
                f"{spec.failure_policy.max_total_restarts} restarts of failurePolicy.maxTotalRestarts",
                obs.now,
            )
            return
        s.lighthouse_generation += 1
        s.lighthouse_seen = False
        s.total_restarts += 1
        s.restarts_by_reason[REASON_LIGHTHOUSE] = s.restarts_by_reason.get(REASON_LIGHTHOUSE, 0) + 1
        a.restarts.append(REASON_LIGHTHOUSE)
        a.persist_first = True
        a.events.append(Event("Warning", "LighthouseRestart", f"{failure.message}; starting a new lighthouse"))
        for p in current:
            a.delete_pods.append((p.name, failure.node_lost or node_is_lost(p.node, obs.node_ready)))
        current = []
    if current and (why := unschedulable_too_long(current, spec.failure_policy, obs.now, a)) is not None:
        _fail_job(s, a, "Unschedulable", f"the lighthouse: {why}", obs.now)
        return
    if current:
        a.persist_first = a.persist_first or not s.lighthouse_seen
        s.lighthouse_seen = True
    else:
        a.create_lighthouse = s.lighthouse_generation


def _groups(
    job: str, spec: JobSpec, s: JobState, workers: list[PodView], obs: Observed, a: Actions, phases: dict[int, str]
) -> None:
    now = obs.now
    policy = spec.failure_policy
    by_group: dict[int | None, list[PodView]] = {}
    for p in workers:
        by_group.setdefault(p.group, []).append(p)
    for idx in sorted(s.groups):
        g = s.groups[idx]
        g.restart_times = prune_window(g.restart_times, policy, now)
        expected = {r: names.pod_name(job, idx, g.generation, r) for r in range(spec.pods_per_replica)}
        wanted = set(expected.values())
        current = [p for p in by_group.get(idx, ()) if p.name in wanted]
        if s.suspended:
            phases[idx] = PHASE_SUSPENDED
            continue
        if len(current) == spec.pods_per_replica and all(p.phase == "Succeeded" for p in current):
            phases[idx] = PHASE_SUCCEEDED
            continue
        failure = detect_failure(current, expected, g.all_pods_seen, obs.deleting, obs.node_ready, policy)
        if failure is None and idx in obs.silent_groups and current:
            failure = Failure(REASON_HEARTBEAT_LOST, obs.silent_groups[idx], current[0].name, current[0].node, None,
                              ACTION_RESTART_GROUP, False)  # fmt: skip
        if failure is not None and failure.action != ACTION_FAIL_JOB and not failure.node_lost:
            failure = drained(current, obs) or failure  # a drain's eviction: a migration, no budget spent
        if (why := eviction_of_generation(g, current, obs.integrity_drops.get(idx))) is not None:
            failure = integrity_failure(idx, why, current, failure)  # what the lighthouse saw, not its consequence
        if failure is not None:
            if s.completing_since is not None:
                phases[idx] = PHASE_FAILED  # training is over: a late failure is not replaced
                continue
            if failure.action == ACTION_FAIL_JOB:
                _fail_job(s, a, "FailJobRule", f"{failure.message}, which a FailJob rule matches", now)
                return
            counted = failure.action != ACTION_IGNORE
            decision = decide_restart(g, policy, s.total_restarts, now, counted)
            if not decision.allowed:
                _fail_job(s, a, "RestartBudgetExhausted", f"{decision.message}; last failure: {failure.message}", now)
                return
            _restart_group(s, g, failure, decision.delay_s, counted, current, obs, a)
            expected = {r: names.pod_name(job, idx, g.generation, r) for r in range(spec.pods_per_replica)}
            current = []
        elif should_migrate(g, current, spec, s, obs):
            migrate_group(s, g, current, obs, a)
            expected = {r: names.pod_name(job, idx, g.generation, r) for r in range(spec.pods_per_replica)}
            current = []
        old_running = migration_progress(g, by_group.get(idx, []), a, now)
        if now < g.not_before:
            phases[idx] = PHASE_BACKING_OFF
            a.requeue(g.not_before - now)
            continue
        if (why := unschedulable_too_long(current, policy, now, a)) is not None:
            _fail_job(s, a, "Unschedulable", f"replica group {idx}: {why}", now)
            return
        present = {p.name for p in current}
        missing = [r for r, n in sorted(expected.items()) if n not in present]
        for rank in missing:
            a.create_pods.append((idx, rank, g.generation))
        if missing and len(missing) == spec.pods_per_replica and g.migrating_from is None:
            a.starting.append(idx)  # (not a migrating group: the quorum must not wait for its replacement)
        if not missing and not g.all_pods_seen:
            g.all_pods_seen = True
            a.persist_first = True  # from now on a missing pod means a deletion: a new operator must know that
        if not missing and all(p.phase in ("Running", "Succeeded") for p in current):
            phases[idx] = PHASE_RUNNING
            if g.failed_at is not None:
                a.recovered.append(max(0.0, now - g.failed_at))
                g.failed_at = None
        elif old_running:
            phases[idx] = PHASE_RUNNING  # the old generation trains on while its replacement starts
        else:
            phases[idx] = PHASE_RESTARTING if g.failed_at is not None else PHASE_STARTING


def _restart_group(
    s: JobState,
    g: GroupState,
    failure: Failure,
    delay_s: float,
    counted: bool,
    current: list[PodView],
    obs: Observed,
    a: Actions,
) -> None:
    now = obs.now
    if not failure.evicted_by_lighthouse:
        a.evict.append((g.index, failure.message))
    for p in current:
        if p.name not in obs.deleting or failure.node_lost:
            a.delete_pods.append((p.name, failure.node_lost or node_is_lost(p.node, obs.node_ready)))
    g.generation += 1
    g.generation_since = now
    g.all_pods_seen = False
    g.restarts += 1
    if counted:
        g.restart_times.append(now)
        s.total_restarts += 1
    g.avoid_node = failure.node
    g.avoid_required = failure.node_lost or failure.avoid_strictly
    if failure.node and failure.reason != REASON_NODE_DEGRADED:  # a drain is no fault of the node's
        a.failed_nodes.append(failure.node)
    g.not_before = now + delay_s
    g.failed_at = now if g.failed_at is None else g.failed_at
    g.last_failure, g.last_failure_reason = failure.message, failure.reason
    s.restarts_by_reason[failure.reason] = s.restarts_by_reason.get(failure.reason, 0) + 1
    a.restarts.append(failure.reason)
    a.persist_first = True
    wait = f" after a {delay_s:g}s back-off" if delay_s > 0 else ""
    budget = "" if counted else " (an Ignore rule matched: no budget spent)"
    if failure.reason == REASON_NODE_DEGRADED:
        budget = " (a voluntary disruption of a degrading node: no budget spent)"
    a.events.append(
        Event("Warning", "GroupRestart", f"{failure.message}: replica group {g.index} restarts as generation "
              f"{g.generation}{wait}{budget}")
    )  # fmt: skip


def _completion_start(job: str, spec: JobSpec, s: JobState, workers: list[PodView], obs: Observed, a: Actions) -> None:
    """Training is over once one group's pods all exited 0 or the lighthouse reports a group finished. Decided
    before failures are handled, so a group dying at the very end is not replaced."""
    if s.suspended or s.completing_since is not None:
        return
    finished = bool(obs.finished_groups & set(s.groups))
    succeeded: dict[int | None, int] = {}
    for p in workers:
        g = s.groups.get(p.group) if p.group is not None else None
        if g is not None and p.generation == g.generation and p.phase == "Succeeded":
            succeeded[p.group] = succeeded.get(p.group, 0) + 1
    finished = finished or any(n == spec.pods_per_replica for n in succeeded.values())
    if finished:
        s.completing_since = obs.now
        a.persist_first = True
        a.events.append(Event("Normal", "Completing", "a replica group finished training; waiting for the others"))


def _completion(spec: JobSpec, s: JobState, a: Actions, phases: dict[int, str], now: float) -> None:
    """Succeeded when every group is done (or the grace after the first finished group ran out)."""
    if s.suspended or s.completing_since is None:
        return
    done = all(p in (PHASE_SUCCEEDED, PHASE_FAILED) for p in phases.values())
    if done or now >= s.completing_since + COMPLETION_GRACE_S:
        finished = sorted(i for i, p in phases.items() if p == PHASE_SUCCEEDED)
        s.outcome = OUTCOME_SUCCEEDED
        s.outcome_reason = "TrainingFinished"
        s.outcome_message = f"replica groups {finished} finished training"
        s.completion_time = now
        a.persist_first = True
        a.events.append(Event("Normal", "Succeeded", s.outcome_message))
    else:
        a.requeue(s.completing_since + COMPLETION_GRACE_S - now)


def _fail_job(s: JobState, a: Actions, reason: str, message: str, now: float) -> None:
    s.outcome = OUTCOME_FAILED
    s.outcome_reason = reason
    s.outcome_message = message
    s.completion_time = now
    a.persist_first = True
    a.events.append(Event("Warning", "Failed", message))


def _terminal(
    job: str,
    spec: JobSpec,
    s: JobState,
    workers: list[PodView],
    lighthouses: list[PodView],
    obs: Observed,
    a: Actions,
    phases: dict[int, str],
) -> None:
    """Succeeded/Failed: stop what still runs, keep finished pods (their logs), recreate nothing, ever."""
    a.create_pods.clear()
    a.create_lighthouse = None
    a.starting.clear()
    for p in workers:
        if not p.terminal:
            _delete(p, obs, a)
    for p in lighthouses:
        _delete(p, obs, a)
    for idx, g in s.groups.items():
        mine = [p for p in workers if p.group == idx and p.generation == g.generation]
        ok = mine and all(p.phase == "Succeeded" for p in mine)
        phases.setdefault(idx, PHASE_SUCCEEDED if ok else PHASE_FAILED)
    if spec.ttl_seconds_after_finished is not None and s.completion_time is not None:
        expires = s.completion_time + spec.ttl_seconds_after_finished
        if obs.now >= expires:
            a.delete_job = True
        else:
            a.requeue(expires - obs.now)


def _delete_strays(
    job: str,
    spec: JobSpec,
    s: JobState,
    workers: list[PodView],
    lighthouses: list[PodView],
    obs: Observed,
    a: Actions,
) -> None:
    """Pods of an old generation, a removed group or a suspended job go; stuck Terminating ones are forced."""
    keep = {names.lighthouse_pod(job, s.lighthouse_generation)}
    if not s.suspended:
        for idx, g in s.groups.items():
            mine = {names.pod_name(job, idx, g.generation, r) for r in range(spec.pods_per_replica)}
            keep.update(mine)
            if g.migrating_from is not None:
                new = [p for p in workers if p.name in mine]
                new_running = len(new) == spec.pods_per_replica and all(p.phase == "Running" for p in new)
                keep.update(p.name for p in workers if p.group == idx and keep_while_migrating(g, p, new_running, obs))
    already = {n for n, _ in a.delete_pods}
    for p in workers + lighthouses:
        if p.name not in keep and p.name not in already:
            _delete(p, obs, a)


def _delete(p: PodView, obs: Observed, a: Actions) -> None:
    if p.deletion_time is not None:
        if terminating_too_long(p, obs.now) or node_is_lost(p.node, obs.node_ready):
            a.delete_pods.append((p.name, True))
        else:
            a.requeue(p.deletion_time + 10.5 - obs.now)
        return
    if p.name in obs.deleting and not node_is_lost(p.node, obs.node_ready):
        return
    a.delete_pods.append((p.name, node_is_lost(p.node, obs.node_ready)))
