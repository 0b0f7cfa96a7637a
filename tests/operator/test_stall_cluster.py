"""A frozen trainer (every process of its pod SIGSTOPped: no socket resets, its heartbeats just stop) under the
operator, with a heartbeat timeout of 600 s: the lighthouse's progress-based stall rule evicts it within seconds,
the survivor keeps committing, and the operator replaces the frozen group alone, as Stalled."""

from __future__ import annotations

import pytest

from tests.support.cluster import cluster
from tests.support.operator_cluster import (
    create_job,
    dropped_reasons,
    get_job,
    job_manifest,
    lighthouse_status,
    running_groups,
)
from tests.support.polling import wait_for
from tests.support.trainer_runs import TINY_MODEL_INTEGRITY

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

JOB = "stall"
TRAIN = ["ftjob-trainer", "train", "--model", "tiny", "--steps", "100000", "--corpus-bytes", "262144",
         "--batch-size", "4", "--log-every", "50", "--min-step-seconds", "0.2"]  # fmt: skip


def test_a_frozen_group_is_evicted_as_stalled_long_before_its_heartbeat_timeout(kube, namespace, operators):
    operators()
    # 600 s: neither the lighthouse's heartbeat timeout nor the operator's HeartbeatLost (2 x that) can act here
    manifest = job_manifest(JOB, command=TRAIN, replicas=2, minReplicas=1, lighthouse={"heartbeatTimeoutSeconds": 600},
                            integrity=TINY_MODEL_INTEGRITY)  # fmt: skip
    create_job(kube.custom, namespace, manifest)
    before = wait_for(lambda: (g := running_groups(kube.core, namespace, JOB)) and len(g) == 2 and g, 180,
                      "2 training groups running")  # fmt: skip
    # the rule judges only after it has seen a few steps (their median time is its yardstick)
    wait_for(lambda: lighthouse_status(kube.core, namespace, JOB).max_step >= 15, 300, "15 committed steps")
    victim = before[1][0].metadata.name
    cluster("freeze-pod", f"{namespace}/{victim}")
    frozen_at_step = lighthouse_status(kube.core, namespace, JOB).max_step

    job = wait_for(lambda: (j := get_job(kube.custom, namespace, JOB)) and j["status"].get("restartsByReason") and j,
                   90, "the frozen group replaced")  # fmt: skip
    assert job["status"]["restartsByReason"] == {"Stalled": 1}, job["status"]
    g1 = next(g for g in job["status"]["replicaGroups"] if g["index"] == 1)
    assert g1["generation"] == 1 and "stalled: no " in g1["lastFailure"], g1
    status = lighthouse_status(kube.core, namespace, JOB)
    assert dropped_reasons(status)["1"].startswith("evicted: stalled: no "), status.history
    # the survivor was not touched and trains on (without the frozen group, then with its replacement)
    wait_for(lambda: lighthouse_status(kube.core, namespace, JOB).max_step >= frozen_at_step + 20, 120,
             "the survivor to keep committing")  # fmt: skip
    after = running_groups(kube.core, namespace, JOB)
    assert after[0][0].metadata.uid == before[0][0].metadata.uid, "group 0 must not be touched"
