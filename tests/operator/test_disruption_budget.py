"""Unit tests of what keeps a drain from taking a job below its quorum (pure logic: no cluster, no clock): the
PodDisruptionBudget's manifest, the worker pods' readiness gate and the condition the operator derives from the
lighthouse's view, and how the planner reads a pod a drain evicted before the migration reached its group."""

from __future__ import annotations

import asyncio
import dataclasses

from ftjob import contract
from ftjob.contract.lighthouse_api import MemberStatus
from ftjob.operator.lighthouse.view import LighthouseView
from ftjob.operator.planning.migration import REASON_NODE_DEGRADED
from ftjob.operator.planning.plan import Observed, Result, plan
from ftjob.operator.reconcile import readiness
from ftjob.operator.reconcile.job_reconciler import JobWorker
from ftjob.operator.resources import manifests as builders
from ftjob.operator.state import names
from ftjob.operator.state.job_state import GroupState, JobState, PodView
from kubernetes.client.rest import ApiException

from tests.support.podfactory import JOB, healthy_job, spec, worker

NOW = 1_000_000.0
NODES = {"node-1": True, "node-2": True}
CORDONED = {"node-2": "cordoned (spec.unschedulable)"}


# --- the budget and the gate ----------------------------------------------------------------------------------------
def test_the_budget_keeps_every_group_s_pods_in_the_quorum_and_lets_the_others_go():
    s = spec(replicas=3, spareReplicas=1, podsPerReplica=2)
    pdb = builders.pod_disruption_budget(JOB, "ns", s)
    assert pdb["apiVersion"] == "policy/v1" and pdb["kind"] == "PodDisruptionBudget"
    assert pdb["metadata"]["name"] == names.disruption_budget(JOB) == "demo-workers"
    assert pdb["metadata"]["namespace"] == "ns" and pdb["metadata"]["labels"][contract.LABEL_JOB] == JOB
    assert pdb["spec"]["minAvailable"] == 8  # (3 groups + 1 spare) x 2 pods: every group, not minReplicas
    labels = pdb["spec"]["selector"]["matchLabels"]
    assert labels == {contract.LABEL_JOB: JOB, contract.LABEL_ROLE: contract.ROLE_WORKER}  # every generation
    assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"  # a pod out of the quorum never holds a drain


def test_without_a_migration_off_cordoned_nodes_the_budget_holds_nothing_up():
    for node_health in ({"migrate": False}, {"cordoned": False}):
        pdb = builders.pod_disruption_budget(JOB, "ns", spec(nodeHealth=node_health))
        assert pdb["spec"]["minAvailable"] == 0, node_health  # nothing would ever move a group: a drain would hang


def test_worker_pods_wait_for_the_in_quorum_gate_besides_the_templates_own():
    mine = {"conditionType": "example.com/warm"}
    template = {"spec": {"containers": [{"name": "t", "image": "i"}], "readinessGates": [mine]}}
    pod = builders.worker_pod(JOB, "ns", spec(template=template), GroupState(index=0), 0)
    assert pod["spec"]["readinessGates"] == [mine, {"conditionType": contract.CONDITION_IN_QUORUM}]
    ours = {"spec": {"containers": [{"name": "t", "image": "i"}],
                     "readinessGates": [{"conditionType": contract.CONDITION_IN_QUORUM}]}}  # fmt: skip
    pod = builders.worker_pod(JOB, "ns", spec(template=ours), GroupState(index=0), 0)
    assert pod["spec"]["readinessGates"] == [{"conditionType": contract.CONDITION_IN_QUORUM}]  # never twice
    assert "readinessGates" not in builders.lighthouse_pod(JOB, "ns", spec(), 0)["spec"]


