"""Make-before-break: a node reports a problem condition (as node-problem-detector would) while a replica group
trains on it. The operator starts the group's replacement on another node first; the old group leaves at a step
boundary only once the replacement registers, so the other groups never abort a step; with a spare, the spare takes
over at once. The job Succeeds with exactly-once samples and equal digests. Prints the survivors' longest commit gap
during the migration next to their median step time (the stall, measured)."""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from tests.support.operator_cluster import (
    condition,
    create_job,
    get_job,
    lighthouse_status,
    patch_job,
    running_groups,
    set_unschedulable,
)
from tests.support.polling import wait_for
from tests.support.trainer_runs import check_run, commit_gaps, training_job

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

JOB = "mig"
STEPS = 400
PROBLEM = "KernelDeadlock"  # one of node-problem-detector's conditions, in nodeHealth's defaults


def set_condition(core: client.CoreV1Api, node: str, status: str) -> None:
    now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    cond = {"type": PROBLEM, "status": status, "reason": "FtjobTest", "message": "task hung (ftjob test)",
            "lastHeartbeatTime": now, "lastTransitionTime": now}  # fmt: skip
    core.patch_node_status(node, {"status": {"conditions": [cond]}})


@pytest.fixture
def problem_node(kube: Any, two_nodes: tuple[str, str]) -> Iterator[tuple[str, str]]:
    """Two nodes; the second one's problem condition is cleared again afterwards whatever the test did."""
    yield two_nodes
    set_condition(kube.core, two_nodes[1], "False")


def place(kube: Any, namespace: str, nodes: tuple[str, str], records: Path, spares: int) -> dict[int, list]:
    """Group 1 alone on node B; the lighthouse, group 0 (and the spare, group 2) on node A. By cordoning, which this
    job's nodeHealth ignores (cordoned: false) so only the condition moves a group."""
    node_a, node_b = nodes
    running = lambda n: (g := running_groups(kube.core, namespace, JOB)) and len(g) == n and g  # noqa: E731
    set_unschedulable(kube.core, node_b, True)
    create_job(kube.custom, namespace, training_job(JOB, STEPS, records, replicas=1, minReplicas=1))
    wait_for(lambda: running(1), 240, "group 0 running on node A")
    set_unschedulable(kube.core, node_a, True)
    set_unschedulable(kube.core, node_b, False)
    patch_job(kube.custom, namespace, JOB, {"spec": {"replicas": 2}})
    wait_for(lambda: running(2), 240, "group 1 running on node B")
    set_unschedulable(kube.core, node_a, False)
    if spares:
        set_unschedulable(kube.core, node_b, True)
        patch_job(kube.custom, namespace, JOB, {"spec": {"spareReplicas": spares}})
        wait_for(lambda: running(2 + spares), 240, "the spare running on node A")
        set_unschedulable(kube.core, node_b, False)
    groups = running(2 + spares)
    assert groups and [groups[i][0].spec.node_name for i in sorted(groups)] == [node_a, node_b, node_a][: 2 + spares]
    return groups


@pytest.mark.parametrize("spares", [0, 1], ids=["without-a-spare", "with-a-spare"])
def test_a_group_leaves_a_degrading_node_before_it_fails(kube, namespace, operators, records, problem_node, spares):
    node_a, node_b = problem_node
    operators()
    before = place(kube, namespace, problem_node, records, spares)
    everyone = set(before)
    in_step = lambda s: len(s.quorum_groups) == len(everyone) and len({m.step for m in s.members}) == 1  # noqa: E731
    wait_for(lambda: in_step(lighthouse_status(kube.core, namespace, JOB)), 240, "every group in the quorum, in step")
    aborts_before = lighthouse_status(kube.core, namespace, JOB).abort_below

    marked_at = time.time()
    set_condition(kube.core, node_b, "True")
    aborts: list[int] = []
    moved: dict[str, float] = {}

    def finished() -> dict[str, Any] | None:
        try:
            aborts.append(lighthouse_status(kube.core, namespace, JOB).abort_below)
        except (AssertionError, OSError):
            pass  # the job ended: its lighthouse is gone
        job = get_job(kube.custom, namespace, JOB)
        g1 = next((g for g in (job.get("status") or {}).get("replicaGroups", []) if g["index"] == 1), {})
        if "done" not in moved and g1.get("generation", 0) > before_gen and "migratingFrom" not in g1:
            moved["done"] = time.time()
        if condition(job, "Succeeded") or condition(job, "Failed"):
            return job
        return None

    before_gen = next(g for g in get_job(kube.custom, namespace, JOB)["status"]["replicaGroups"] if g["index"] == 1)[
        "generation"
    ]
    job = wait_for(finished, 600, "the job to finish")
    assert condition(job, "Succeeded"), job["status"]
    status = job["status"]
    assert status["totalRestarts"] == 0 and status["restartsByReason"] == {"NodeDegraded": 1}, status
    groups = {g["index"]: g for g in status["replicaGroups"]}
    new_pod = kube.core.read_namespaced_pod(groups[1]["pods"][0], namespace)
    assert new_pod.spec.node_name == node_a, "the replacement must leave the degrading node"
    for idx in everyone - {1}:
        assert groups[idx]["pods"] == [p.metadata.name for p in before[idx]], f"group {idx} was touched"
    assert aborts and max(aborts) == aborts_before, f"a survivor's step was aborted: abort_below {aborts}"
    assert moved, "the migration never completed"
    events = kube.core.list_namespaced_event(namespace).items
    assert {"GroupMigrating", "GroupMigrated"} <= {e.reason for e in events}

    commits = check_run(records, {str(i) for i in everyone}, STEPS, {"1"})
    stall, median = commit_gaps(commits["0"], marked_at, moved["done"])
    print(f"\n[migration {'with' if spares else 'without'} a spare] survivors' longest commit gap during the "
          f"migration {stall:.3f}s, median step {median:.3f}s; condition -> old group gone "
          f"{moved['done'] - marked_at:.1f}s")  # fmt: skip
