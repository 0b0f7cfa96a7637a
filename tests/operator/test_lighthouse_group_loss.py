"""Losing the lighthouse together with groups costs each lost group exactly one replacement: the real reference
trainer under the operator, three groups, and in each round the lighthouse pod force-deleted in one call with one
group's pod or two groups' pods. A force-deleted pod's process may outlive its pod for a moment and
reach the replacement lighthouse; it belongs to a replaced generation, so the lighthouse refuses it (or evicts it as
outdated) and whatever happens to it is charged to nobody: every lost group's generation rises by exactly one per
loss, no group is restarted as Stalled or HeartbeatLost, no healthy group is evicted or replaced, and the job
Succeeds with every sample trained once and equal parameters everywhere (less a quorum of dying processes that
committed a step among themselves on the old lighthouse: a dead branch nobody inherits)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from ftjob import contract
from ftjob.contract.lighthouse_api import DroppedEvent, StatusResponse

from tests.support.cluster import kubectl
from tests.support.operator_cluster import (
    condition,
    create_job,
    get_job,
    lighthouse_pod,
    lighthouse_status,
    running_groups,
)
from tests.support.polling import wait_for
from tests.support.trainer_runs import check_run, training_job

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

JOB = "lgl"
GROUPS = 3
STEPS = 1200  # 0.2 s a step: about four minutes, long enough for every round below to land mid-run
ROUNDS: list[tuple[int, ...]] = [(1,), (1, 2), (0,), (0, 2), (2,)]  # lost with the lighthouse, round by round
STEPS_PER_ROUND = 20  # training goes on this far past a loss before the next one
MARGIN = 150  # a round starts only this far from the end (else the run was too short for the test to mean anything)


def manifest(records: Path) -> dict[str, Any]:
    m = training_job(JOB, STEPS, records, replicas=GROUPS, minReplicas=1)
    # A replacement lighthouse waits this long from the first group's return for the others: long enough that a
    # surviving group still reconnecting is not left out of a step (it would then diverge from the others)
    m["spec"]["lighthouse"]["joinTimeoutSeconds"] = 10
    # a group lost in several rounds is a deliberate loss each time, not a crash loop for the budget to stop
    m["spec"].setdefault("failurePolicy", {})["maxRestartsPerGroup"] = len(ROUNDS)
    return m


def job_groups(job: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {g["index"]: g for g in (job.get("status") or {}).get("replicaGroups") or []}


def lighthouse_view(kube: Any, namespace: str) -> StatusResponse | None:
    try:
        return lighthouse_status(kube.core, namespace, JOB)
    except (AssertionError, OSError):
        return None  # not (or no longer) exactly one running lighthouse


def settled(kube: Any, namespace: str, generations: dict[int, int], lighthouse_uid: str | None, step: int
            ) -> tuple[Any, StatusResponse] | None:  # fmt: skip
    """The running lighthouse (not the one with ``lighthouse_uid``) once every group is a member of it in its
    expected generation, runs its pods of that generation, the job's status shows those generations and the job
    committed past ``step``."""
    lh = lighthouse_pod(kube.core, namespace, JOB)
    if lh.metadata.uid == lighthouse_uid:
        return None
    status = lighthouse_status(kube.core, namespace, JOB)
    members = {int(m.group): m.generation for m in status.members}
    running = running_groups(kube.core, namespace, JOB)
    ok = members == generations and status.max_step > step and sorted(running) == list(range(GROUPS))
    ok = ok and all(int(p.metadata.labels[contract.LABEL_GENERATION]) == generations[g]
                    for g, pods in running.items() for p in pods)  # fmt: skip
    job = get_job(kube.custom, namespace, JOB)
    seen = ((job.get("status") or {}).get("lighthouse") or {}).get("seen")
    ok = ok and seen and {i: g["generation"] for i, g in job_groups(job).items()} == generations
    return (lh, status) if ok else None


def test_losing_the_lighthouse_with_groups_replaces_each_lost_group_once(kube, namespace, operators, records):
    operators()
    create_job(kube.custom, namespace, manifest(records))
    generations = dict.fromkeys(range(GROUPS), 0)
    lh, status = wait_for(lambda: settled(kube, namespace, generations, None, 30), 300,
                          "3 groups training under the lighthouse")  # fmt: skip
    losses: Counter[int] = Counter()
    seen_generations: dict[int, set[int]] = {g: {0} for g in range(GROUPS)}

    for number, lost in enumerate(ROUNDS, 1):
        assert status.max_step < STEPS - MARGIN, f"round {number} would land at the end of training: raise STEPS"
        running = running_groups(kube.core, namespace, JOB)
        healthy_pods = {g: sorted(p.metadata.name for p in pods) for g, pods in running.items() if g not in lost}
        doomed = [p.metadata.name for g in lost for p in running[g]]
        # one call for all of them, as the chaos run did: the operator sees them go at (nearly) the same moment
        kubectl(kube.kubeconfig, "delete", "pod", "-n", namespace, "--grace-period=0", "--force", "--wait=false",
                lh.metadata.name, *doomed)  # fmt: skip
        for g in lost:
            generations[g] += 1
            losses[g] += 1
        loss_step = status.max_step

        def recovered(old: str = lh.metadata.uid, floor: int = loss_step + STEPS_PER_ROUND) -> Any:
            job = get_job(kube.custom, namespace, JOB)
            for i, g in job_groups(job).items():
                seen_generations[i].add(g["generation"])
            if condition(job, "Failed"):
                return job["status"]  # (a failed job never settles: say why now)
            return settled(kube, namespace, generations, old, floor)

        outcome = wait_for(
            recovered,
            240,
            f"round {number}: the lighthouse and group(s) {lost} replaced",
            describe=lambda: (seen_generations, get_job(kube.custom, namespace, JOB).get("status")),
        )
        assert isinstance(outcome, tuple), f"round {number}: the job failed: {outcome}"
        lh, status = outcome
        running = running_groups(kube.core, namespace, JOB)
        for g, names in healthy_pods.items():
            assert sorted(p.metadata.name for p in running[g]) == names, f"round {number}: healthy group {g} moved"
        drops = [e for e in status.history if isinstance(e, DroppedEvent)]
        evictions = [e for e in drops if e.reason.startswith("evicted")]
        evicted_healthy = [e for e in evictions if int(e.group) not in lost]
        assert not evicted_healthy, f"round {number}: the new lighthouse evicted healthy groups: {evicted_healthy}"
        current = [e for e in evictions if e.generation == generations[int(e.group)]]
        assert not current, f"round {number}: the replacement generation was evicted: {current}"
        print(f"\n[round {number}] lost lighthouse + groups {list(lost)} at step {loss_step}; drops at the new "
              f"lighthouse: {[(e.group, e.generation, e.reason[:60]) for e in drops]}")  # fmt: skip

    job = wait_for(lambda: (j := get_job(kube.custom, namespace, JOB)) and
                   (condition(j, "Succeeded") or condition(j, "Failed")) and j, 600, "the job to finish")  # fmt: skip
    assert condition(job, "Succeeded"), job["status"]
    final = job_groups(job)
    for g in range(GROUPS):
        assert final[g]["generation"] == losses[g] and final[g]["restarts"] == losses[g], (g, final[g])
        assert seen_generations[g] == set(range(losses[g] + 1)), f"group {g} went through {seen_generations[g]}"
    by_reason = job["status"]["restartsByReason"]
    assert by_reason == {"LighthouseFailed": len(ROUNDS), "PodDeleted": sum(losses.values())}, by_reason
    restarted = {str(g) for g in losses}
    check_run(records, {str(g) for g in range(GROUPS)}, STEPS, restarted,
              start_counts={str(g): n + 1 for g, n in losses.items()}, dead_branches=True)  # fmt: skip
