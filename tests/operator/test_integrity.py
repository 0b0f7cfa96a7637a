"""Unit tests of the operator's integrity side (no cluster): spec.integrity parsed and passed to the pods, groups the
lighthouse evicted for the gradient guard or a divergent digest replaced with their own reason (once), the audit
records mirrored as Events exactly once, and the integrity counters in status."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from ftjob import contract
from ftjob.contract.lighthouse_api import AuditRecord, DroppedEvent, IntegrityStatus, QuorumEvent, StatusResponse
from ftjob.operator.kubectl.status_view import header
from ftjob.operator.lighthouse.audit_mirror import AuditMark, AuditMirror, event_for, event_name, unmirrored
from ftjob.operator.lighthouse.view import LighthouseView
from ftjob.operator.planning.integrity_evictions import Drop, integrity_drops, integrity_reason, status_integrity
from ftjob.operator.planning.plan import Observed, Result, plan
from ftjob.operator.resources import manifests as builders
from ftjob.operator.state import names
from ftjob.operator.state.job_spec import JobSpec
from ftjob.operator.state.job_state import GroupState, JobState
from ftjob.operator.state.status import build_status, state_from_status

from tests.support.podfactory import JOB, healthy_job, spec, worker

NOW = 3_000_000.0
NODES = {"node-1": True, "node-2": True}
GUARD = "evicted: gradient_guard: 3 refused steps within 600s (nonfinite gradient)"
DIVERGENT = "evicted: divergent: digest at step 60 differs from the majority of 3 groups"


def env_of(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container["env"]}


def steady(s: JobSpec, now: float = NOW) -> JobState:
    state = plan(JOB, s, JobState(), Observed([], NODES, set(), now)).state
    return plan(JOB, s, state, Observed(healthy_job(s), NODES, set(), now)).state


def run(s: JobSpec, state: JobState, pods, now: float, drops=None) -> Result:
    """``drops``: group -> (wall time, reason[, generation]) of its latest eviction by the lighthouse."""
    observed = {g: Drop(*d) for g, d in (drops or {}).items()}
    return plan(JOB, s, state, Observed(list(pods), NODES, set(), now, integrity_drops=observed))


# --- spec.integrity -----------------------------------------------------------------------------------------------
def test_integrity_defaults_match_the_crd_and_reach_the_pods():
    s = spec()
    i = s.integrity
    assert (i.guard_enabled, i.norm_ratio, i.max_offences, i.window_s, i.digest_every_steps) == (True, 100, 3, 600, 100)
    pod = builders.worker_pod(JOB, "ns", s, GroupState(index=1, generation=2), rank=0)
    env = env_of(pod["spec"]["containers"][0])
    assert env[contract.ENV_GUARD] == "1" and env[contract.ENV_GUARD_NORM_RATIO] == "100"
    assert env[contract.ENV_DIGEST_EVERY] == "100" and env[contract.ENV_GENERATION] == "2"
    lh = env_of(builders.lighthouse_pod(JOB, "ns", s, 0)["spec"]["containers"][0])
    assert lh[contract.ENV_GUARD_MAX_OFFENCES] == "3" and lh[contract.ENV_GUARD_WINDOW_S] == "600"


def test_integrity_settings_win_over_the_template_env():
    user_env = [{"name": contract.ENV_GENERATION, "value": "7"}, {"name": contract.ENV_FAULT_INJECTION, "value": "g"}]
    template = {"spec": {"containers": [{"name": "t", "image": "i", "env": user_env}]}}
    s = spec(template=template, integrity={"gradientGuard": {"enabled": False, "normRatio": 4.5, "maxOffences": 1,
             "windowSeconds": 30}, "digestEverySteps": 5})  # fmt: skip
    env = env_of(builders.worker_pod(JOB, "ns", s, GroupState(index=1), rank=0)["spec"]["containers"][0])
    assert env[contract.ENV_GUARD] == "0" and env[contract.ENV_GUARD_NORM_RATIO] == "4.5"
    assert env[contract.ENV_DIGEST_EVERY] == "5" and env[contract.ENV_GENERATION] == "0"
    assert env[contract.ENV_FAULT_INJECTION] == "g", "the user's own env stays"
    lh = env_of(builders.lighthouse_pod(JOB, "ns", s, 0)["spec"]["containers"][0])
    assert lh[contract.ENV_GUARD_MAX_OFFENCES] == "1" and lh[contract.ENV_GUARD_WINDOW_S] == "30"


@pytest.mark.parametrize(
    ("integrity", "words"),
    [
        ({"gradientGuard": {"normRatio": 1}}, "spec.integrity.gradientGuard.normRatio must be a number > 1, got 1"),
        ({"gradientGuard": {"normRatio": "x"}}, "normRatio must be a number > 1, got 'x'"),
        ({"gradientGuard": {"maxOffences": 0}}, "spec.integrity.gradientGuard.maxOffences must be an integer >= 1"),
        ({"gradientGuard": {"maxOffences": 2.5}}, "maxOffences must be an integer >= 1, got 2.5"),
        ({"gradientGuard": {"maxOffences": True}}, "maxOffences must be an integer >= 1, got True"),
        ({"gradientGuard": {"windowSeconds": 0}}, "spec.integrity.gradientGuard.windowSeconds must be an integer >= 1"),
        ({"gradientGuard": {"enabled": "yes"}}, "spec.integrity.gradientGuard.enabled must be true or false"),
        ({"digestEverySteps": -1}, "spec.integrity.digestEverySteps must be an integer >= 0, got -1"),
    ],
)
def test_bad_integrity_values_are_refused_with_the_field_and_the_rule(integrity, words):
    with pytest.raises(ValueError) as e:
        spec(integrity=integrity)
    assert words in str(e.value)


# --- replacing a group the lighthouse evicted ---------------------------------------------------------------------
def test_reason_words():
    assert integrity_reason(GUARD) == "GradientGuard" and integrity_reason(DIVERGENT) == "ReplicaDivergence"
    assert integrity_reason("evicted: pod died") is None and integrity_reason("gradient_guard: x") is None
    assert integrity_reason("evicted: divergent") == "ReplicaDivergence"


def test_a_guard_eviction_replaces_the_running_group_at_once_and_avoids_its_node():
    s = spec()
    state = steady(s)
    pods = healthy_job(s)
    pods[pods.index(worker(1, 0))] = worker(1, 0, node="node-2")
    r = run(s, state, pods, NOW + 30, {1: (NOW + 29, GUARD)})
    a, g = r.actions, r.state.groups[1]
    assert g.generation == 1 and (g.avoid_node, g.avoid_required) == ("node-2", True)
    assert r.state.restarts_by_reason == {"GradientGuard": 1} and a.restarts == ["GradientGuard"]
    assert r.state.total_restarts == 1, "it spends restart budget, as any group failure"
    assert not a.evict, "the lighthouse already dropped it"
    assert sorted(a.delete_pods) == [(names.pod_name(JOB, 1, 0, 0), False), (names.pod_name(JOB, 1, 0, 1), False)]
    assert sorted(a.create_pods) == [(1, 0, 1), (1, 1, 1)]
    [event] = a.events
    assert event.reason == "GroupRestart" and "gradient_guard: 3 refused steps" in event.message, event
    assert g.last_failure_reason == "GradientGuard" and "node node-2" in g.last_failure
    pod = builders.worker_pod(JOB, "ns", s, g, 0)
    terms = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"][0]["matchExpressions"][0]["values"] == ["node-2"]


def test_the_evicted_trainers_exit_is_the_same_failure_and_never_counted_twice():
    s = spec()
    state = steady(s)
    pods = healthy_job(s)
    pods[pods.index(worker(2, 0))] = worker(2, 0, phase="Failed", exit_code=1)
    r = run(s, state, pods, NOW + 30, {2: (NOW + 29, DIVERGENT)})
    assert r.state.restarts_by_reason == {"ReplicaDivergence": 1}, "not ExitCode: the eviction caused the exit"
    assert "digest at step 60 differs" in r.state.groups[2].last_failure
    # the next reconcile sees the old generation's pods and the same drop in the lighthouse's history
    new = [worker(2, rank, generation=1, phase="Pending") for rank in range(2)]
    later = run(s, r.state, [*pods, *new], NOW + 31, {2: (NOW + 29, DIVERGENT)})
    assert later.state.restarts_by_reason == {"ReplicaDivergence": 1} and later.state.groups[2].generation == 1
    assert not later.actions.restarts and not later.actions.create_pods


def test_an_eviction_before_the_generation_began_is_an_earlier_generations():
    s = spec()
    state = steady(s)
    pods = healthy_job(s)
    pods[pods.index(worker(0, 1))] = worker(0, 1, phase="Failed", exit_code=3)
    r = run(s, state, pods, NOW + 30, {0: (NOW - 5, GUARD)})
    assert r.state.restarts_by_reason == {"ExitCode": 1}
    assert r.state.groups[0].avoid_required is False
    quiet = run(s, steady(s), healthy_job(s), NOW + 30, {0: (NOW - 5, GUARD)})
    assert not quiet.actions.restarts


def test_a_status_without_generation_since_falls_back_to_the_pods_creation():
    s = spec()
    state = steady(s)
    for g in state.groups.values():
        g.generation_since = None
    pods = [dataclasses.replace(p, created=NOW + 10) if p.group == 1 else p for p in healthy_job(s)]
    assert not run(s, state, pods, NOW + 30, {1: (NOW + 5, GUARD)}).actions.restarts
    assert run(s, state, pods, NOW + 30, {1: (NOW + 20, GUARD)}).state.restarts_by_reason == {"GradientGuard": 1}


def test_the_recovering_condition_says_what_the_lighthouse_saw_and_the_memory_round_trips():
    s = spec()
    state = steady(s)
    r = run(s, state, healthy_job(s), NOW + 30, {1: (NOW + 29, GUARD)})
    status = build_status(job=JOB, spec=s, state=r.state, phases=r.group_phases, pods=healthy_job(s), lighthouse=None,
                          previous=None, generation=1, now=NOW + 30)  # fmt: skip
    cond = next(c for c in status["conditions"] if c["type"] == "Recovering")
    assert cond["status"] == "True" and cond["reason"] == "GradientGuard", cond
    assert "group 1: the lighthouse evicted replica group 1: gradient_guard: 3 refused steps" in cond["message"]
    g1 = next(g for g in status["replicaGroups"] if g["index"] == 1)
    assert g1["lastFailureReason"] == "GradientGuard" and status["restartsByReason"] == {"GradientGuard": 1}
    back = state_from_status(status)
    assert back.groups[1].generation_since == pytest.approx(NOW + 30)
    assert back.groups[1].last_failure_reason == "GradientGuard"


# --- the lighthouse's answer --------------------------------------------------------------------------------------
def record(seq: int, kind: str = "guard", group: str | None = "1", reason: str = "nonfinite gradient") -> AuditRecord:
    return AuditRecord(seq=seq, time=float(seq), wall_time=NOW + seq, kind=kind, group=group, actor="group 0",
                       reason=reason, outcome="step not committed")  # fmt: skip


def answer(history=(), audit=(), integrity=None, clock=100.0) -> StatusResponse:
    return StatusResponse(quorum_id=3, max_step=60, abort_below=0, min_replicas=1, quorum_groups=["0", "2"],
                          members=[], starting=[], blocked_reason="", history=list(history), clock=clock,
                          audit=list(audit), integrity=integrity or IntegrityStatus())  # fmt: skip


def test_the_view_keeps_each_groups_latest_integrity_eviction_with_its_age():
    view = LighthouseView.from_status(answer(history=[
        DroppedEvent(time=50.0, group="1", reason=GUARD),
        QuorumEvent(time=60.0, quorum_id=3, groups=["0", "2"], step=40),
        DroppedEvent(time=70.0, group="2", reason="evicted: pod died"),
        DroppedEvent(time=90.0, group="0", reason=DIVERGENT),
    ], audit=[record(1), record(2)]))  # fmt: skip
    assert view.integrity_drops == {"1": Drop(50.0, GUARD), "0": Drop(10.0, DIVERGENT)}
    assert integrity_drops(view.integrity_drops, NOW) == {1: Drop(NOW - 50, GUARD), 0: Drop(NOW - 10, DIVERGENT)}
    assert [r.seq for r in view.audit] == [1, 2] and view.integrity is not None


# --- audit records -> Events, exactly once ------------------------------------------------------------------------
def test_audit_records_become_events_once_per_lighthouse_generation():
    records = [record(1), record(2, "divergence", "2", "digest at step 60 differs"), record(3, "refused", None,
               "401 unauthenticated"), record(4, "evict", "1", "gradient_guard: 3 offences"),
               record(5, "evict", "2", "operator: scaled down")]  # fmt: skip
    events, mark = unmirrored(records, 0, AuditMark())
    assert [(e.type, e.reason) for e in events] == [
        ("Warning", "GradientGuardRefused"), ("Warning", "ReplicaDivergent"), ("Warning", "LighthouseRefused"),
        ("Warning", "LighthouseEvictedGroup"), ("Normal", "LighthouseEvictedGroup")]  # fmt: skip
    assert mark == AuditMark(0, 5)
    assert events[0].message.startswith("replica group 1: nonfinite gradient -> step not committed (by group 0")
    assert unmirrored(records, 0, mark)[0] == [], "a repeated poll mirrors nothing"
    again, mark2 = unmirrored([*records, record(6)], 0, mark)
    assert [e.seq for e in again] == [6] and mark2 == AuditMark(0, 6)
    fresh, mark3 = unmirrored([record(1)], 1, mark2)  # a new lighthouse counts from 1 again
    assert [e.seq for e in fresh] == [1] and mark3 == AuditMark(1, 1)
    assert event_name(JOB, "0A1b2c3d-ffff", fresh[0]) == "demo.audit.0a1b2c3d.1-1"


class FakeKube:
    """Events by name; the apiserver refuses a second Event of the same name (which post_event counts as posted)."""

    def __init__(self, fail_from: int | None = None) -> None:
        self.events: dict[str, tuple[str, str, str]] = {}
        self.fail_from = fail_from

    async def post_event(self, job, type_, reason, message, name=None) -> bool:
        seq = int(name.rsplit("-", 1)[1])
        if self.fail_from is not None and seq >= self.fail_from:
            return False
        self.events.setdefault(name, (type_, reason, message))
        return True


def test_the_mirror_advances_only_over_posted_events_and_a_restarted_operator_posts_nothing_twice():
    job = {"metadata": {"name": JOB, "namespace": "ns", "uid": "abcdef12-3456"}}
    kube = FakeKube(fail_from=3)
    mirror = AuditMirror(kube, AuditMark())
    asyncio.run(mirror.mirror(job, [record(1), record(2), record(3), record(4)], 0))
    assert mirror.mark == AuditMark(0, 2) and len(kube.events) == 2
    kube.fail_from = None
    asyncio.run(mirror.mirror(job, [record(1), record(2), record(3), record(4)], 0))
    assert mirror.mark == AuditMark(0, 4)
    assert sorted(kube.events) == [f"demo.audit.abcdef12.0-{i}" for i in (1, 2, 3, 4)]
    # a restarted operator reads the mark from status; even from an older mark, names keep Events single
    status = {"integrity": status_integrity(None, IntegrityStatus(), 0, mirror.mark.seq)}
    restarted = AuditMirror(kube, AuditMark.from_status(status))
    assert restarted.mark == AuditMark(0, 4)
    asyncio.run(AuditMirror(kube, AuditMark(0, 1)).mirror(job, [record(i) for i in range(1, 5)], 0))
    assert len(kube.events) == 4


def test_integrity_counters_add_up_over_lighthouse_restarts():
    first = IntegrityStatus(guard_offences={"1": 3}, guard_evictions={"1": 1}, divergences={"2": 1},
                            digests_compared=12, last_compared_step=60)  # fmt: skip
    s0 = status_integrity(None, first, 0, 4)
    assert {k: s0[k] for k in ("guardOffences", "guardEvictions", "divergences", "digestsCompared")} == {
        "guardOffences": 3, "guardEvictions": 1, "divergences": 1, "digestsCompared": 12}  # fmt: skip
    assert (s0["lastComparedStep"], s0["auditSeq"], s0["lighthouseGeneration"]) == (60, 4, 0)
    assert status_integrity(s0, first, 0, 4) == s0, "a repeated poll changes nothing"
    assert status_integrity(s0, None, None, 4) == s0, "no answer yet (a restarted operator) keeps what was there"
    s1 = status_integrity(s0, IntegrityStatus(guard_offences={"0": 1}, digests_compared=2), 1, 1)
    assert (s1["guardOffences"], s1["guardEvictions"], s1["divergences"], s1["digestsCompared"]) == (4, 1, 1, 14)
    assert s1["lastComparedStep"] == 60 and s1["auditSeq"] == 1 and s1["lighthouseGeneration"] == 1
    s1b = status_integrity(s1, IntegrityStatus(guard_offences={"0": 2}, digests_compared=3, last_compared_step=80),
                           1, 1)  # fmt: skip
    assert (s1b["guardOffences"], s1b["digestsCompared"], s1b["lastComparedStep"]) == (5, 15, 80)
    screen = "\n".join(header({"metadata": {"name": JOB}, "status": {"integrity": s1b}}, NOW))
    assert "Integrity: guard refused 5, evicted 1   divergences 1   digests compared 15 (last at step 80)" in screen


def test_a_stalled_group_is_replaced_at_once_as_stalled_and_its_node_only_preferred_against():
    s = spec()
    state = steady(s)
    pods = healthy_job(s)
    pods[pods.index(worker(1, 0))] = worker(1, 0, node="node-2")
    stalled = "evicted: stalled: no progress for 1.05s (limit 1.00s) while 2 other group(s) wait"
    assert integrity_reason(stalled) == "Stalled"
    r = run(s, state, pods, NOW + 30, {1: (NOW + 29, stalled)})
    g = r.state.groups[1]
    assert r.state.restarts_by_reason == {"Stalled": 1} and r.actions.restarts == ["Stalled"]
    assert g.generation == 1 and "no progress for 1.05s" in g.last_failure
    assert (g.avoid_node, g.avoid_required) == ("node-2", False), "a hang is no integrity verdict: soft avoidance"


def test_the_stall_rule_settings_reach_the_lighthouse_pod():
    lh = env_of(builders.lighthouse_pod(JOB, "ns", spec(), 0)["spec"]["containers"][0])
    assert (lh[contract.ENV_STALL_FACTOR], lh[contract.ENV_STALL_FLOOR_S]) == ("3", "1"), "the CRD's defaults"
    tuned = spec(lighthouse={"stallFactor": 0, "stallFloorSeconds": 2.5})
    lh = env_of(builders.lighthouse_pod(JOB, "ns", tuned, 0)["spec"]["containers"][0])
    assert (lh[contract.ENV_STALL_FACTOR], lh[contract.ENV_STALL_FLOOR_S]) == ("0", "2.5")


def test_an_outdated_incarnation_refused_after_its_drop_is_routine():
    gone = "GET /v1/watch: group '1' incarnation 'ab' was {}"
    records = [
        record(1, "refused", "1", gone.format("handed_over: migrating")).model_copy(update={"outcome": "refused 410"}),
        record(2, "refused", "1", gone.format("evicted; restart")).model_copy(update={"outcome": "refused 410"}),
        record(3, "refused", None, "401 unauthenticated").model_copy(update={"outcome": "refused 401"}),
    ]
    assert [(event_for(r, 1).type, event_for(r, 1).reason) for r in records] == [
        ("Normal", "OutdatedIncarnationRefused"),
        ("Normal", "OutdatedIncarnationRefused"),
        ("Warning", "LighthouseRefused"),
    ]
