"""Every stuck state says why, for real on the cluster: the scheduler's, the kubelet's and the apiserver's own words
reach the job's Degraded condition, status.reason (a column of `kubectl get ftj`), the group's entry and an Event."""

from __future__ import annotations

import pytest
from kubernetes import client
from test_e2e_training import TRAIN

from tests.support.cluster import cluster, kubectl
from tests.support.operator_cluster import (
    condition,
    create_job,
    get_job,
    job_manifest,
    lighthouse_status,
    running_groups,
)
from tests.support.polling import wait_for

pytestmark = pytest.mark.cluster


def _stuck(kube, namespace: str, name: str, reason: str) -> dict:
    def degraded_for_that_reason() -> dict | None:
        job = get_job(kube.custom, namespace, name)
        degraded = condition(job, "Degraded") if job else None
        return job if degraded and degraded["reason"] == reason and job["status"].get("reason") == reason else None

    return wait_for(degraded_for_that_reason, 120, f"Degraded with reason {reason}",
                    describe=lambda: (get_job(kube.custom, namespace, name) or {}).get("status"))  # fmt: skip


def _event_messages(kube, namespace: str, reason: str) -> list[str]:
    return [e.message for e in kube.core.list_namespaced_event(namespace, field_selector=f"reason={reason}").items]


def test_unschedulable_groups_show_the_schedulers_message(kube, namespace, operators):
    operators()
    manifest = job_manifest("gpus", replicas=2)
    manifest["spec"]["template"]["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": 99}}
    create_job(kube.custom, namespace, manifest)
    _stuck(kube, namespace, "gpus", "Unschedulable")
    # the scheduler tries each group's pod in turn: wait until it has given up on both
    job = wait_for(lambda: (j := get_job(kube.custom, namespace, "gpus")) and "replica groups [0, 1] cannot start"
                   in condition(j, "Degraded")["message"] and j, 60, "both groups Unschedulable")  # fmt: skip
    message = condition(job, "Degraded")["message"]
    assert "replica groups [0, 1] cannot start" in message and "Insufficient nvidia.com/gpu" in message, message
    assert all("Insufficient nvidia.com/gpu" in g["waiting"] for g in job["status"]["replicaGroups"]), job["status"]
    assert "Unschedulable" in kubectl(kube.kubeconfig, "get", "ftj", "gpus", "-n", namespace).stdout
    wait_for(lambda: any("Insufficient nvidia.com/gpu" in m for m in _event_messages(kube, namespace, "Unschedulable")),
             30, "an Unschedulable Event")  # fmt: skip


def test_the_opt_in_scheduling_deadline_fails_the_job_with_the_schedulers_words(kube, namespace, operators):
    operators()
    manifest = job_manifest("late", replicas=1, failurePolicy={"unschedulableTimeoutSeconds": 5})
    manifest["spec"]["template"]["spec"]["containers"][0]["resources"] = {"requests": {"cpu": "999"}}
    create_job(kube.custom, namespace, manifest)
    status = lambda: get_job(kube.custom, namespace, "late").get("status")  # noqa: E731
    job = wait_for(lambda: (j := get_job(kube.custom, namespace, "late")) and condition(j, "Failed") and j, 120,
                   "the job to fail", describe=status)  # fmt: skip
    failed = condition(job, "Failed")
    assert failed["reason"] == "Unschedulable", failed
    assert "unschedulableTimeoutSeconds=5" in failed["message"] and "Insufficient cpu" in failed["message"], failed
    # the Event follows the status write in the same reconcile: poll for it
    wait_for(lambda: any("Insufficient cpu" in m for m in _event_messages(kube, namespace, "Failed")), 30,
             "a Failed Event naming the scheduler's words")  # fmt: skip


