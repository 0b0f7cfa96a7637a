"""Unit tests of the reconcile planner (pure logic: no cluster, no clock)."""

from __future__ import annotations

import pytest
from ftjob.operator.planning.plan import (
    COMPLETION_GRACE_S,
    PHASE_BACKING_OFF,
    PHASE_RUNNING,
    PHASE_SUCCEEDED,
    PHASE_SUSPENDED,
    Observed,
    Result,
    plan,
)
from ftjob.operator.state import names
from ftjob.operator.state.job_state import OUTCOME_FAILED, OUTCOME_SUCCEEDED, JobState

from tests.support.podfactory import JOB, healthy_job, lighthouse, spec, worker

NOW = 1_000_000.0
NODES = {"node-1": True, "node-2": True}


def run(s, state, pods, now=NOW, deleting=frozenset(), nodes=NODES, finished=frozenset()) -> Result:
    return plan(JOB, s, state, Observed(list(pods), nodes, set(deleting), now, set(finished)))


def steady(s, now=NOW) -> JobState:
    """The state after a first reconcile and once every pod was observed."""
    state = run(s, JobState(), [], now=now).state
    return run(s, state, healthy_job(s), now=now).state


def test_first_reconcile_creates_lighthouse_every_rank_services_and_persists_first():
    s = spec()
    r = run(s, JobState(), [])
    a = r.actions
    assert a.create_lighthouse == 0
    assert sorted(a.create_pods) == [(g, rank, 0) for g in range(3) for rank in range(2)]
    assert a.group_services == [0, 1, 2]
    assert sorted(a.starting) == [0, 1, 2]
    assert a.persist_first and not a.delete_pods and not a.evict


def test_reconcile_is_idempotent_when_everything_exists():
    s = spec()
    state = steady(s)
    r = run(s, state, healthy_job(s))
    a = r.actions
    assert not (a.create_pods or a.delete_pods or a.evict or a.persist_first or a.create_lighthouse is not None)
    assert set(r.group_phases.values()) == {PHASE_RUNNING}


def test_partially_created_group_gets_only_its_missing_rank():
    """A crash mid-create leaves rank 0 only: the next run creates rank 1, nothing twice."""
    s = spec()
    state = run(s, JobState(), []).state
    pods = [lighthouse(), worker(0, 0)]
    a = run(s, state, pods).actions
    assert (0, 0, 0) not in a.create_pods and (0, 1, 0) in a.create_pods
    assert not a.delete_pods and not a.evict


def test_failed_pod_restarts_only_its_group_with_eviction_first_and_new_generation():
    s = spec()
    state = steady(s)
    pods = healthy_job(s)
    pods[pods.index(worker(1, 0))] = worker(1, 0, phase="Failed", exit_code=1, node="node-2")
    r = run(s, state, pods)
    a = r.actions
    assert a.evict and a.evict[0][0] == 1
    assert a.persist_first
    assert sorted(a.delete_pods) == [(names.pod_name(JOB, 1, 0, 0), False), (names.pod_name(JOB, 1, 0, 1), False)]
    assert sorted(a.create_pods) == [(1, 0, 1), (1, 1, 1)]
    assert a.starting == [1]
    g = r.state.groups[1]
    assert (g.generation, g.restarts, g.avoid_node, g.avoid_required) == (1, 1, "node-2", False)
    assert r.state.total_restarts == 1 and r.state.restarts_by_reason == {"ExitCode": 1}
    assert r.state.groups[0].generation == 0 and r.state.groups[2].generation == 0
    assert [e.reason for e in a.events] == ["GroupRestart"]


def test_oomkilled_container_is_its_own_failure_reason_with_a_message_that_says_what_to_do():
    s = spec()
    pods = healthy_job(s)
    pods[pods.index(worker(2, 1))] = worker(2, 1, phase="Failed", exit_code=137, exit_reason="OOMKilled")
    r = run(s, steady(s), pods)
    assert r.state.restarts_by_reason == {"OOMKilled": 1}
    assert "OOMKilled" in r.state.groups[2].last_failure and "memory limit" in r.state.groups[2].last_failure
    assert [e.reason for e in r.actions.events] == ["GroupRestart"] and "OOMKilled" in r.actions.events[0].message


def test_pod_on_lost_node_is_force_deleted_and_the_node_strictly_avoided():
    s = spec()
    state = steady(s)
    a_pods = healthy_job(s)
    a_pods[a_pods.index(worker(2, 1))] = worker(2, 1, node="node-2")
    r = run(s, state, a_pods, nodes={"node-1": True, "node-2": False})
    assert (names.pod_name(JOB, 2, 0, 1), True) in r.actions.delete_pods
    assert r.state.groups[2].avoid_node == "node-2" and r.state.groups[2].avoid_required
    assert r.state.restarts_by_reason == {"NodeLost": 1}


