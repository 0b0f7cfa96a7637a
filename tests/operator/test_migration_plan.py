"""Unit tests of make-before-break migration off degrading nodes, the nodeHealth policy, the opt-in unschedulable
deadline and the cross-job failure counter behind the cordon rule (pure logic: no cluster, no clock)."""

from __future__ import annotations

import dataclasses

from ftjob.operator.planning.migration import REASON_NODE_DEGRADED
from ftjob.operator.planning.node_health import NodeFailureTracker, NodeView
from ftjob.operator.planning.plan import PHASE_RUNNING, Observed, Result, plan
from ftjob.operator.state import names
from ftjob.operator.state.job_state import OUTCOME_FAILED, JobState

from tests.support.podfactory import JOB, healthy_job, lighthouse, spec, worker

NOW = 1_000_000.0
NODES = {"node-1": True, "node-2": True}


def run(s, state, pods, now=NOW, degraded=None) -> Result:
    return plan(JOB, s, state, Observed(list(pods), NODES, set(), now, set(), {}, degraded or {}))


def steady(s) -> JobState:
    state = run(s, JobState(), []).state
    return run(s, state, healthy_job(s)).state


def on_node(pods, group, node):
    return [dataclasses.replace(p, node=node) if p.group == group else p for p in pods]


def test_a_group_on_a_degrading_node_starts_its_replacement_first_and_keeps_training():
    s = spec(replicas=2, minReplicas=1, podsPerReplica=1)
    state = steady(s)
    pods = on_node(healthy_job(s), 1, "node-2")
    r = run(s, state, pods, degraded={"node-2": "condition KernelDeadlock=True"})
    a = r.actions
    g = r.state.groups[1]
    assert (g.generation, g.migrating_from, g.avoid_node, g.avoid_required) == (1, 0, "node-2", True)
    assert a.create_pods == [(1, 0, 1)] and a.delete_pods == [] and a.evict == []
    assert [grp for grp, _ in a.handover] == [1] and "KernelDeadlock" in a.handover[0][1]
    assert 1 not in a.starting  # the survivors' quorum must not wait for the replacement
    assert r.group_phases[1] == PHASE_RUNNING  # the old generation trains on meanwhile
    assert r.state.total_restarts == 0 and r.state.restarts_by_reason == {REASON_NODE_DEGRADED: 1}
    assert r.state.groups[0].generation == 0  # the other group is untouched
    assert any(e.reason == "GroupMigrating" for e in a.events)

    # the replacement runs; the old generation is still there until it leaves by itself
    new = worker(1, 0, generation=1, node="node-1")
    r2 = run(s, r.state, [*pods, new], now=NOW + 5, degraded={"node-2": "x"})
    assert r2.actions.delete_pods == [] and r2.actions.create_pods == []
    assert r2.state.groups[1].migrating_from == 0  # no second migration while one is under way
    # the old generation exited (the lighthouse told it to leave): it is deleted and the migration ends
    old_exited = [dataclasses.replace(p, phase="Failed", exit_code=1) if p.group == 1 else p for p in pods]
    r3 = run(s, r2.state, [*old_exited, new], now=NOW + 6, degraded={"node-2": "x"})
    assert r3.actions.delete_pods == [(names.pod_name(JOB, 1, 0, 0), False)]
    assert r3.state.total_restarts == 0  # the old generation's exit is not a failure
    gone = [p for p in old_exited if p.group != 1]
    r4 = run(s, r3.state, [*gone, new], now=NOW + 7, degraded={"node-2": "x"})
    assert r4.state.groups[1].migrating_from is None and r4.group_phases[1] == PHASE_RUNNING
    assert any(e.reason == "GroupMigrated" for e in r4.actions.events)


def test_an_old_generation_that_never_leaves_is_deleted_after_the_hand_over_timeout():
    s = spec(replicas=2, minReplicas=1, podsPerReplica=1)
    pods = on_node(healthy_job(s), 1, "node-2")
    r = run(s, steady(s), pods, degraded={"node-2": "x"})
    new = worker(1, 0, generation=1, node="node-1")
    late = run(s, r.state, [*pods, new], now=NOW + 301, degraded={"node-2": "x"})
    assert (names.pod_name(JOB, 1, 0, 0), False) in late.actions.delete_pods


