"""The real apiserver rejects bad FaultTolerantTrainingJobs with messages that name the field and say what to fix,
and applies the defaults. No operator runs here: this is the CRD alone."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import pytest
from kubernetes import client

from tests.support.cluster import kubectl
from tests.support.operator_cluster import create_job, job_manifest, patch_job
from tests.support.paths import REPO

pytestmark = pytest.mark.cluster

Mutation = Callable[[dict[str, Any]], None]


def _set(path: str, value: Any) -> Mutation:
    def apply(m: dict[str, Any]) -> None:
        node = m
        keys = path.split(".")
        for k in keys[:-1]:
            node = node.setdefault(k, {}) if not k.isdigit() else node[int(k)]
        node[keys[-1]] = value

    return apply


def _drop_containers(m: dict[str, Any]) -> None:
    m["spec"]["template"]["spec"]["containers"] = []


def _no_image(m: dict[str, Any]) -> None:
    m["spec"]["template"]["spec"]["containers"][0].pop("image")


def _ranks(n: int, gpus: int | str | None = None, command: bool = True) -> Mutation:
    """spec.ranksPerPod n; the first container's nvidia.com/gpu limit, and without its command when asked."""

    def apply(m: dict[str, Any]) -> None:
        m["spec"]["ranksPerPod"] = n
        container = m["spec"]["template"]["spec"]["containers"][0]
        if gpus is not None:
            container["resources"] = {"limits": {"nvidia.com/gpu": gpus}}
        if not command:
            container.pop("command")

    return apply


INVALID: list[tuple[str, Mutation, list[str]]] = [
    ("min-above-replicas", _set("spec.minReplicas", 5), ["spec.minReplicas", "must be <= spec.replicas"]),
    ("zero-replicas", _set("spec.replicas", 0), ["spec.replicas", "greater than or equal to 1"]),
    ("negative-spares", _set("spec.spareReplicas", -1), ["spec.spareReplicas", "greater than or equal to 0"]),
    ("zero-pods-per-replica", _set("spec.podsPerReplica", 0), ["spec.podsPerReplica"]),
    ("ranks-per-pod-without-command", _ranks(2, command=False),
     ["spec.ranksPerPod", "needs spec.template.spec.containers[0].command", "ENTRYPOINT"]),
    ("gpus-not-a-multiple-of-ranks", _ranks(2, gpus=3), ["spec.ranksPerPod", "multiple of spec.ranksPerPod",
                                                          "one GPU per rank"]),
    ("gpus-as-string-not-a-multiple", _ranks(8, gpus="4"), ["one GPU per rank"]),
    ("ranks-per-pod-above-16", _ranks(17), ["spec.ranksPerPod", "less than or equal to 16"]),
    ("zero-ranks-per-pod", _ranks(0), ["spec.ranksPerPod", "greater than or equal to 1"]),
    ("no-containers", _drop_containers, ["spec.template.spec.containers", "at least one container"]),
    ("container-without-image", _no_image, ["needs a non-empty image"]),
    ("container-name-uppercase", _set("spec.template.spec.containers.0.name", "Trainer"),
     ["spec.template.spec.containers[0].name", "lowercase DNS label"]),
    ("container-name-underscore", _set("spec.template.spec.containers.0.name", "my_trainer"), ["lowercase DNS label"]),
    ("container-names-twice", _set("spec.template.spec.containers", [{"name": "a", "image": "x"},
                                                                      {"name": "a", "image": "y"}]),
     ["container names in spec.template.spec.containers must be unique"]),
    ("restart-policy-always", _set("spec.template.spec.restartPolicy", "Always"), ["restartPolicy must be Never"]),
    ("hostname-set", _set("spec.template.spec.hostname", "x"), ["hostname and subdomain are set by the operator"]),
    ("negative-group-budget", _set("spec.failurePolicy.maxRestartsPerGroup", -1),
     ["spec.failurePolicy.maxRestartsPerGroup", "greater than or equal to 0"]),
    ("negative-total-budget", _set("spec.failurePolicy.maxTotalRestarts", -3),
     ["spec.failurePolicy.maxTotalRestarts", "greater than or equal to 0"]),
    ("zero-window", _set("spec.failurePolicy.restartWindowSeconds", 0), ["spec.failurePolicy.restartWindowSeconds"]),
    ("backoff-base-above-max", _set("spec.failurePolicy.backoff", {"baseSeconds": 30, "maxSeconds": 5}),
     ["baseSeconds must be <= failurePolicy.backoff.maxSeconds"]),
    ("rule-unknown-action", _set("spec.failurePolicy.rules", [{"action": "Retry", "onExitCodes": {"values": [1]}}]),
     ["spec.failurePolicy.rules[0].action", "Unsupported value"]),
    ("rule-empty-codes", _set("spec.failurePolicy.rules", [{"action": "FailJob", "onExitCodes": {"values": []}}]),
     ["onExitCodes.values must list at least one exit code"]),
    ("rule-exit-zero", _set("spec.failurePolicy.rules", [{"action": "FailJob", "onExitCodes": {"values": [0, 3]}}]),
     ["must not contain 0 with operator In"]),
    ("rule-code-out-of-range", _set("spec.failurePolicy.rules",
                                    [{"action": "FailJob", "onExitCodes": {"values": [300]}}]),
     ["spec.failurePolicy.rules[0].onExitCodes.values[0]", "less than or equal to 255"]),
    ("rule-duplicate-codes", _set("spec.failurePolicy.rules",
                                  [{"action": "FailJob", "onExitCodes": {"values": [3, 3]}}]),
     ["spec.failurePolicy.rules[0].onExitCodes.values[1]", "Duplicate value"]),
    ("heartbeat-timeout-zero", _set("spec.lighthouse.heartbeatTimeoutSeconds", 0),
     ["lighthouse.heartbeatTimeoutSeconds must be > 0"]),
    ("stall-factor-negative", _set("spec.lighthouse.stallFactor", -1), ["lighthouse.stallFactor must be >= 0"]),
    ("stall-floor-zero", _set("spec.lighthouse.stallFloorSeconds", 0), ["lighthouse.stallFloorSeconds must be > 0"]),
    ("lighthouse-node-selector-not-string", _set("spec.lighthouse.nodeSelector", {"pool": 3}),
     ["spec.lighthouse.nodeSelector.pool", "must be of type string"]),
    ("lighthouse-pull-secret-without-name", _set("spec.lighthouse.imagePullSecrets", [{}]),
     ["spec.lighthouse.imagePullSecrets[0].name", "Required value"]),
    ("negative-ttl", _set("spec.ttlSecondsAfterFinished", -1), ["spec.ttlSecondsAfterFinished"]),
    ("name-too-long", _set("metadata.name", "a" * 41), ["metadata.name must be at most 40 characters"]),
    ("missing-template", lambda m: m["spec"].pop("template"), ["spec.template", "Required value"]),
]  # fmt: skip