def test_deleted_pod_after_it_was_seen_restarts_the_group_but_not_before():
    s = spec()
    before_seen = run(s, JobState(), []).state
    pods = [p for p in healthy_job(s) if p.name != names.pod_name(JOB, 0, 0, 1)]
    assert run(s, before_seen, pods).state.total_restarts == 0  # not yet created: just create it
    seen = steady(s)
    r = run(s, seen, pods)
    assert r.state.groups[0].generation == 1 and r.state.restarts_by_reason == {"PodDeleted": 1}


def test_pod_deleted_by_someone_else_while_terminating_is_a_failure_but_ours_is_not():
    s = spec()
    state = steady(s)
    pods = healthy_job(s)
    name = names.pod_name(JOB, 0, 0, 0)
    pods[pods.index(worker(0, 0))] = worker(0, 0, deletion_time=NOW + 30)
    assert run(s, state, pods).state.groups[0].generation == 1
    assert run(s, state, pods, deleting={name}).state.groups[0].generation == 0


def test_backoff_delays_second_restart_then_creates():
    s = spec()
    state = steady(s)
    pods = healthy_job(s)
    pods[pods.index(worker(0, 0))] = worker(0, 0, phase="Failed", exit_code=3)
    first = run(s, state, pods)
    assert first.state.groups[0].not_before == NOW  # first failure: replaced at once
    pods2 = healthy_job(s, {0: 1})
    pods2[pods2.index(worker(0, 0, 1))] = worker(0, 0, 1, phase="Failed", exit_code=3)
    second = run(s, run(s, first.state, healthy_job(s, {0: 1}), now=NOW + 1).state, pods2, now=NOW + 2)
    assert second.state.groups[0].generation == 2
    assert not second.actions.create_pods and second.group_phases[0] == PHASE_BACKING_OFF
    assert second.actions.requeue_after == pytest.approx(4.0)
    later = run(s, second.state, healthy_job(s, {0: 1})[:1], now=NOW + 6.5)
    assert (0, 0, 2) in later.actions.create_pods


def _fail_group(s, state, group, generation, now):
    pods = healthy_job(s, {g: st.generation for g, st in state.groups.items()})
    i = pods.index(worker(group, 0, generation))
    pods[i] = worker(group, 0, generation, phase="Failed", exit_code=1)
    return run(s, state, pods, now=now)


def test_per_group_budget_exhausted_fails_the_job_and_nothing_is_recreated():
    s = spec(failurePolicy={"maxRestartsPerGroup": 2, "maxTotalRestarts": 10, "backoff": {"baseSeconds": 0}})
    state = steady(s)
    for k in range(2):
        state = _fail_group(s, state, 0, k, NOW + k).state
        assert state.outcome is None
    r = _fail_group(s, state, 0, 2, NOW + 3)
    assert r.state.outcome == OUTCOME_FAILED and r.state.outcome_reason == "RestartBudgetExhausted"
    assert "maxRestartsPerGroup=2" in r.state.outcome_message
    assert not r.actions.create_pods and r.actions.create_lighthouse is None
    # Terminal means terminal: a later reconcile with every pod gone recreates nothing.
    later = run(s, r.state, [], now=NOW + 100)
    assert not later.actions.create_pods and later.actions.create_lighthouse is None and later.state.outcome


def test_window_forgets_old_restarts():
    s = spec(failurePolicy={"maxRestartsPerGroup": 1, "restartWindowSeconds": 60, "backoff": {"baseSeconds": 0}})
    state = _fail_group(s, steady(s), 0, 0, NOW).state
    assert _fail_group(s, state, 0, 1, NOW + 30).state.outcome == OUTCOME_FAILED
    assert _fail_group(s, state, 0, 1, NOW + 61).state.outcome is None


def test_job_wide_budget():
    s = spec(failurePolicy={"maxRestartsPerGroup": 5, "maxTotalRestarts": 2, "backoff": {"baseSeconds": 0}})
    state = steady(s)
    state = _fail_group(s, state, 0, 0, NOW).state
    state = _fail_group(s, state, 1, 0, NOW + 1).state
    r = _fail_group(s, state, 2, 0, NOW + 2)
    assert r.state.outcome == OUTCOME_FAILED and "maxTotalRestarts" in r.state.outcome_message


def test_exit_code_rules_fail_job_and_ignore():
    rules = [
        {"action": "FailJob", "onExitCodes": {"values": [42]}},
        {"action": "Ignore", "onExitCodes": {"values": [143]}},
    ]
    s = spec(failurePolicy={"maxRestartsPerGroup": 0, "rules": rules})
    state = steady(s)
    pods = healthy_job(s)
    pods[pods.index(worker(1, 1))] = worker(1, 1, phase="Failed", exit_code=143)
    ignored = run(s, state, pods)
    assert ignored.state.outcome is None and ignored.state.groups[1].generation == 1
    assert ignored.state.total_restarts == 0  # no budget spent (the budget here is 0)
    pods[pods.index(worker(1, 1, phase="Failed", exit_code=143))] = worker(1, 1, phase="Failed", exit_code=42)
    fatal = run(s, state, pods)
    assert fatal.state.outcome == OUTCOME_FAILED and fatal.state.outcome_reason == "FailJobRule"


