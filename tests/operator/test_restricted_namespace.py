"""A namespace that enforces Pod Security `restricted` admits the whole job: the operator's lighthouse pod as it
builds it, and worker pods from a compliant template. The job trains to Succeeded; nothing was refused."""

from __future__ import annotations

import pytest
from kubernetes import client

from tests.support.operator_cluster import condition, create_job, get_job, job_manifest, lighthouse_pod
from tests.support.polling import wait_for
from tests.support.trainer_runs import TINY_MODEL_INTEGRITY

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

STEPS = 40
RESTRICTED = {
    "pod-security.kubernetes.io/enforce": "restricted",
    "pod-security.kubernetes.io/enforce-version": "latest",
}
COMPLIANT_POD = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
COMPLIANT_CONTAINER = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def test_a_job_in_a_namespace_enforcing_restricted_pod_security_succeeds(kube, namespace, operators):
    kube.core.patch_namespace(namespace, {"metadata": {"labels": RESTRICTED}})
    # the namespace really refuses a pod that is not compliant (else this test would prove nothing)
    bare = client.V1Pod(metadata=client.V1ObjectMeta(name="bare"),
                        spec=client.V1PodSpec(containers=[client.V1Container(name="c", image="x")]))  # fmt: skip
    with pytest.raises(client.ApiException) as refused:
        kube.core.create_namespaced_pod(namespace, bare)
    assert "violates PodSecurity" in str(refused.value.body), refused.value.body

    operators()
    train = ["ftjob-trainer", "train", "--model", "tiny", "--steps", str(STEPS), "--corpus-bytes", "262144",
             "--batch-size", "4", "--min-step-seconds", "0.1"]  # fmt: skip
    m = job_manifest("psa", command=train, replicas=2, integrity=TINY_MODEL_INTEGRITY,
                     lighthouse={"heartbeatTimeoutSeconds": 5})  # fmt: skip
    pod = m["spec"]["template"]["spec"]
    pod["securityContext"] = COMPLIANT_POD
    pod["containers"][0]["securityContext"] = COMPLIANT_CONTAINER
    create_job(kube.custom, namespace, m)
    lh = wait_for(lambda: lighthouse_pod(kube.core, namespace, "psa"), 180, "the lighthouse pod Running")
    ctx = lh.spec.containers[0].security_context
    assert ctx.read_only_root_filesystem and not ctx.allow_privilege_escalation and ctx.capabilities.drop == ["ALL"]
    assert lh.spec.automount_service_account_token is False

    job = wait_for(lambda: (j := get_job(kube.custom, namespace, "psa")) and (condition(j, "Succeeded")
                   or condition(j, "Failed")) and j, 420, "the job to finish")  # fmt: skip
    assert condition(job, "Succeeded"), job["status"]
    assert job["status"]["quorum"]["step"] == STEPS and job["status"]["totalRestarts"] == 0, job["status"]
    refusals = kube.core.list_namespaced_event(namespace, field_selector="reason=PodCreationRefused").items
    assert not refusals, [e.message for e in refusals]