def test_healthy_nodes_and_migrate_false_move_nothing():
    s = spec(replicas=2, minReplicas=1, podsPerReplica=1)
    state = steady(s)
    assert run(s, state, healthy_job(s)).actions.handover == []
    off = spec(replicas=2, minReplicas=1, podsPerReplica=1, nodeHealth={"migrate": False})
    view = NodeView(ready=True, conditions=(("KernelDeadlock", "True", ""),))
    assert off.node_health.degraded(view) is None


def test_node_health_policy_defaults_and_lists():
    p = spec().node_health  # no nodeHealth: the spec model's defaults
    assert "KernelDeadlock" in (
        p.degraded(NodeView(ready=True, conditions=(("KernelDeadlock", "True", "hung"),))) or ""
    )
    assert p.degraded(NodeView(ready=True, conditions=(("KernelDeadlock", "False", ""),))) is None
    assert p.degraded(NodeView(ready=True, unschedulable=True)) == "cordoned (spec.unschedulable)"
    assert "NoExecute" in (p.degraded(NodeView(ready=True, taints=(("gpu-broken", "", "NoExecute"),))) or "")
    lost = NodeView(ready=False, taints=(("node.kubernetes.io/unreachable", "", "NoExecute"),))
    assert p.degraded(lost) is None  # a lost node is replaced at once, not migrated
    assert p.degraded(NodeView(ready=True, taints=(("gpu-flaky", "", "NoSchedule"),))) is None
    custom = spec(
        nodeHealth={
            "conditions": [{"type": "GpuXid", "status": "True"}],
            "taints": [{"key": "gpu-flaky"}],
            "cordoned": False,
        }
    ).node_health
    hung = NodeView(ready=True, conditions=(("KernelDeadlock", "True", ""),))
    assert spec(nodeHealth={"conditions": None}).node_health == p  # null reads as unset: the default conditions
    assert spec(nodeHealth={"conditions": []}).node_health.degraded(hung) is None  # [] turns conditions off
    assert custom.degraded(NodeView(ready=True, conditions=(("GpuXid", "True", ""),))) is not None
    assert custom.degraded(NodeView(ready=True, conditions=(("KernelDeadlock", "True", ""),))) is None
    assert custom.degraded(NodeView(ready=True, taints=(("gpu-flaky", "", "NoSchedule"),))) is not None
    assert custom.degraded(NodeView(ready=True, unschedulable=True)) is None
    node = NodeView.from_node(
        {"unschedulable": True, "taints": [{"key": "k", "value": "v", "effect": "NoSchedule"}]},
        {"conditions": [{"type": "Ready", "status": "True"}, {"type": "KernelDeadlock", "status": "True"}]},
    )
    assert node.ready and node.unschedulable and node.taints == (("k", "v", "NoSchedule"),)


def test_unschedulable_deadline_is_opt_in_and_fails_the_job_with_the_schedulers_words():
    msg = "0/3 nodes are available: 3 Insufficient cpu."
    for timeout, expect_failed in ((None, False), (30, False), (10, True)):
        fp = {"maxRestartsPerGroup": 2, "maxTotalRestarts": 5}
        if timeout:
            fp["unschedulableTimeoutSeconds"] = timeout
        s = spec(replicas=1, minReplicas=1, podsPerReplica=1, failurePolicy=fp)
        state = run(s, JobState(), []).state
        stuck = dataclasses.replace(worker(0, 0), phase="Pending", node=None, unschedulable=msg, created=NOW - 20)
        r = run(s, state, [lighthouse(), stuck])
        assert (r.state.outcome == OUTCOME_FAILED) == expect_failed, (timeout, r.state.outcome)
        if expect_failed:
            assert r.state.outcome_reason == "Unschedulable" and msg in r.state.outcome_message
        elif timeout:
            assert r.actions.requeue_after is not None and r.actions.requeue_after <= 10


def test_failures_per_node_reach_the_threshold_once_within_the_window():
    t = NodeFailureTracker(threshold=3, window_s=60)
    assert [t.record("n1", x) for x in (0, 10, 100, 110)] == [False, False, False, False]  # 0 and 10 expired
    assert t.record("n1", 120) is True and t.record("n1", 121) is False  # flagged once
    assert t.record("n2", 120) is False
