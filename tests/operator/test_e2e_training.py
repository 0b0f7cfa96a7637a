"""End to end: the real reference trainer under the operator on the local cluster. Three groups train a tiny model;
one group's trainer is killed mid-run; the operator replaces that group alone, it heals from its peers, and the job
Succeeds with every group at the same step and the same parameter digest."""

from __future__ import annotations

import re

import pytest
from ftjob import contract

from tests.support.cluster import kubectl
from tests.support.operator_cluster import (
    condition,
    create_job,
    get_job,
    job_manifest,
    kill_pod_processes,
    lighthouse_status,
    pod_log,
    running_groups,
)
from tests.support.polling import wait_for
from tests.support.trainer_runs import TINY_MODEL_INTEGRITY

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

STEPS = 300  # paced to >= 60 s: the replacement group joins and heals well before the end
TRAIN = ["ftjob-trainer", "train", "--model", "tiny", "--steps", str(STEPS), "--corpus-bytes", "262144",
         "--batch-size", "4", "--log-every", "10", "--min-step-seconds", "0.2"]  # fmt: skip
DONE = re.compile(r"FTJOB_DONE group=(\S+) step=(\d+) digest=(\S+)")


def test_training_job_survives_a_killed_group_and_succeeds_consistently(kube, namespace, operators):
    operators()
    manifest = job_manifest(
        "e2e",
        command=TRAIN,
        replicas=3,
        minReplicas=2,
        lighthouse={"heartbeatTimeoutSeconds": 5},
        failurePolicy={"maxRestartsPerGroup": 2},
        integrity=TINY_MODEL_INTEGRITY,  # this test is about a killed group, not the guard
    )
    create_job(kube.custom, namespace, manifest)
    groups = wait_for(lambda: (g := running_groups(kube.core, namespace, "e2e")) and len(g) == 3 and g, 180,
                      "3 training groups running")  # fmt: skip
    # Kill group 1's trainer once training is under way (a few steps committed, far from the end).
    wait_for(lambda: (lighthouse_status(kube.core, namespace, "e2e").max_step) >= 5, 300,
             "5 committed steps")  # fmt: skip
    victim = groups[1][0]
    assert kill_pod_processes(victim) >= 1
    job = wait_for(lambda: (j := get_job(kube.custom, namespace, "e2e")) and (condition(j, "Succeeded")
                   or condition(j, "Failed")) and j, 600, "the job to finish")  # fmt: skip
    assert condition(job, "Succeeded"), job["status"]
    kubectl(kube.kubeconfig, "wait", "--for=condition=Succeeded", "ftj/e2e", "-n", namespace, "--timeout=5s")
    status = job["status"]
    assert status["totalRestarts"] == 1 and status["restartsByReason"] == {"ExitCode": 1}, status
    g1 = next(g for g in status["replicaGroups"] if g["index"] == 1)
    assert g1["generation"] == 1 and g1["restarts"] == 1

    finals = {}
    for g in status["replicaGroups"]:
        rank0 = next(p for p in g["pods"] if p.endswith("-r0"))
        match = DONE.search(pod_log(kube.core, namespace, rank0))
        assert match, f"no FTJOB_DONE line in {rank0}'s log"
        finals[match.group(1)] = (int(match.group(2)), match.group(3))
    assert set(finals) == {"0", "1", "2"}
    assert {step for step, _ in finals.values()} == {STEPS}, finals
    assert len({digest for _, digest in finals.values()}) == 1, f"groups diverged: {finals}"
    assert victim.metadata.name not in {p for g in status["replicaGroups"] for p in g["pods"]}
    # the replacement prefers any node but the one its predecessor died on
    replacement = kube.core.read_namespaced_pod(g1["pods"][0], namespace)
    preferred = replacement.spec.affinity.node_affinity.preferred_during_scheduling_ignored_during_execution
    avoided = [e.values for t in preferred for e in t.preference.match_expressions if e.operator == "NotIn"]
    assert avoided == [[victim.spec.node_name]]
    assert victim.metadata.labels[contract.LABEL_GROUP] == "1"
