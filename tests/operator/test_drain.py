"""`kubectl drain` of a node holding 2 of a job's 3 replica groups (minReplicas 2), with a 2 s grace period: the drain
cordons the node, the operator migrates both groups make-before-break (spec.nodeHealth: cordoned), and the job's
PodDisruptionBudget holds every eviction until the group's replacement has taken over (the old pod is then out of the
lighthouse's quorum, so no longer Ready). The drain completes; the lighthouse never has fewer than minReplicas live
groups and signals no abort; no restart spends budget; the job Succeeds with exactly-once samples and equal digests."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from ftjob import contract
from ftjob.operator.resources.manifests import HOSTNAME_LABEL
from ftjob.operator.state import names
from kubernetes import client

from tests.support.cluster import kubectl
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
from tests.support.trainer_runs import check_run, training_job

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

JOB = "drain"
STEPS = 400
MIN_REPLICAS = 2
CORDON_TAINT = {"key": "node.kubernetes.io/unschedulable", "operator": "Exists", "effect": "NoSchedule"}


@pytest.fixture
def drained_node(kube: Any, two_nodes: tuple[str, str]) -> Iterator[tuple[str, str]]:
    """(the node to drain, the other one); the drained node is uncordoned again whatever the test did."""
    survivor, node = two_nodes
    yield node, survivor
    kubectl(kube.kubeconfig, "uncordon", node, check=False)


def place(kube: Any, namespace: str, node: str, survivor: str, records: Any) -> dict[int, list]:
    """Groups 0 and 1 on `node`, group 2 and the lighthouse on `survivor`, by cordoning (which this job's nodeHealth
    ignores while it is placed: cordoned false). The lighthouse is pinned to `survivor` (tolerating its cordon): a
    drain of `node` must not take the job's coordinator along."""
    running = lambda n: (g := running_groups(kube.core, namespace, JOB)) and len(g) == n and g  # noqa: E731
    lighthouse = {
        "heartbeatTimeoutSeconds": 5,
        "nodeSelector": {HOSTNAME_LABEL: survivor},
        "tolerations": [CORDON_TAINT],
    }
    manifest = training_job(JOB, STEPS, records, replicas=2, minReplicas=MIN_REPLICAS)
    manifest["spec"]["lighthouse"].update(lighthouse)
    set_unschedulable(kube.core, survivor, True)
    create_job(kube.custom, namespace, manifest)
    wait_for(lambda: running(2), 240, f"groups 0 and 1 running on {node}")
    set_unschedulable(kube.core, node, True)
    set_unschedulable(kube.core, survivor, False)
    patch_job(kube.custom, namespace, JOB, {"spec": {"replicas": 3}})
    wait_for(lambda: running(3), 240, f"group 2 running on {survivor}")
    set_unschedulable(kube.core, node, False)
    groups = running(3)
    assert groups and [groups[i][0].spec.node_name for i in range(3)] == [node, node, survivor]
    return groups


def budget_holds(policy: client.PolicyV1Api, namespace: str) -> bool:
    """The job's budget counts every group's pod available (in the quorum) and allows no eviction of one."""
    pdb = policy.read_namespaced_pod_disruption_budget(names.disruption_budget(JOB), namespace)
    status = pdb.status
    return (
        pdb.spec.min_available == 3
        and status is not None
        and (status.current_healthy, status.desired_healthy, status.disruptions_allowed) == (3, 3, 0)
    )


def test_a_drain_waits_for_each_replacement_and_never_takes_the_job_below_min_replicas(
    kube, namespace, operators, records, drained_node
):
    node, survivor = drained_node
    operators()
    before = place(kube, namespace, node, survivor, records)
    patch_job(kube.custom, namespace, JOB, {"spec": {"nodeHealth": {"cordoned": True}}})  # what a drain relies on
    policy = client.PolicyV1Api(kube.api)
    wait_for(lambda: budget_holds(policy, namespace), 240, "the budget to count every group's pod in the quorum")
    for pods in before.values():  # Ready only while in the lighthouse's quorum: what the budget counts
        assert [g.condition_type for g in pods[0].spec.readiness_gates or []] == [contract.CONDITION_IN_QUORUM]
    in_step = lambda s: len(s.quorum_groups) == 3 and len({m.step for m in s.members}) == 1  # noqa: E731
    wait_for(lambda: in_step(lighthouse_status(kube.core, namespace, JOB)), 240, "every group in the quorum, in step")
    aborts_before = lighthouse_status(kube.core, namespace, JOB).abort_below

    drain_args = ("drain", node, "--ignore-daemonsets", "--delete-emptydir-data", "--grace-period=2", "--timeout=120s")
    started = time.time()
    samples: list[tuple[int, int]] = []  # (live groups at the lighthouse, abort_below) through the drain
    with ThreadPoolExecutor(1) as pool:
        drain = pool.submit(kubectl, kube.kubeconfig, *drain_args, check=False)

        def drained() -> bool:
            try:
                s = lighthouse_status(kube.core, namespace, JOB)
                samples.append((sum(not m.finished for m in s.members), s.abort_below))
            except (AssertionError, OSError):
                pass  # a poll that found no answer: the next one samples
            return drain.done()

        wait_for(drained, 180, f"kubectl drain {node} to return")
        result = drain.result()
    assert result.returncode == 0, f"the drain did not complete:\n{result.stdout}\n{result.stderr}"
    assert samples, "the lighthouse was never sampled during the drain"
    assert min(live for live, _ in samples) >= MIN_REPLICAS, f"live groups during the drain: {samples}"
    assert max(abort for _, abort in samples) == aborts_before, f"a survivor's step was aborted: {samples}"
    left = [p.metadata.name for p in kube.core.list_namespaced_pod(namespace).items if p.spec.node_name == node]
    assert left == [], f"pods still on the drained node: {left}"

    def finished() -> dict[str, Any] | None:
        job = get_job(kube.custom, namespace, JOB)
        return job if condition(job, "Succeeded") or condition(job, "Failed") else None

    job = wait_for(finished, 600, "the job to finish")
    assert condition(job, "Succeeded"), job["status"]
    status = job["status"]
    assert status["totalRestarts"] == 0 and status["restartsByReason"] == {"NodeDegraded": 2}, status
    groups = {g["index"]: g for g in status["replicaGroups"]}
    for idx in (0, 1):
        pod = kube.core.read_namespaced_pod(groups[idx]["pods"][0], namespace)
        assert pod.spec.node_name == survivor, f"group {idx}'s replacement must run off the drained node"
    assert groups[2]["pods"] == [p.metadata.name for p in before[2]], "group 2 was touched"
    commits = check_run(records, {"0", "1", "2"}, STEPS, {"0", "1"})
    during = [c for cs in commits.values() for c in cs if c.t >= started]
    assert during and all(c.participants >= MIN_REPLICAS for c in during)
    events = {e.reason for e in kube.core.list_namespaced_event(namespace).items}
    assert {"GroupMigrating", "GroupMigrated"} <= events and "GroupRestart" not in events  # make-before-break