def test_an_image_that_cannot_be_pulled_is_named_with_the_kubelets_reason(kube, namespace, operators):
    operators()
    manifest = job_manifest("pull", replicas=1)
    manifest["spec"]["template"]["spec"]["containers"][0]["image"] = "ftjob.local/no-such-image:1"
    create_job(kube.custom, namespace, manifest)

    def pull_reason() -> str | None:
        job = get_job(kube.custom, namespace, "pull")
        reason = (job or {}).get("status", {}).get("reason")
        return reason if reason in ("ErrImagePull", "ImagePullBackOff") else None

    reason = wait_for(pull_reason, 120, "ErrImagePull or ImagePullBackOff in status.reason")
    job = get_job(kube.custom, namespace, "pull")
    assert "no-such-image" in condition(job, "Degraded")["message"], condition(job, "Degraded")
    # the kubelet's own Events say Failed/BackOff: this is the operator's, posted after the status write
    wait_for(lambda: any("no-such-image" in m for m in _event_messages(kube, namespace, reason) + _event_messages(
        kube, namespace, "ImagePullBackOff") + _event_messages(kube, namespace, "ErrImagePull")), 30,
        "a Warning Event naming the image")  # fmt: skip


def test_pod_creation_refused_by_a_quota_becomes_a_condition_and_an_event(kube, namespace, operators):
    operators()
    quota = client.V1ResourceQuota(metadata=client.V1ObjectMeta(name="two-pods"),
                                   spec=client.V1ResourceQuotaSpec(hard={"pods": "2"}))  # fmt: skip
    kube.core.create_namespaced_resource_quota(namespace, quota)
    wait_for(lambda: (kube.core.read_namespaced_resource_quota("two-pods", namespace).status.hard or {}), 30,
             "the quota to be counted")  # fmt: skip
    create_job(kube.custom, namespace, job_manifest("quota", replicas=3, minReplicas=1))  # lighthouse + 3 > 2
    job = _stuck(kube, namespace, "quota", "PodCreationRefused")
    message = condition(job, "Degraded")["message"]
    assert "exceeded quota" in message and "two-pods" in message, message
    refused = [g for g in job["status"]["replicaGroups"] if "waiting" in g]
    assert refused and all(g["waiting"].startswith("PodCreationRefused: 403") for g in refused), refused
    wait_for(lambda: any("exceeded quota" in m for m in _event_messages(kube, namespace, "PodCreationRefused")), 30,
             "a PodCreationRefused Event")  # fmt: skip
    # the quota is lifted: the refused groups are created and the job stops saying it is stuck
    kube.core.delete_namespaced_resource_quota("two-pods", namespace)
    wait_for(lambda: "reason" not in get_job(kube.custom, namespace, "quota")["status"], 120, "status.reason cleared")


@pytest.mark.slow
def test_training_paused_below_min_replicas_says_so_while_the_pods_still_run(kube, namespace, operators):
    """Two of three groups frozen (SIGSTOP: pods Running, no socket reset): the lighthouse stops hearing from them,
    and Running turns False with reason BelowMinReplicas before the operator replaces them."""
    operators()
    manifest = job_manifest("paused", command=TRAIN, replicas=3, minReplicas=2,
                            lighthouse={"heartbeatTimeoutSeconds": 3})  # fmt: skip
    create_job(kube.custom, namespace, manifest)
    groups = wait_for(lambda: (g := running_groups(kube.core, namespace, "paused")) and len(g) == 3 and g, 180,
                      "3 training groups running")  # fmt: skip
    wait_for(lambda: lighthouse_status(kube.core, namespace, "paused").max_step >= 5, 300, "5 committed steps")
    frozen = [f"{namespace}/{groups[g][0].metadata.name}" for g in (1, 2)]
    for pod in frozen:
        cluster("freeze-pod", pod)
    try:

        def paused() -> dict | None:
            job = get_job(kube.custom, namespace, "paused")
            running = next(c for c in job["status"]["conditions"] if c["type"] == "Running")
            return running if running["reason"] == "BelowMinReplicas" else None

        running = wait_for(paused, 60, "Running=False (BelowMinReplicas)")
        assert running["status"] == "False" and "fewer than minReplicas=2" in running["message"], running
        wait_for(lambda: _event_messages(kube, namespace, "BelowMinReplicas"), 30, "a BelowMinReplicas Event")
    finally:
        for pod in frozen:
            cluster("thaw-pod", pod, check=False)