def test_scale_down_evicts_and_removes_highest_groups_then_scale_up_uses_fresh_generations():
    s = spec()
    state = steady(s)
    down = run(spec(replicas=2, minReplicas=1), state, healthy_job(s))
    assert down.actions.evict == [(2, "scaled down")] and down.actions.delete_group_services == [2]
    assert {n for n, _ in down.actions.delete_pods} == {names.pod_name(JOB, 2, 0, r) for r in range(2)}
    assert sorted(down.state.groups) == [0, 1] and down.state.retired_generations == {2: 0}
    up = run(s, down.state, [p for p in healthy_job(s) if p.group != 2])
    assert sorted(up.actions.create_pods) == [(2, 0, 1), (2, 1, 1)]  # never reuses a terminating pod's name
    assert [e.reason for e in up.actions.events] == ["ScaledUp"]


def test_suspend_deletes_workers_keeps_lighthouse_and_resume_recreates_next_generation():
    s = spec()
    state = steady(s)
    sus = run(spec(suspend=True), state, healthy_job(s))
    assert sus.state.suspended and not sus.actions.create_pods
    deleted = {n for n, _ in sus.actions.delete_pods}
    assert deleted == {p.name for p in healthy_job(s) if p.role == "worker"}
    assert set(sus.group_phases.values()) == {PHASE_SUSPENDED}
    resumed = run(s, sus.state, [lighthouse()])
    assert not resumed.state.suspended
    assert sorted(resumed.actions.create_pods) == [(g, r, 1) for g in range(3) for r in range(2)]


def test_success_when_every_group_exits_zero_then_lighthouse_stopped_and_pods_kept():
    s = spec()
    state = steady(s)
    pods = [lighthouse()] + [worker(g, r, phase="Succeeded", exit_code=0) for g in range(3) for r in range(2)]
    r = run(s, state, pods)
    assert r.state.outcome == OUTCOME_SUCCEEDED and set(r.group_phases.values()) == {PHASE_SUCCEEDED}
    assert r.actions.delete_pods == [(names.lighthouse_pod(JOB, 0), False)]
    assert not r.actions.create_pods


def test_a_group_failing_after_another_finished_is_not_restarted_and_grace_ends_the_wait():
    s = spec()
    state = steady(s)
    pods = healthy_job(s)
    for rank in range(2):
        pods[pods.index(worker(0, rank))] = worker(0, rank, phase="Succeeded", exit_code=0)
    pods[pods.index(worker(1, 0))] = worker(1, 0, phase="Failed", exit_code=1)
    r = run(s, state, pods)
    assert r.state.completing_since == NOW and r.state.outcome is None
    assert not r.actions.evict and r.state.groups[1].generation == 0
    done = run(s, r.state, pods, now=NOW + COMPLETION_GRACE_S)
    assert done.state.outcome == OUTCOME_SUCCEEDED
    assert {n for n, _ in done.actions.delete_pods} >= {p.name for p in pods if p.group == 2}


def test_ttl_deletes_the_job_after_it_finished():
    s = spec(ttlSecondsAfterFinished=30)
    state = steady(s)
    state.outcome, state.completion_time = OUTCOME_SUCCEEDED, NOW
    assert not run(s, state, [], now=NOW + 10).actions.delete_job
    assert run(s, state, [], now=NOW + 30).actions.delete_job


def test_lighthouse_failure_starts_a_new_generation_and_counts_against_job_budget():
    s = spec()
    state = steady(s)
    pods = healthy_job(s)
    pods[0] = lighthouse(phase="Failed", exit_code=1)
    r = run(s, state, pods)
    assert r.actions.create_lighthouse == 1 and r.state.lighthouse_generation == 1
    assert r.state.total_restarts == 1 and r.state.restarts_by_reason == {"LighthouseFailed": 1}
    assert all(g.generation == 0 for g in r.state.groups.values())


def test_stuck_terminating_old_pod_is_force_deleted():
    s = spec()
    state = steady(s)
    old = worker(0, 0, generation=7, deletion_time=NOW - 60)
    r = run(s, state, [*healthy_job(s), old], deleting={old.name})
    assert (old.name, True) in r.actions.delete_pods


def test_silent_group_with_running_pods_is_replaced_as_heartbeat_lost():
    s = spec()
    state = steady(s)
    r = plan(JOB, s, state, Observed(healthy_job(s), NODES, set(), NOW, set(), {2: "left the lighthouse"}))
    assert r.state.groups[2].generation == 1 and r.state.restarts_by_reason == {"HeartbeatLost": 1}
    assert r.actions.evict == [(2, "left the lighthouse")]


def test_lighthouse_reported_finish_stops_restarts_before_pods_exit():
    s = spec()
    state = steady(s)
    pods = healthy_job(s)
    pods[pods.index(worker(2, 0))] = worker(2, 0, phase="Failed", exit_code=1)
    r = run(s, state, pods, finished={0})
    assert r.state.completing_since == NOW and not r.actions.evict and r.state.groups[2].generation == 0
    assert r.state.outcome is None  # groups 0 and 1 still run: they get to exit on their own
