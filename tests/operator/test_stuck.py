"""Unit tests of why a group cannot start (pure logic): pods as the apiserver reports them -> reason and message."""

from __future__ import annotations

from ftjob.contract.lighthouse_api import MemberStatus, StatusResponse
from ftjob.operator.lighthouse.view import LighthouseView
from ftjob.operator.planning.stuck import group_blocker, job_blocker
from ftjob.operator.state.job_state import PodView
from ftjob.operator.state.status import build_status
from test_plan import NOW, run, steady

from tests.support.podfactory import JOB, healthy_job, spec, worker

UNSCHEDULABLE = "0/2 nodes are available: 2 Insufficient nvidia.com/gpu. preemption: 0/2 nodes are available"


def _pod(status: dict) -> PodView:
    meta = {"name": "j-g0-0-r0", "labels": {"ftjob.dev/role": "worker", "ftjob.dev/group": "0"}}
    return PodView.from_pod(meta, {}, status)


def test_pod_view_reads_the_schedulers_and_the_kubelets_words():
    pending = _pod({"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": UNSCHEDULABLE}]})  # fmt: skip
    assert pending.unschedulable == UNSCHEDULABLE
    waiting = {"reason": "ImagePullBackOff", "message": "Back-off pulling x"}
    pulling = _pod({"phase": "Pending", "containerStatuses": [{"name": "trainer", "state": {"waiting": waiting}}]})
    assert (pulling.waiting_reason, pulling.waiting_message, pulling.waiting_container) == (
        "ImagePullBackOff", "Back-off pulling x", "trainer")  # fmt: skip
    starting = _pod({"phase": "Pending", "containerStatuses": [
        {"name": "trainer", "state": {"waiting": {"reason": "ContainerCreating"}}}]})  # fmt: skip
    assert group_blocker([starting]) is None, "a container that is still being created is not stuck"
    assert group_blocker([pulling]).reason == "ImagePullBackOff"
    assert group_blocker([pulling, pending]).reason == "Unschedulable", "the scheduler's reason comes first"
    refused = group_blocker([], "403 Forbidden: exceeded quota")
    assert refused.reason == "PodCreationRefused" and "exceeded quota" in refused.message


def test_job_blocker_names_the_groups_and_keeps_the_underlying_message():
    b = {0: group_blocker([], "403 Forbidden: exceeded quota: q"), 2: group_blocker([], "403 Forbidden: quota")}
    line = job_blocker(b)
    assert line.reason == "PodCreationRefused" and line.message.startswith("replica groups [0, 2] cannot start: 403")
    assert job_blocker({}) is None
    both = job_blocker({**b, -1: group_blocker([], "403 Forbidden: quota")})
    assert both.message.startswith("replica groups [0, 2] and the lighthouse cannot start"), both


def test_degraded_condition_group_entry_and_reason_say_why_groups_cannot_start():
    s = spec()
    state = steady(s)
    pods = healthy_job(s)
    stuck = worker(1, 0, phase="Pending")
    stuck = PodView(**{**stuck.__dict__, "unschedulable": UNSCHEDULABLE})
    pods[pods.index(worker(1, 0))] = stuck
    pods = [p for p in pods if p.group != 2]  # the apiserver refused to create group 2's pods
    r = run(s, state, pods)
    refused = {2: "403 Forbidden: exceeded quota"}
    status = build_status(job=JOB, spec=s, state=r.state, phases=r.group_phases, pods=pods, lighthouse=None,
                          previous=None, generation=1, now=NOW, create_refused=refused)  # fmt: skip
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "PodCreationRefused", degraded
    assert "exceeded quota" in degraded["message"] and status["reason"] == "PodCreationRefused"
    groups = {g["index"]: g for g in status["replicaGroups"]}
    assert groups[1]["waiting"].startswith("Unschedulable: pod ") and UNSCHEDULABLE in groups[1]["waiting"]
    assert groups[2]["waiting"].startswith("PodCreationRefused: 403") and "waiting" not in groups[0]
    healthy = build_status(job=JOB, spec=s, state=r.state, phases=r.group_phases, pods=healthy_job(s),
                           lighthouse=None, previous=None, generation=1, now=NOW)  # fmt: skip
    assert "reason" not in healthy


def test_running_says_training_is_paused_when_the_lighthouse_hears_from_fewer_than_min_replicas():
    s = spec()  # replicas 3, minReplicas 2
    state = steady(s)
    pods = healthy_job(s)  # every pod runs: the groups are hung or cut off, not down
    r = run(s, state, pods)

    def lighthouse(groups: list[str], quorum_id: int = 4) -> LighthouseView:
        flags = dict(in_quorum=True, asking=True, healing=False, contributing=True, finished=False)
        members = [MemberStatus(group=g, incarnation=g, step=9, address="", last_heartbeat_age_s=0.1, **flags)
                   for g in groups]  # fmt: skip
        return LighthouseView.from_status(StatusResponse(
            quorum_id=quorum_id, max_step=9, abort_below=0, min_replicas=2, quorum_groups=groups, members=members,
            starting=[], blocked_reason="", history=[]))  # fmt: skip

    def running(lh: LighthouseView) -> dict:
        status = build_status(job=JOB, spec=s, state=r.state, phases=r.group_phases, pods=pods, lighthouse=lh,
                              previous=None, generation=1, now=NOW)  # fmt: skip
        return next(c for c in status["conditions"] if c["type"] == "Running")

    paused = running(lighthouse(["0"]))
    assert paused["status"] == "False" and paused["reason"] == "BelowMinReplicas", paused
    assert "hears from 1 replica groups, fewer than minReplicas=2" in paused["message"]
    assert running(lighthouse(["0", "1"]))["reason"] == "QuorumPossible"
    assert running(lighthouse(["0"], quorum_id=0))["reason"] == "QuorumPossible", "before the first quorum: starting"