def test_the_pod_view_reads_the_gate_s_condition():
    def view(conditions: list[dict]) -> PodView:
        return PodView.from_pod({"name": "p", "labels": {}}, {}, {"phase": "Running", "conditions": conditions})

    gate = contract.CONDITION_IN_QUORUM
    assert view([]).in_quorum is None
    assert view([{"type": gate, "status": "True"}]).in_quorum is True
    assert view([{"type": gate, "status": "False"}, {"type": "Ready", "status": "True"}]).in_quorum is False


# --- the condition from the lighthouse's view -----------------------------------------------------------------------
def member(group: str, address: str, in_quorum: bool = True, finished: bool = False) -> MemberStatus:
    return MemberStatus(group=group, incarnation=f"inc-{group}-{address}", step=7, address=address,
                        last_heartbeat_age_s=0.1, in_quorum=in_quorum, asking=False, healing=False,
                        contributing=in_quorum, finished=finished)  # fmt: skip


def lighthouse_view(*members: MemberStatus) -> LighthouseView:
    return LighthouseView(groups={m.group: m for m in members})


def test_every_pod_of_the_generation_the_quorum_lists_is_in_it_and_no_other():
    pods = [
        worker(0, 0, ip="10.0.0.1"),
        worker(0, 1, ip="10.0.0.2"),
        worker(1, 0, ip="10.0.1.1"),  # group 1 migrates: its old generation ...
        worker(1, 1, ip="10.0.1.2"),
        worker(1, 0, generation=1, ip="10.0.2.1"),  # ... and its replacement, starting elsewhere
        worker(1, 1, generation=1, ip="10.0.2.2"),
        worker(2, 0, ip="10.0.3.1"),
        worker(2, 1, ip="10.0.3.2", phase="Failed", exit_code=143),  # terminal: no condition to set
    ]
    old_still_in = lighthouse_view(member("0", "10.0.0.1:29520"), member("1", "10.0.1.1:29520"),
                                   member("2", "10.0.3.1:29520", in_quorum=False))  # fmt: skip
    got = readiness.in_quorum(old_still_in, pods)
    assert got == {"demo-g0-0-r0": True, "demo-g0-0-r1": True, "demo-g1-0-r0": True, "demo-g1-0-r1": True,
                   "demo-g1-1-r0": False, "demo-g1-1-r1": False, "demo-g2-0-r0": False}  # fmt: skip
    registered = lighthouse_view(member("1", "10.0.2.1:29520", in_quorum=False))  # the new one, not asked yet
    assert not any(readiness.in_quorum(registered, pods)[p] for p in ("demo-g1-0-r0", "demo-g1-1-r0"))
    took_over = lighthouse_view(member("1", "10.0.2.1:29520"))
    got = readiness.in_quorum(took_over, pods)
    assert (got["demo-g1-0-r0"], got["demo-g1-0-r1"], got["demo-g1-1-r0"], got["demo-g1-1-r1"]) == (
        False, False, True, True)  # fmt: skip
    done = lighthouse_view(member("0", "10.0.0.1:29520", finished=True))
    assert not readiness.in_quorum(done, pods)["demo-g0-0-r0"]  # a finished group holds nothing a drain must wait for
    v6 = [worker(0, 0, ip="fd00::5")]
    assert readiness.in_quorum(lighthouse_view(member("0", "[fd00::5]:29520")), v6) == {"demo-g0-0-r0": True}


def test_only_changed_conditions_are_patched_and_pods_leaving_the_quorum_first():
    pods = [
        dataclasses.replace(worker(0, 0, ip="10.0.0.1"), in_quorum=True),  # unchanged
        dataclasses.replace(worker(1, 0, ip="10.0.1.1"), in_quorum=True),  # handed over: leaves
        worker(1, 0, generation=1, ip="10.0.2.1"),  # its replacement joins (never had the condition)
        worker(2, 0, ip="10.0.3.1"),  # never in a quorum: an absent condition already reads False
    ]
    view = lighthouse_view(member("0", "10.0.0.1:1"), member("1", "10.0.2.1:1"), member("2", "10.0.3.1:1", False))
    changes = readiness.gate_changes(view, pods)
    assert [(c.pod, c.in_quorum) for c in changes] == [("demo-g1-0-r0", False), ("demo-g1-1-r0", True)]
    cond = readiness.condition(changes[1], "2026-01-01T00:00:00Z")
    assert cond["type"] == contract.CONDITION_IN_QUORUM and cond["status"] == "True"
    assert cond["reason"] == readiness.REASON_IN_QUORUM and "replica group 1 generation 1" in cond["message"]
    assert readiness.condition(changes[0], "t")["status"] == "False"