@pytest.mark.parametrize("mutate,expected", [pytest.param(m, e, id=i) for i, m, e in INVALID])
def test_invalid_manifest_is_rejected_with_a_message_naming_the_field(kube, crd, namespace, mutate, expected):
    manifest = job_manifest("bad")
    mutate(manifest)
    with pytest.raises(client.ApiException) as err:
        create_job(kube.custom, namespace, manifest)
    assert err.value.status == 422, err.value.body
    message = json.loads(err.value.body)["message"]  # what kubectl prints
    for text in expected:
        assert text in message, f"{text!r} not in the apiserver's answer: {message}"


def test_defaults_are_applied_and_pods_per_replica_is_immutable(kube, crd, namespace):
    manifest = job_manifest("ok")
    manifest["spec"].pop("failurePolicy")
    manifest["spec"].pop("lighthouse")
    created = create_job(kube.custom, namespace, copy.deepcopy(manifest))
    spec = created["spec"]
    assert spec["podsPerReplica"] == 1 and spec["spareReplicas"] == 0 and spec["suspend"] is False
    assert spec["failurePolicy"]["maxRestartsPerGroup"] == 3 and spec["failurePolicy"]["backoff"]["maxSeconds"] == 60
    assert spec["lighthouse"]["heartbeatTimeoutSeconds"] == 5
    assert (spec["lighthouse"]["stallFactor"], spec["lighthouse"]["stallFloorSeconds"]) == (3, 1)
    with pytest.raises(client.ApiException) as err:
        patch_job(kube.custom, namespace, "ok", {"spec": {"podsPerReplica": 4}})
    assert err.value.status == 422 and "spec.podsPerReplica is immutable" in json.loads(err.value.body)["message"]
    patch_job(kube.custom, namespace, "ok", {"spec": {"replicas": 3}})  # other fields stay editable
    assert spec["ranksPerPod"] == 1


def test_ranks_per_pod_with_a_gpu_each_is_accepted_and_immutable(kube, crd, namespace):
    manifest = job_manifest("hsdp")
    _ranks(8, gpus=8)(manifest)
    # a sidecar with no GPU and unquoted fractional quantities (the Pod API takes them) pass too
    manifest["spec"]["template"]["spec"]["containers"].append(
        {"name": "side", "image": "busybox", "resources": {"limits": {"cpu": 0.5}}}
    )
    assert create_job(kube.custom, namespace, manifest)["spec"]["ranksPerPod"] == 8
    with pytest.raises(client.ApiException) as err:
        patch_job(kube.custom, namespace, "hsdp", {"spec": {"ranksPerPod": 4}})
    assert err.value.status == 422 and "spec.ranksPerPod is immutable" in json.loads(err.value.body)["message"]


@pytest.mark.parametrize("example", sorted((REPO / "crds" / "examples").glob("*.yaml")), ids=lambda p: p.stem)
def test_examples_are_accepted(kube, crd, namespace, example):
    out = kubectl(kube.kubeconfig, "apply", "--dry-run=server", "-n", namespace, "-f", str(example))
    assert "created (server dry run)" in out.stdout
