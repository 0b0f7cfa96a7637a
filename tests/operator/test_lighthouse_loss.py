"""Losing the lighthouse costs nothing: the real reference trainer under the operator, two groups, and the
lighthouse pod force-deleted, gracefully deleted, lost with its node, or lost together with one group. Every time the
groups keep their state, the operator starts a replacement lighthouse from the last quorum id and committed step it
saw, the replacement waits for the groups to come back before its first quorum (no live group is left out of a
step), the survivors go on from where they were, and the job Succeeds with no step trained twice, every sample
trained exactly once and equal parameters everywhere. Prints the time from the loss to the next commit."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from ftjob import contract
from ftjob.contract.lighthouse_api import QuorumEvent

from tests.support.cluster import cluster
from tests.support.operator_cluster import (
    condition,
    create_job,
    get_job,
    kill_pod_processes,
    lighthouse_pod,
    lighthouse_status,
    running_groups,
    set_unschedulable,
)
from tests.support.polling import wait_for
from tests.support.trainer_runs import check_run, commit_gaps, training_job

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

JOB = "lhl"
STEPS = 240
LIGHTHOUSE_PODS = f"{contract.LABEL_JOB}={JOB},{contract.LABEL_ROLE}={contract.ROLE_LIGHTHOUSE}"


def manifest(records: Path, workers_on: str | None = None) -> dict[str, Any]:
    m = training_job(JOB, STEPS, records, workers_on, replicas=2, minReplicas=1)
    # The replacement waits this long from the first group's return for the others (the default 1 s is plenty for
    # a reconnect; 10 s keeps a loaded machine from turning a slow reconnect into a step trained alone).
    m["spec"]["lighthouse"]["joinTimeoutSeconds"] = 10
    return m


def start_job(kube: Any, namespace: str, records: Path, nodes: tuple[str, str] | None) -> dict[int, list]:
    if nodes is None:
        create_job(kube.custom, namespace, manifest(records))
    else:  # the lighthouse alone on node A, both groups on node B
        node_a, node_b = nodes
        set_unschedulable(kube.core, node_b, True)
        create_job(kube.custom, namespace, manifest(records, workers_on=node_b))
        lh = wait_for(lambda: lighthouse_pod(kube.core, namespace, JOB), 120, "the lighthouse running")
        assert lh.spec.node_name == node_a
        set_unschedulable(kube.core, node_b, False)
    return wait_for(lambda: (g := running_groups(kube.core, namespace, JOB)) and len(g) == 2 and g, 240,
                    "2 training groups running")  # fmt: skip


def lighthouse_figures(kube: Any, namespace: str) -> tuple[int, int] | None:
    try:
        s = lighthouse_status(kube.core, namespace, JOB)
    except (AssertionError, OSError):
        return None  # not (or no longer) exactly one running lighthouse
    return s.quorum_id, s.max_step


def first_quorum(kube: Any, namespace: str) -> QuorumEvent | None:
    """The first quorum the running lighthouse issued, from its history (a new lighthouse records its first)."""
    try:
        s = lighthouse_status(kube.core, namespace, JOB)
    except (AssertionError, OSError):
        return None
    return next((e for e in s.history if isinstance(e, QuorumEvent)), None)


@pytest.mark.parametrize("how", ["force-deleted", "gracefully-deleted", "node-killed", "with-a-group"])
def test_losing_the_lighthouse_loses_nothing(kube, namespace, operators, records, how, request):
    nodes = request.getfixturevalue("two_nodes") if how == "node-killed" else None
    operators()
    before = start_job(kube, namespace, records, nodes)
    old = wait_for(lambda: lighthouse_pod(kube.core, namespace, JOB), 120, "the lighthouse running")
    wait_for(lambda: (f := lighthouse_figures(kube, namespace)) and f[1] >= 30, 300, "30 committed steps")
    wait_for(lambda: get_job(kube.custom, namespace, JOB).get("status", {}).get("lighthouse", {}).get("seen"), 60,
             "the operator to record the lighthouse as seen")  # fmt: skip
    id_before, step_before = lighthouse_figures(kube, namespace) or (0, 0)

    lost_at = time.time()
    killed_group = None
    if how == "force-deleted":
        kube.core.delete_namespaced_pod(old.metadata.name, namespace, grace_period_seconds=0)
    elif how == "gracefully-deleted":
        kube.core.delete_namespaced_pod(old.metadata.name, namespace)
    elif how == "node-killed":
        cluster("kill-node", old.spec.node_name)
    else:
        kube.core.delete_namespaced_pod(old.metadata.name, namespace, grace_period_seconds=0)
        assert kill_pod_processes(before[1][0]) >= 1
        killed_group = "1"

    reported: list[int] = []  # the committed step in the job's status, sampled all along
    new_lh: dict[str, Any] = {}

    def finished() -> dict[str, Any] | None:
        job = get_job(kube.custom, namespace, JOB)
        step = ((job.get("status") or {}).get("quorum") or {}).get("step")
        if isinstance(step, int):
            reported.append(step)
        if "first_id" not in new_lh:
            pods = [p for p in kube.core.list_namespaced_pod(namespace, label_selector=LIGHTHOUSE_PODS).items
                    if p.metadata.uid != old.metadata.uid and p.status.phase == "Running"]  # fmt: skip
            first = first_quorum(kube, namespace) if pods else None
            if first is not None:  # the replacement issued its first quorum (its status shows the floor before)
                new_lh.update(first_id=first.quorum_id, first_step=first.step, at=time.time())
        if condition(job, "Succeeded") or condition(job, "Failed"):
            return job
        return None

    job = wait_for(finished, 600, "the job to finish")
    assert condition(job, "Succeeded"), job["status"]
    assert new_lh, "never saw the replacement lighthouse issue a quorum"
    assert new_lh["first_id"] > id_before, f"quorum ids went back: {id_before} -> {new_lh['first_id']}"
    assert new_lh["first_step"] >= step_before, f"the new lighthouse started below step {step_before}: {new_lh}"
    assert reported == sorted(reported), f"status reported a lower committed step: {reported}"
    groups = {g["index"]: g for g in job["status"]["replicaGroups"]}
    for idx, g in groups.items():
        assert g["restarts"] == (1 if str(idx) == killed_group else 0), f"group {idx} restarted: {g}"
        if str(idx) != killed_group:
            assert g["pods"] == [p.metadata.name for p in before[idx]], f"group {idx} lost its pods"
    commits = check_run(records, {"0", "1"}, STEPS, {killed_group} if killed_group else set())
    if killed_group is None:  # both groups lived through the loss: the replacement never let one train alone
        alone = [(g, c.step) for g, cs in commits.items() for c in cs if c.t > lost_at and c.participants < 2]
        assert not alone, f"(group, step) trained without the other live group after the loss: {alone}"
    after = [c.t for c in commits["0"] if c.t > lost_at]  # group 0 survives every case
    assert after, "no commit after the loss"
    to_commit = after[0] - lost_at
    heals = {g: sum(c.healed for c in cs) for g, cs in sorted(commits.items())}
    stall, median = commit_gaps(commits["0"], lost_at, new_lh["at"] + 5)
    print(f"\n[lighthouse loss: {how}] loss -> next commit {to_commit:.2f}s; group 0's longest commit gap until the "
          f"replacement served {stall:.2f}s (median step {median:.2f}s); loss -> replacement's first quorum "
          f"{new_lh['at'] - lost_at:.2f}s (polled); heals by group {heals}")  # fmt: skip