# --- a drain's eviction in the planner ------------------------------------------------------------------------------
def run(s, state, pods, now=NOW, degraded=None, deleting=()) -> Result:
    return plan(JOB, s, state, Observed(list(pods), NODES, set(deleting), now, set(), {}, degraded or {}))


def steady(s) -> JobState:
    return run(s, run(s, JobState(), []).state, healthy_job(s)).state


def on_node(pods, group, node):
    return [dataclasses.replace(p, node=node) if p.group == group else p for p in pods]


def test_a_pod_a_drain_evicts_before_its_migration_is_replaced_without_spending_budget():
    """The operator had not migrated group 1 yet (e.g. it was not in a quorum, so the budget let it go): its rank-0
    pod is being deleted by the drain, its rank-1 pod, on another node, exited 143 with it (the group left together).
    A migration in effect: a new generation off the node, no budget, the node not blamed for a failure."""
    s = spec(replicas=2, minReplicas=1, podsPerReplica=2)
    pods = healthy_job(s)
    pods = [dataclasses.replace(p, node="node-2", deletion_time=NOW - 1) if p.name == "demo-g1-0-r0" else p
            for p in pods]  # fmt: skip
    pods = [dataclasses.replace(p, phase="Failed", exit_code=contract.EXIT_TERMINATED) if p.name == "demo-g1-0-r1"
            else p for p in pods]  # fmt: skip
    r = run(s, steady(s), pods, degraded=CORDONED)
    g = r.state.groups[1]
    assert g.generation == 1 and (g.avoid_node, g.avoid_required) == ("node-2", True)
    assert g.last_failure_reason == REASON_NODE_DEGRADED and "evicted from node node-2" in g.last_failure
    assert r.state.total_restarts == 0 and g.restart_times == []  # no budget spent
    assert r.state.restarts_by_reason == {REASON_NODE_DEGRADED: 1}
    assert r.actions.failed_nodes == []  # a drain is no fault of the node's (the cordon-after-failures rule)
    assert r.actions.create_pods == [(1, 0, 1), (1, 1, 1)] and r.state.groups[0].generation == 0
    assert any("no budget spent" in e.message for e in r.actions.events if e.reason == "GroupRestart")


def test_the_same_deletion_on_a_healthy_node_is_a_failure_that_spends_budget():
    s = spec(replicas=2, minReplicas=1, podsPerReplica=1)
    pods = [dataclasses.replace(p, deletion_time=NOW - 1) if p.name == "demo-g1-0-r0" else p for p in healthy_job(s)]
    r = run(s, steady(s), pods, degraded=CORDONED)  # node-2 is cordoned, but the pod is on node-1
    assert r.state.groups[1].last_failure_reason == "PodDeleted" and r.state.total_restarts == 1


def test_a_migrated_group_s_old_generation_evicted_by_the_drain_is_no_failure():
    s = spec(replicas=2, minReplicas=1, podsPerReplica=1)
    pods = on_node(healthy_job(s), 1, "node-2")
    migrating = run(s, steady(s), pods, degraded=CORDONED)
    assert migrating.state.groups[1].migrating_from == 0
    new = worker(1, 0, generation=1, node="node-1", ip="10.0.9.9")
    evicted = [dataclasses.replace(p, deletion_time=NOW + 4, phase="Failed", exit_code=contract.EXIT_TERMINATED)
               if p.group == 1 else p for p in pods]  # fmt: skip
    r = run(s, migrating.state, [*evicted, new], now=NOW + 5, degraded=CORDONED)
    assert r.state.groups[1].generation == 1 and r.state.total_restarts == 0
    assert r.state.restarts_by_reason == {REASON_NODE_DEGRADED: 1}  # the migration's, once
    assert r.actions.create_pods == [] and r.actions.evict == []


# --- the worker's writes ---------------------------------------------------------------------------------------------
class RecordingKube:
    """What the job's worker writes: budgets and pod conditions, in order; ``refuse`` makes every write fail."""

    def __init__(self) -> None:
        self.budgets: list[dict] = []
        self.conditions: list[tuple[str, str]] = []  # (pod, status)
        self.refuse: ApiException | None = None

    async def apply_disruption_budget(self, obj: dict) -> None:
        if self.refuse is not None:
            raise self.refuse
        self.budgets.append(obj)

    async def set_pod_condition(self, namespace: str, name: str, condition: dict) -> bool:
        self.conditions.append((name, condition["status"]))
        return True


def job_worker(kube: RecordingKube) -> JobWorker:
    body = {"apiVersion": f"{contract.API_GROUP}/{contract.API_VERSION}", "kind": contract.KIND,
            "metadata": {"name": JOB, "namespace": "ns", "uid": "u1"}, "spec": {}}  # fmt: skip
    return JobWorker("ns", JOB, body, kube, None, {}, None, lambda *_: None, node_policy=object())  # type: ignore[arg-type]


def test_the_worker_writes_the_budget_once_per_spec_and_owned_by_the_job():
    kube = RecordingKube()
    w = job_worker(kube)
    asyncio.run(w._apply_budget(spec(replicas=3)))
    asyncio.run(w._apply_budget(spec(replicas=3)))  # unchanged: not written again (until the refresh is due)
    asyncio.run(w._apply_budget(spec(replicas=4)))  # scaled: minAvailable follows at once
    assert [b["spec"]["minAvailable"] for b in kube.budgets] == [6, 8]
    assert kube.budgets[0]["metadata"]["ownerReferences"][0]["uid"] == "u1"
    refused = RecordingKube()
    refused.refuse = ApiException(status=403, reason="Forbidden")
    w = job_worker(refused)
    asyncio.run(w._apply_budget(spec()))  # no RBAC for budgets: logged, the reconcile goes on
    refused.refuse = None
    asyncio.run(w._apply_budget(spec()))
    assert refused.budgets == []  # retried only a minute later, not at every reconcile


def test_the_worker_sets_the_gate_from_a_fresh_view_only_leavers_first_and_once():
    kube = RecordingKube()
    w = job_worker(kube)
    state = JobState()
    pods = [
        dataclasses.replace(worker(1, 0, ip="10.0.1.1"), in_quorum=True),  # handed over: leaves
        worker(1, 0, generation=1, ip="10.0.2.1"),  # its replacement, now the quorum's member
    ]
    w.lh_view, w.lh_view_at, w.lh_view_generation = lighthouse_view(member("1", "10.0.2.1:1")), NOW, 0
    asyncio.run(w._sync_readiness(pods, state, NOW + 60))  # a view a minute old proves nothing: no change
    assert kube.conditions == []
    asyncio.run(w._sync_readiness(pods, state, NOW + 1))
    assert kube.conditions == [("demo-g1-0-r0", "False"), ("demo-g1-1-r0", "True")]
    asyncio.run(w._sync_readiness(pods, state, NOW + 2))  # the pod index has not caught up yet: not again
    assert len(kube.conditions) == 2
    other = RecordingKube()
    w = job_worker(other)
    w.lh_view, w.lh_view_at, w.lh_view_generation = lighthouse_view(member("1", "10.0.2.1:1")), NOW, 1
    asyncio.run(w._sync_readiness(pods, state, NOW + 1))  # a view of another lighthouse than the current one (0)
    assert other.conditions == []
